"""Configs written while the run's callbacks lived in ``mmoe.tasks`` still run: the shipped tiny pre-training config
of 0a2f35c (``tests/fixtures/0a2f35c/pretrain_tiny.yaml``, committed as that version wrote it) names
``mmoe.tasks.routing_callback.RoutingStatsCallback``, and is read as the class in :mod:`mmoe.runtime` now."""

from __future__ import annotations

from pathlib import Path

import pytest

from mmoe.config.launch import read_config
from mmoe.config.moved_classes import MOVED_MODULES, current_class_path, current_class_paths
from mmoe.runtime.routing_callback import RoutingStatsCallback
from mmoe.runtime.snapshots import BackboneSnapshots

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

OLD_CONFIG = Path(__file__).resolve().parents[1] / "fixtures" / "0a2f35c" / "pretrain_tiny.yaml"


def test_a_config_of_0a2f35c_names_the_callback_where_it_lives_now():
    assert "mmoe.tasks.routing_callback.RoutingStatsCallback" in OLD_CONFIG.read_text()
    callbacks = read_config([OLD_CONFIG]).fit.trainer.callbacks
    paths = [callback.class_path for callback in callbacks]
    assert "mmoe.runtime.routing_callback.RoutingStatsCallback" in paths
    assert not any(path.startswith("mmoe.tasks.") for path in paths)
    (routing,) = [c for c in callbacks if c.class_path.endswith("RoutingStatsCallback")]
    assert routing.init_args.every_n_steps == 50  # the file's own value, kept


def test_a_user_s_callback_of_that_time_is_read_too(tmp_path):
    config = tmp_path / "snapshots.yaml"
    config.write_text(
        OLD_CONFIG.read_text().replace(
            "    - class_path: mmoe.tasks.routing_callback.RoutingStatsCallback",
            "    - class_path: mmoe.tasks.snapshots.BackboneSnapshots\n"
            "      init_args:\n"
            "        dirpath: snapshots\n"
            "        every_n_steps: 7\n"
            "    - class_path: mmoe.tasks.routing_callback.RoutingStatsCallback",
        )
    )
    paths = [callback.class_path for callback in read_config([config]).fit.trainer.callbacks]
    assert f"{BackboneSnapshots.__module__}.BackboneSnapshots" in paths
    assert f"{RoutingStatsCallback.__module__}.RoutingStatsCallback" in paths


def test_only_the_moved_modules_are_renamed():
    for old, new in MOVED_MODULES.items():
        assert current_class_path(f"{old}.Anything") == f"{new}.Anything"
    kept = ["mmoe.tasks.vqa.VQAFineTuning", "mmoe.tasks.routing_callback", "a mmoe.tasks.snapshots.X", "text", ""]
    assert [current_class_path(value) for value in kept] == kept
    nested = {"a": [{"class_path": "mmoe.tasks.run_logs.ContinuingCSVLogger"}, 3, None], "b": "mmoe.tasks.base.X"}
    assert current_class_paths(nested) == {
        "a": [{"class_path": "mmoe.runtime.run_logs.ContinuingCSVLogger"}, 3, None],
        "b": "mmoe.tasks.base.X",
    }
