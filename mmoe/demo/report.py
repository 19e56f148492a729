"""What the demo saves: ``DIR/results.json`` with its settings, chance levels, table rows per variant, the
pre-trainings' zero-shot probes, stage times and files (the table itself: :func:`mmoe.pipeline.tables.format_table`)."""

from __future__ import annotations

from mmoe.pipeline.layout import PipelineRun
from mmoe.pipeline.probes import logged_probes

#: The demo's summary in its output folder: settings, chance levels, rows, stage times, files.
RESULTS_FILE = "results.json"


def stage_files(records: dict) -> list[str]:
    return [path for record in records.values() for path in record["result"].get("files", [])]


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {torch.get_num_threads()} threads"


def pretraining_probes(run: PipelineRun, variants: list[str]) -> dict[str, dict]:
    """Variant -> the zero-shot probes its pre-training logged (values and chance levels), for those that logged
    them (a pre-training made before the probes logged none)."""
    probes = {variant: logged_probes(run.pretraining(variant)) for variant in variants}
    return {variant: entry for variant, entry in probes.items() if entry is not None}


def results(
    run: PipelineRun, rows_by_variant: dict[str, list[dict]], records: dict, seconds: float, variants: list[str]
) -> dict:
    """What ``DIR/results.json`` holds: settings, chance levels, per-variant rows, the pre-trainings' zero-shot probes,
    stage times and files."""
    return {
        "out": str(run.out),
        "settings": run.settings.to_json(),
        "variants": rows_by_variant,
        "probes": pretraining_probes(run, variants),
        "chance": run.chance(),
        "stages": {
            str(key): {"seconds": record["seconds"], "reused": record["reused"]} for key, record in records.items()
        },
        "seconds_this_run": seconds,
        "device": device_name(),
        "files": stage_files(records),
    }
