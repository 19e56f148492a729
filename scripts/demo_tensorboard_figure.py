"""One picture of what a demo's pre-training sent to TensorBoard: the last load heatmap of the routing callback, the
training loss, and the zero-shot probes beside their chance levels, read from the run's event files.

    .venv/bin/python scripts/demo_tensorboard_figure.py runs/demo [--variant mhmoe] [--out docs/demo_tensorboard.png]

The same logs open in TensorBoard with ``.venv/bin/tensorboard --logdir runs/demo/pretrain/mhmoe/tensorboard``.
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

from matplotlib.figure import Figure
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from mmoe.pipeline.layout import PipelineRun
from mmoe.pipeline.probes import logged_probes
from mmoe.pipeline.settings import DEMO
from mmoe.tasks.zero_shot_probes import PREFIX


def draw(demo: Path, variant: str, out: Path) -> None:
    run = PipelineRun(demo, DEMO)
    layout = run.pretraining(variant)
    events = EventAccumulator(str(layout.tensorboard_logs / "version_0"), size_guidance={"images": 0, "scalars": 0})
    events.Reload()
    heatmap = Image.open(io.BytesIO(events.Images("routing/load_heatmap")[-1].encoded_image_string))
    loss = events.Scalars("train/loss")
    probes = logged_probes(layout)
    if probes is None:
        raise SystemExit(f"{layout.root}: no zero-shot probes were logged (a pre-training made before them)")
    names = [key.removeprefix(PREFIX) for key in probes["chance"]]
    figure = Figure(figsize=(12, 3.4))
    left, middle, right = figure.subplots(1, 3, gridspec_kw={"width_ratios": [1.3, 1, 1.2]})
    left.imshow(heatmap, interpolation="nearest")
    left.set_title(f"routing/load_heatmap (step {events.Images('routing/load_heatmap')[-1].step})", fontsize=9)
    left.axis("off")
    middle.plot([point.step for point in loss], [point.value for point in loss], color="tab:blue")
    middle.set(xlabel="step", title="train/loss")
    positions = range(len(names))
    values = [probes["values"][PREFIX + name] for name in names]
    right.bar(positions, values, color="tab:green", label="after pre-training")
    right.scatter(positions, [probes["chance"][PREFIX + name] for name in names], color="black", marker="_", s=300,
                  label="chance", zorder=3)  # fmt: skip
    right.set_xticks(list(positions), names, rotation=30, fontsize=8)
    right.set(ylim=(0, 1), title=f"val/probe/* ({int(probes['values'][PREFIX + 'pairs'])} held-out pairs)")
    right.legend(fontsize=8)
    logs = layout.tensorboard_logs.relative_to(demo)
    figure.suptitle(f"mmoe demo: the {variant} pre-training in TensorBoard (<demo folder>/{logs})", fontsize=10)
    figure.tight_layout()
    figure.savefig(out, dpi=110)
    print(out)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("demo", type=Path, help="the demo's output folder (mmoe demo --out)")
    parser.add_argument("--variant", default="mhmoe")
    parser.add_argument("--out", type=Path, default=Path("docs/demo_tensorboard.png"))
    args = parser.parse_args(argv)
    draw(args.demo, args.variant, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
