"""A non-finite training step (:mod:`mmoe.runtime.non_finite`): stopped before the update with nothing saved, or skipped
(no update, AdamW's state untouched, counted) and resumed exactly; unit runs of a small module with a NaN injected at
chosen steps, a real diverging ``mmoe fit``, and one whose loss-free selection biases overflow."""

from __future__ import annotations

import csv
import math
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from mmoe.config.extends import read_config_file
from mmoe.runtime.non_finite import DIVERGED_EXIT, NonFiniteGuard, NonFiniteTraining
from tests.cli_fixtures import run_mmoe, small_shards

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")

STEPS = 6


class Regression(L.LightningModule):
    """A linear regression trained with AdamW on one fixed random batch; the loss (``bad="loss"``) or only the
    gradients (``bad="gradients"``: the loss gets ``sqrt(0)``, whose gradient is infinite) are made non-finite at the
    steps ``bad_steps``. Records the weights before and after each step."""

    def __init__(self, bad_steps: tuple[int, ...] = (), bad: str = "loss") -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.bad_steps, self.bad = bad_steps, bad
        self.weights: dict[int, torch.Tensor] = {}

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        if self.global_step in self.bad_steps:
            if self.bad == "loss":
                loss = loss * torch.tensor(math.nan)
            else:
                total = self.layer.weight.sum()
                loss = loss + torch.sqrt(total - total.detach())
        return loss

    def on_train_batch_start(self, batch, batch_idx) -> None:
        self.weights[self.global_step] = self.layer.weight.detach().clone()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.1)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(64, 4, generator=generator)
        y = x.sum(dim=1, keepdim=True)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=64)  # one batch an epoch


def trainer(root: Path, guard: NonFiniteGuard, max_steps: int = STEPS, **kwargs) -> L.Trainer:
    """Saves every step's checkpoint (``step=<N>.ckpt``) and logs to ``root/csv``."""
    checkpoints = ModelCheckpoint(dirpath=root / "checkpoints", filename="{step}", every_n_train_steps=1,
                                  save_top_k=-1, save_last=True)  # fmt: skip
    return L.Trainer(max_steps=max_steps, accelerator="cpu", callbacks=[guard, checkpoints], enable_progress_bar=False,
                     enable_model_summary=False, logger=CSVLogger(root, name="csv", version=0),
                     default_root_dir=root, **kwargs)  # fmt: skip


def adam_steps(path: Path) -> list[float]:
    """AdamW's per-parameter step counts in a checkpoint."""
    states = torch.load(path, weights_only=True)["optimizer_states"][0]["state"]
    return [float(state["step"]) for state in states.values()]


@pytest.mark.parametrize("bad", ["loss", "gradients"])
def test_a_skipped_step_updates_nothing_and_is_counted(tmp_path, bad, capsys):
    torch.manual_seed(0)
    model = Regression(bad_steps=(2,), bad=bad)
    guard = NonFiniteGuard(action="skip")
    trainer(tmp_path, guard).fit(model)
    assert torch.equal(model.weights[2], model.weights[3])  # step 2 changed no weight
    assert not torch.equal(model.weights[1], model.weights[2]) and not torch.equal(model.weights[3], model.weights[4])
    assert adam_steps(tmp_path / "checkpoints" / "step=2.ckpt") == [2.0, 2.0]
    assert adam_steps(tmp_path / "checkpoints" / "step=3.ckpt") == [2.0, 2.0]  # AdamW's moments were not stepped
    assert adam_steps(tmp_path / "checkpoints" / "step=4.ckpt") == [3.0, 3.0]
    assert guard.skipped == 1 and guard.first_skipped == [2]
    with open(tmp_path / "csv" / "version_0" / "metrics.csv") as handle:
        logged = [row for row in csv.DictReader(handle) if row.get("train/skipped_nonfinite_steps")]
    assert [(row["step"], float(row["train/skipped_nonfinite_steps"])) for row in logged] == [("2", 1.0)]
    for name in ("step=3.ckpt", "last.ckpt"):
        state = torch.load(tmp_path / "checkpoints" / name, weights_only=True)["state_dict"]
        assert all(torch.isfinite(value).all() for value in state.values())
    assert "mmoe fit: 1 training steps skipped for a non-finite loss or gradients (step 2)" in capsys.readouterr().err


def test_stop_raises_before_the_update_and_saves_nothing_at_that_step(tmp_path):
    torch.manual_seed(0)
    model = Regression(bad_steps=(3,))
    with pytest.raises(NonFiniteTraining, match=r"non-finite loss at step 3") as stopped:
        trainer(tmp_path, NonFiniteGuard()).fit(model)
    assert "\n" not in str(stopped.value)
    assert torch.equal(model.layer.weight, model.weights[3])  # the weights of the last good step
    saved = sorted(path.name for path in (tmp_path / "checkpoints").glob("*.ckpt"))
    assert saved == ["last.ckpt", "step=1.ckpt", "step=2.ckpt", "step=3.ckpt"]
    last = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    assert last["global_step"] == 3 and torch.equal(last["state_dict"]["layer.weight"], model.weights[3])


def test_too_many_consecutive_skips_stop_the_run(tmp_path):
    model = Regression(bad_steps=(1, 2, 3))
    with pytest.raises(NonFiniteTraining, match=r"at step 3: 3 non-finite steps in a row"):
        trainer(tmp_path, NonFiniteGuard(action="skip", max_consecutive_skips=3)).fit(model)
    # A good step in between starts the count again.
    guard = NonFiniteGuard(action="skip", max_consecutive_skips=2)
    trainer(tmp_path / "again", guard).fit(Regression(bad_steps=(1, 3)))
    assert guard.skipped == 2 and guard.consecutive_skips == 0


def test_a_run_resumed_after_a_skipped_step_ends_as_the_uninterrupted_one(tmp_path):
    torch.manual_seed(0)
    straight = Regression(bad_steps=(2,))
    trainer(tmp_path / "straight", NonFiniteGuard(action="skip")).fit(straight)
    torch.manual_seed(1)  # a different initialisation: the checkpoint must bring back everything
    resumed = Regression(bad_steps=(2,))
    guard = NonFiniteGuard(action="skip")
    checkpoint = tmp_path / "straight" / "checkpoints" / "step=3.ckpt"
    trainer(tmp_path / "resumed", guard).fit(resumed, ckpt_path=checkpoint)
    assert torch.equal(resumed.layer.weight, straight.layer.weight)
    assert torch.equal(resumed.layer.bias, straight.layer.bias)
    assert guard.skipped == 1 and guard.first_skipped == [2]  # counted by the run the checkpoint came from


def test_bad_settings_are_refused_naming_the_option():
    with pytest.raises(ValueError, match="non_finite.action"):
        NonFiniteGuard(action="ignore")
    with pytest.raises(ValueError, match="non_finite.max_consecutive_skips"):
        NonFiniteGuard(action="skip", max_consecutive_skips=0)


@pytest.mark.slow
def test_a_diverging_fit_stops_with_one_line_and_keeps_only_finite_checkpoints(tmp_path):
    """The learning rate 1e4 without warm-up: step 0 is finite, step 1's loss is NaN."""
    shards = small_shards(tmp_path)
    config = read_config_file(Path(__file__).resolve().parents[2] / "configs/finetune/vqav2_tiny.yaml")
    for callback in config["trainer"]["callbacks"]:
        if callback["class_path"].endswith("ModelCheckpoint"):  # a checkpoint after every step
            callback["init_args"] = {"save_last": True, "every_n_train_steps": 1, "save_top_k": -1}
    path = tmp_path / "vqa.yaml"
    path.write_text(yaml.safe_dump(config))

    def fit(run: Path, *options: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-c", "import sys; from mmoe.cli import main; sys.exit(main(sys.argv[1:]))", "fit",
                   "--config", str(path), "--trainer.max_steps", "10", "--trainer.default_root_dir", str(run),
                   "--trainer.enable_progress_bar", "false", "--data.init_args.data_root", str(shards.parent),
                   "--model.init_args.answer_vocab", str(shards / "vqav2-train2014" / "answers.json"),
                   "--data.init_args.batch_size", "4", "--data.init_args.num_workers", "0",
                   "--model.init_args.optimizer.learning_rate", "1e4",
                   "--model.init_args.optimizer.warmup_steps", "0", *options]  # fmt: skip
        return subprocess.run(command, cwd=tmp_path, env=os.environ | {"OMP_NUM_THREADS": "1"}, capture_output=True,
                              text=True, timeout=600)  # fmt: skip

    run = tmp_path / "run"
    done = fit(run)
    assert done.returncode == DIVERGED_EXIT, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("mmoe fit: error:")]
    assert len(errors) == 1, done.stderr[-3000:]
    assert errors[0].startswith("mmoe fit: error: non-finite loss at step 1 (train/loss nan, ")
    for name in ("train/task_loss", "train/balance_loss", "train/z_loss"):
        assert f"{name} " in errors[0]
    saved = {path.name: torch.load(path, weights_only=True) for path in (run / "checkpoints").glob("*.ckpt")}
    assert saved["last.ckpt"]["global_step"] == 1  # the checkpoint after step 0, the last good one
    assert max(checkpoint["global_step"] for checkpoint in saved.values()) == 1
    assert_finite(saved.values())

    # Skipping instead: steps 1-9 are all non-finite (9 in a row, under the default limit of 10) and update nothing.
    skipping = fit(tmp_path / "skipping", "--non_finite.action", "skip")
    assert skipping.returncode == 0, skipping.stderr[-3000:]
    assert (
        "mmoe fit: 9 training steps skipped for a non-finite loss or gradients (steps 1, 2, 3, 4, 5, 6, 7, 8, 9)\n"
        in (skipping.stderr)
    )
    last = torch.load(tmp_path / "skipping" / "checkpoints" / "last.ckpt", weights_only=True)
    assert last["global_step"] == 10 and last["callbacks"]["NonFiniteGuard"]["skipped"] == 9
    assert_finite([last])
    for name, weights in saved["last.ckpt"]["state_dict"].items():  # step 0's update, then none
        # X-MoE's expert-embedding norm restore runs after every step, skipped or not: equal up to rounding there.
        torch.testing.assert_close(last["state_dict"][name], weights, rtol=1e-6, atol=0, msg=name)


def assert_finite(checkpoints) -> None:
    """Every weight and optimiser state of every checkpoint is finite."""
    for checkpoint in checkpoints:
        tensors = list(checkpoint["state_dict"].values())
        tensors += [value for state in checkpoint["optimizer_states"][0]["state"].values() for value in state.values()]
        assert all(torch.isfinite(tensor).all() for tensor in tensors)


@pytest.mark.slow
@pytest.mark.parametrize("action", ["stop", "skip"])
def test_a_nan_in_one_process_stops_or_skips_the_step_in_every_process(action, tmp_path):
    script = Path(__file__).resolve().parents[1] / "scripts" / "non_finite_ddp.py"
    done = subprocess.run([sys.executable, str(script), action, str(tmp_path)], capture_output=True, text=True,
                          timeout=600, cwd=script.parents[2],
                          env=os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(script.parents[2])})  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    outcomes = [(tmp_path / f"rank{rank}.txt").read_text() for rank in (0, 1)]
    if action == "skip":
        assert outcomes == ["skipped [2]", "skipped [2]"]
    else:  # rank 0's loss is finite; the NaN reached its gradients through DDP's all-reduce
        assert [outcome.split(" (")[0] for outcome in outcomes] == [
            "stopped: non-finite gradients at step 2",
            "stopped: non-finite loss at step 2",
        ]


@pytest.mark.slow
def test_a_fit_whose_selection_biases_overflow_stops_in_one_line(tmp_path, capsys):
    """Loss-free balancing at a rate float32 biases overflow at: the loss stays finite, the biases do not."""
    shards = small_shards(tmp_path)
    config = read_config_file(Path(__file__).resolve().parents[2] / "configs/finetune/vqav2_tiny.yaml")
    config["model"]["init_args"]["backbone"]["moe"]["bias_update_rate"] = 1e39
    for callback in config["trainer"]["callbacks"]:
        if callback["class_path"].endswith("ModelCheckpoint"):  # a checkpoint after every step
            callback["init_args"] = {"save_last": True, "every_n_train_steps": 1, "save_top_k": -1}
    path = tmp_path / "vqa.yaml"
    path.write_text(yaml.safe_dump(config))
    run = tmp_path / "run"
    argv = ["fit", "--config", str(path), "--trainer.max_steps", "4", "--trainer.default_root_dir", str(run),
            "--trainer.enable_progress_bar", "false", "--data.init_args.data_root", str(shards.parent),
            "--model.init_args.answer_vocab", str(shards / "vqav2-train2014" / "answers.json"),
            "--data.init_args.batch_size", "4", "--data.init_args.num_workers", "0",
            "--trainer.limit_val_batches", "0"]  # fmt: skip
    code, _, err = run_mmoe(argv, capsys)
    assert code == DIVERGED_EXIT, err[-3000:]
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("mmoe fit: error:")]
    assert len(errors) == 1, err[-3000:]
    assert errors[0].startswith("mmoe fit: error: non-finite router selection biases after step 0 in MoE layer 1 (")
    assert not (run / "checkpoints").exists() or not list((run / "checkpoints").glob("*.ckpt"))
