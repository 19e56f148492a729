"""A resume with optimiser settings named on the command line trains with them from the resumed step: each AdamW
group's rate is the new learning rate times the group's multiplier times the warm-up cosine at the step, read from
the rates a real `mmoe fit` logs; a change that regroups the parameters is refused in one line."""

from __future__ import annotations

import csv
import dataclasses
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from mmoe.model.config import PRESETS
from mmoe.runtime.optimizer import OptimizerConfig, adamw_with_schedule, parameter_groups, warmup_cosine
from mmoe.runtime.optimizer_resume import apply_optimizer_config, changed_settings
from mmoe.tasks.nlvr2 import NLVR2FineTuning
from tests.cli.test_checkpoint_resume_last import error_line, fit, nlvr2_config, saved, write_config
from tests.cli_fixtures import small_shards
from tests.tasks.resumable_fit import ENV, fit_command

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

#: The first run's optimiser: BEiT-3's layer decay gives every backbone layer its own AdamW groups.
FIRST = OptimizerConfig(learning_rate=2e-4, warmup_steps=2, total_steps=20, layer_decay=0.65)
FIRST_STEPS, RESUMED_STEPS = 4, 7
LR_MONITOR = {
    "class_path": "lightning.pytorch.callbacks.LearningRateMonitor",
    "init_args": {"logging_interval": "step"},
}


def logged_config(shards: Path, run: Path, steps: int, version: str) -> dict:
    """The tiny NLVR2 fine-tuning of :data:`FIRST`, its AdamW groups' rates logged every step into
    ``run/csv/<version>/metrics.csv``."""
    config = nlvr2_config(shards, run, steps)
    trainer = config["trainer"]
    trainer.update(log_every_n_steps=1, callbacks=[*trainer["callbacks"], LR_MONITOR])
    trainer["logger"] = {"class_path": "lightning.pytorch.loggers.CSVLogger",
                         "init_args": {"save_dir": str(run), "name": "csv", "version": version}}  # fmt: skip
    config["model"]["init_args"]["optimizer"] = FIRST.to_dict()
    return config


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path]:
    """(shards, a run folder trained :data:`FIRST_STEPS` steps with :data:`FIRST`), to copy before resuming."""
    root = tmp_path_factory.mktemp("optimizer_resume")
    shards, run = small_shards(root), root / "run"
    config = write_config(root / "first.yaml", logged_config(shards, run, FIRST_STEPS, "first"))
    done = subprocess.run(fit_command(Path(config)), cwd=root, env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return shards, run


def group_scales(config: OptimizerConfig) -> list[float]:
    """Each AdamW group's learning-rate multiplier in the tiny NLVR2 task, in the optimiser's order."""
    task = NLVR2FineTuning(backbone=dict(PRESETS["test"]), optimizer=config)
    return [group["lr_scale"] for group in parameter_groups(task, config, task.head_prefixes)]


def logged_rates(run: Path, version: str) -> dict[int, list[float]]:
    """step -> the rate of each AdamW group (LearningRateMonitor's ``lr-AdamW/pg<i>``) the step trained with."""
    with open(run / "csv" / version / "metrics.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    columns = sorted((name for name in rows[0] if name.startswith("lr-AdamW/pg")), key=lambda name: int(name[11:]))
    return {int(row["step"]): [float(row[name]) for name in columns] for row in rows if row.get(columns[0])}


def schedule_rates(config: OptimizerConfig, step: int) -> list[float]:
    multiplier = warmup_cosine(config.warmup_steps, config.total_steps, config.min_lr_ratio)(step)
    return [config.learning_rate * scale * multiplier for scale in group_scales(config)]


@pytest.mark.slow
def test_a_learning_rate_named_on_resume_is_trained_from_the_resumed_step(trained, tmp_path):
    shards, first_run = trained
    run = tmp_path / "run"
    shutil.copytree(first_run, run)
    before = logged_rates(run, "first")
    assert sorted(before) == list(range(FIRST_STEPS)) and len(before[0]) == len(group_scales(FIRST)) > 2
    for step, rates in before.items():
        assert rates == pytest.approx(schedule_rates(FIRST, step), rel=1e-6)

    config = write_config(tmp_path / "resumed.yaml", logged_config(shards, run, RESUMED_STEPS, "resumed"))
    options = ["--model.init_args.optimizer.learning_rate", "2e-2", "--ckpt_path", "last"]
    resumed = subprocess.run(fit_command(Path(config), *options), cwd=tmp_path, env=ENV, capture_output=True,
                             text=True, timeout=600)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    changed = dataclasses.replace(FIRST, learning_rate=2e-2)
    after = logged_rates(run, "resumed")
    assert sorted(after) == list(range(FIRST_STEPS, RESUMED_STEPS))
    for step, rates in after.items():
        assert rates == pytest.approx(schedule_rates(changed, step), rel=1e-6)
    expected = (
        f"mmoe fit: resumed with optimizer settings other than the checkpoint's, from global step {FIRST_STEPS} on: "
        "learning_rate 0.0002 -> 0.02 (the schedule goes on from that step; AdamW's moments are kept)"
    )
    assert expected in resumed.stderr.splitlines(), resumed.stderr[-3000:]
    last = saved(run / "checkpoints" / "last.ckpt")
    assert last["hyper_parameters"]["optimizer"]["learning_rate"] == 2e-2
    assert last["lr_schedulers"][0]["base_lrs"] == pytest.approx([2e-2 * scale for scale in group_scales(FIRST)])


@pytest.mark.slow
@pytest.mark.parametrize("option, value, shown", [("weight_decay", "0", "0.05 -> 0.0"),
                                                  ("layer_decay", "1", "0.65 -> 1.0")])  # fmt: skip
def test_a_change_that_regroups_the_parameters_is_refused_in_one_line(trained, tmp_path, capsys, option, value, shown):
    shards, first_run = trained
    run = tmp_path / "run"
    shutil.copytree(first_run, run)
    config = write_config(tmp_path / "resumed.yaml", logged_config(shards, run, RESUMED_STEPS, "resumed"))
    line = error_line(capsys, ["fit", "--config", config, f"--model.init_args.optimizer.{option}", value,
                               "--ckpt_path", "last"])  # fmt: skip
    assert line.startswith(f"mmoe fit: error: --ckpt_path {run / 'checkpoints' / 'last.ckpt'}: ")
    assert f"{option} {shown}" in line and "resume with the checkpoint's values" in line
    assert saved(run / "checkpoints" / "last.ckpt")["global_step"] == FIRST_STEPS  # nothing was trained


def restored_optimizer(task: NLVR2FineTuning, first: OptimizerConfig, steps: int) -> dict:
    """The optimiser the task's config builds, with the state of one built from ``first`` and stepped ``steps``
    times loaded over it, as Lightning restores a checkpoint."""
    earlier = adamw_with_schedule(task, first, task.head_prefixes, lambda: 100)
    for parameter in task.parameters():
        parameter.grad = torch.ones_like(parameter)
    for _ in range(steps):
        earlier["optimizer"].step()
        earlier["lr_scheduler"]["scheduler"].step()
    configured = adamw_with_schedule(task, task.optimizer_config, task.head_prefixes, lambda: 100)
    configured["optimizer"].load_state_dict(earlier["optimizer"].state_dict())
    configured["lr_scheduler"]["scheduler"].load_state_dict(earlier["lr_scheduler"]["scheduler"].state_dict())
    return configured


def test_the_restored_optimizer_takes_the_configs_rates_decay_and_schedule():
    config = dataclasses.replace(FIRST, learning_rate=1e-3, weight_decay=0.1, total_steps=40, betas=(0.8, 0.9))
    task = NLVR2FineTuning(backbone=dict(PRESETS["test"]), optimizer=config)
    restored = restored_optimizer(task, FIRST, steps=5)
    optimizer, scheduler = restored["optimizer"], restored["lr_scheduler"]["scheduler"]
    assert optimizer.param_groups[0]["lr"] == pytest.approx(schedule_rates(FIRST, 5)[0])  # the checkpoint's
    groups = parameter_groups(task, config, task.head_prefixes)
    apply_optimizer_config(optimizer, scheduler, groups, config)
    assert [group["lr"] for group in optimizer.param_groups] == pytest.approx(schedule_rates(config, 5))
    assert scheduler.get_last_lr() == [group["lr"] for group in optimizer.param_groups]
    assert scheduler.base_lrs == [group["initial_lr"] for group in optimizer.param_groups]
    assert [group["weight_decay"] for group in optimizer.param_groups] == [group["weight_decay"] for group in groups]
    assert {0.0, 0.1} == {group["weight_decay"] for group in optimizer.param_groups}
    assert all(group["betas"] == (0.8, 0.9) for group in optimizer.param_groups)
    scheduler.step()
    assert [group["lr"] for group in optimizer.param_groups] == pytest.approx(schedule_rates(config, 6))
    assert torch.equal(optimizer.state_dict()["state"][0]["step"], torch.tensor(5.0))  # AdamW's moments kept


def test_only_the_settings_that_differ_are_changes():
    assert changed_settings(FIRST.to_dict(), FIRST) == {}
    saved = FIRST.to_dict() | {"betas": [0.9, 0.98]}
    assert changed_settings(saved, FIRST) == {"betas": ([0.9, 0.98], [0.9, 0.999])}
    assert changed_settings({"learning_rate": 1e-3}, FIRST) == {"learning_rate": (1e-3, 2e-4)}  # an older checkpoint
    with pytest.raises(ValueError, match="not valid optimizer settings"):
        changed_settings({"weight_decay": "heavy"}, FIRST)


@pytest.mark.slow
@pytest.mark.parametrize("first_steps, resumed_steps", [(4, 8), (6, 7)], ids=["doubled", "one_more"])
def test_a_resume_with_another_max_steps_says_so_and_trains_on_the_new_schedule(
    tmp_path, capsys, first_steps, resumed_steps
):
    """Without ``total_steps`` the cosine is ``trainer.max_steps`` long: a resume that changes it trains its first
    step at the new schedule's rate (not the old schedule's last, 0 at its end) and says so in one line."""
    shards, run = small_shards(tmp_path), tmp_path / "run"
    optimizer = OptimizerConfig(learning_rate=2e-4, warmup_steps=0)
    config = logged_config(shards, run, first_steps, "first")
    config["model"]["init_args"]["optimizer"] = optimizer.to_dict()
    fit(capsys, write_config(tmp_path / "first.yaml", config))
    config = logged_config(shards, run, resumed_steps, "resumed")
    config["model"]["init_args"]["optimizer"] = optimizer.to_dict()
    err = fit(capsys, write_config(tmp_path / "resumed.yaml", config), "--ckpt_path", "last")
    new = dataclasses.replace(optimizer, total_steps=resumed_steps)
    after = logged_rates(run, "resumed")
    assert sorted(after) == list(range(first_steps, resumed_steps))
    for step, rates in after.items():
        assert rates == pytest.approx(schedule_rates(new, step), rel=1e-6)
    old_rate = schedule_rates(dataclasses.replace(optimizer, total_steps=first_steps), first_steps)[0]
    expected = (
        f"mmoe fit: resumed with a learning-rate schedule of {resumed_steps} steps where the checkpoint's had "
        f"{first_steps} (trainer.max_steps, or model.init_args.optimizer.total_steps, changed): the warm-up cosine is "
        f"re-stretched to {resumed_steps} steps and goes on from global step {first_steps} at lr "
        f"{after[first_steps][0]:.3g} (the checkpoint's schedule gave {old_rate:.3g})"
    )
    assert any(line.startswith(expected) for line in err.splitlines()), err[-3000:]
