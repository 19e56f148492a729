"""``mmoe predict`` and ``mmoe validate`` of an expert-choice backbone say, in one line, that the results depend on
which samples share a batch (each expert picks its tokens of the whole batch); token choice says nothing."""

from __future__ import annotations

import pytest
import yaml

from mmoe.model import MoEPlan, MultiwayConfig
from mmoe.runtime.checkpoint import config_to_dict
from tests.cli_fixtures import run_mmoe, small_shards

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

PLANS = {
    "expert_choice": MoEPlan(num_experts=4, every=1, routing="expert_choice", capacity_factor=1.0),
    "token_choice": MoEPlan(num_experts=4, every=1),
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return small_shards(tmp_path_factory.mktemp("expert_choice"), val_images=2)


def vqa_config(tmp_path, shards, plan: MoEPlan) -> str:
    val = str(shards / "vqav2-val2014")
    config = {
        "seed_everything": 0,
        "trainer": {"accelerator": "cpu", "logger": False, "enable_progress_bar": False,
                    "enable_model_summary": False, "default_root_dir": str(tmp_path / "run")},
        "model": {"class_path": "mmoe.tasks.vqa.VQAFineTuning",
                  "init_args": {"backbone": config_to_dict(MultiwayConfig.preset("test", depth=1, moe=plan)),
                                "answer_vocab": str(shards / "vqav2-train2014" / "answers.json"),
                                "predictions_file": str(tmp_path / "answers.json")}},
        "data": {"class_path": "mmoe.data.datamodules.VQADataModule",
                 "init_args": {"train_shards": str(shards / "vqav2-train2014"), "val_shards": val, "test_shards": val,
                               "batch_size": 2, "eval_batch_size": 4, "max_text_length": 32, "num_workers": 0}},
    }  # fmt: skip
    path = tmp_path / "vqa.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


@pytest.mark.parametrize("command", ["predict", "validate"])
@pytest.mark.parametrize("routing", sorted(PLANS))
def test_an_expert_choice_evaluation_warns_that_the_batch_matters(corpus, tmp_path, capsys, command, routing):
    code, _, err = run_mmoe([command, "--config", vqa_config(tmp_path, corpus, PLANS[routing])], capsys)
    assert code == 0, err
    warnings = [line for line in err.splitlines() if line.startswith(f"mmoe {command}: warning: ")]
    if routing == "token_choice":
        assert warnings == []
        return
    assert len(warnings) == 1, err
    assert "routing='expert_choice'" in warnings[0] and "depend on which samples share a batch" in warnings[0]
    assert "data.init_args.eval_batch_size" in warnings[0]
