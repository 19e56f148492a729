"""``mmoe viz ...`` (routing figures); ``mmoe analyze`` (routing metrics as JSON) is :mod:`mmoe.viz.analyze`.

* ``mmoe viz subtoken-map --ckpt C [--ckpt C2 ...] --images DIR_OR_SHARDS --out DIR`` — per-patch (and per text
  token) sub-token assignment-diversity maps (MH-MoE Fig. 1b, 8, 10): per checkpoint a grid images × MoE layers,
  plain and over the image, and with several checkpoints one side-by-side figure per layer.
* ``mmoe viz heatmap --ckpt C --data SHARDS --out DIR`` (or ``--stats routing_stats.json`` saved by
  :class:`mmoe.runtime.routing_callback.RoutingStatsCallback`) — expert-activation heatmap layer × expert per modality
  (MH-MoE Fig. 5), per-layer load bars and the activation-ratio-vs-threshold curve.
* ``mmoe analyze routing --ckpt A [--compare B] [--runs C1 C2 ...] --data SHARDS [--batches N]`` — one JSON object:
  ``activation_ratio``, ``representation_collapse`` (X-MoE Eq. 11), ``requested_capacity`` per MoE layer, and, when
  asked, ``fluctuation`` (A vs B, X-MoE §4.5) and ``inter_run_consistency`` (over the runs, X-MoE §4.5).

Bad input (missing file, unreadable image or checkpoint, a checkpoint without MoE layers, a wrong image size) ends
with a message naming it and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from mmoe.io import report_error
from mmoe.metrics.routing import (
    DEFAULT_ACTIVATION_THRESHOLD,
    image_diversity_maps,
    text_diversity,
)
from mmoe.metrics.routing_stats import read_stats, total_loads, total_tokens
from mmoe.viz.inputs import InputError, Sample, TextEncoder, find_samples, make_batches

#: Errors that are the user's input, reported in one line with exit code 2.
INPUT_ERRORS = (FileNotFoundError, InputError, ValueError)


# -- shared helpers --------------------------------------------------------------------------------------------------


def _load(path: str, image_size: int | None = None, device: str = "cpu") -> torch.nn.Module:
    """A backbone with MoE layers from an exported backbone or a task checkpoint; ValueError naming the file."""
    from mmoe.metrics.routing_collect import moe_layers_by_key
    from mmoe.runtime.checkpoint import load_backbone

    backbone = load_backbone(path)  # weights_only: a crafted file is refused, not run
    if not moe_layers_by_key(backbone):
        raise ValueError(f"checkpoint {path} has no MoE layers (MultiwayConfig.moe is None): no routing to analyse")
    if image_size is not None and image_size != backbone.config.image_size:
        raise ValueError(
            f"--image-size {image_size} does not match checkpoint {path}, which takes "
            f"{backbone.config.image_size} px images (MultiwayConfig.image_size)"
        )
    return backbone.to(device).eval()


#: Help of the --text-tokenizer options.
TEXT_TOKENIZER_HELP = "SentencePiece model the checkpoint reads text with (BEiT-3's beit3.spm); default open_clip's BPE"


def _text_encoder(
    backbone, path: str, max_length: int, enabled: bool, text_tokenizer: str | None = None
) -> TextEncoder | None:
    """The tokenizer for this checkpoint (``--text-tokenizer``, else open_clip's), or None (with a note) when its
    ids do not fit the checkpoint's text embedding."""
    if not enabled:
        return None
    config = backbone.config
    try:
        encoder = TextEncoder(min(max_length, config.max_text_positions - config.position_offset), text_tokenizer)
    except ImportError as error:
        print(f"note: open_clip's tokenizer is unavailable ({error}); texts skipped", file=sys.stderr)
        return None
    ids = encoder.tokenizer.ids
    try:
        ids.check_embedding(config.vocab_size, "the text tokenizer")
    except ValueError:
        hint = " (a BEiT-3 backbone: --text-tokenizer beit3.spm)" if text_tokenizer is None else ""
        print(
            f"note: checkpoint {path} has a {config.vocab_size}-row text embedding, the text tokenizer "
            f"{text_tokenizer or 'open_clip'} {ids.size} ids{hint}; texts skipped",
            file=sys.stderr,
        )
        return None
    return encoder


def checkpoint_labels(paths: Sequence[str | Path]) -> list[str]:
    """Short unique labels for checkpoints (file stems, with the parent directory when stems repeat): how figures
    name them."""
    stems = [Path(p).stem for p in paths]
    labels = [f"{Path(p).parent.name}-{Path(p).stem}" if stems.count(Path(p).stem) > 1 else Path(p).stem for p in paths]
    return [f"{i}-{label}" if labels.count(label) > 1 else label for i, label in enumerate(labels)]


def _file_part(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text)


def subtoken_map_path(out: str | Path, label: str) -> Path:
    """The sub-token map ``mmoe viz subtoken-map --out OUT`` draws for the checkpoint labelled ``label``
    (:func:`checkpoint_labels` of its ``--ckpt`` files)."""
    return Path(out) / f"subtoken_map_{_file_part(label)}.png"


def _column(key: str) -> str:
    layer, _, modality = key.partition("/")
    return f"layer {layer.removeprefix('layer')} ({modality})"


def _device(name: str | None) -> str:
    return name or ("cuda" if torch.cuda.is_available() else "cpu")


def _moved_to(inputs: dict[str, torch.Tensor], device: str) -> dict[str, torch.Tensor]:
    return {name: value.to(device) for name, value in inputs.items()}


def _run(command: str, action: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    try:
        return action(args)
    except INPUT_ERRORS as error:
        return report_error(command, error)


# -- mmoe viz --------------------------------------------------------------------------------------------------------


def viz_command(argv: Sequence[str]) -> int:
    """``mmoe viz subtoken-map | heatmap``: draw routing figures as PNG files."""
    parser = argparse.ArgumentParser(prog="mmoe viz", description="Draw routing figures (PNG).")
    sub = parser.add_subparsers(dest="figure", required=True)

    maps = sub.add_parser("subtoken-map", help="per-patch / per-token sub-token assignment diversity (MH-MoE Fig. 1b)")
    maps.add_argument("--ckpt", action="append", required=True, help="checkpoint; repeat to compare checkpoints")
    maps.add_argument("--images", nargs="+", required=True, help="directory of images, image files or .tar shards")
    maps.add_argument("--out", required=True, help="directory for the PNG files")
    maps.add_argument("--num-images", type=int, default=4, help="images to draw")
    maps.add_argument("--num-texts", type=int, default=3, help="texts to draw (from shards' txt entries)")
    maps.add_argument("--choices", choices=("top1", "all"), default="top1", help="count top-1 or all top-k choices")
    maps.add_argument("--no-text", action="store_true", help="skip the text-token maps")
    maps.add_argument("--max-text-length", type=int, default=32, help="tokens per text, start/end included")
    maps.add_argument("--text-tokenizer", help=TEXT_TOKENIZER_HELP)
    maps.add_argument("--image-size", type=int, default=None, help="check the checkpoints take this image size")
    maps.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")

    heat = sub.add_parser("heatmap", help="expert-activation heatmap, load bars, activation-ratio curve")
    source = heat.add_mutually_exclusive_group(required=True)
    source.add_argument("--ckpt", action="append", help="checkpoint to run over --data; repeat for several")
    source.add_argument("--stats", action="append", help="routing_stats.json saved by RoutingStatsCallback")
    heat.add_argument("--data", nargs="+", help="directory of images or .tar shards (with --ckpt)")
    heat.add_argument("--out", required=True, help="directory for the PNG files")
    heat.add_argument("--batches", type=int, default=100, help="batches to accumulate loads over")
    heat.add_argument("--batch-size", type=int, default=16)
    heat.add_argument("--threshold", type=float, default=DEFAULT_ACTIVATION_THRESHOLD, help="fraction of 1/E")
    heat.add_argument("--max-text-length", type=int, default=32)
    heat.add_argument("--text-tokenizer", help=TEXT_TOKENIZER_HELP)
    heat.add_argument("--no-text", action="store_true", help="feed images only")
    heat.add_argument("--device", default=None)

    args = parser.parse_args(list(argv))
    if args.figure == "heatmap" and args.ckpt and not args.data:
        parser.error("heatmap --ckpt needs --data")
    action = _subtoken_map if args.figure == "subtoken-map" else _heatmap
    return _run("viz", action, args)


def _subtoken_map(args: argparse.Namespace) -> int:
    written = draw_subtoken_maps(
        args.ckpt,
        args.images,
        args.out,
        args.num_images,
        args.num_texts,
        args.choices,
        not args.no_text,
        args.max_text_length,
        args.text_tokenizer,
        args.image_size,
        args.device,
    )
    print(json.dumps({"written": [str(p) for p in written]}, indent=1))
    return 0


def draw_subtoken_maps(
    checkpoints: Sequence[str | Path],
    images: Sequence[str | Path],
    out: str | Path,
    num_images: int = 4,
    num_texts: int = 3,
    choices: str = "top1",
    text: bool = True,
    max_text_length: int = 32,
    text_tokenizer: str | None = None,
    image_size: int | None = None,
    device: str | None = None,
) -> list[Path]:
    """``mmoe viz subtoken-map``: the sub-token maps of ``checkpoints`` on the first ``num_images`` images (and,
    with ``text``, ``num_texts`` texts) of ``images`` under ``out``; returns the files written."""
    device = _device(device)
    checkpoints, images = [str(path) for path in checkpoints], [str(path) for path in images]
    if num_images < 1:
        raise InputError(f"--num-images must be >= 1, got {num_images}")
    backbones = [_load(path, image_size, device) for path in checkpoints]
    pictures = find_samples(images, limit=num_images, wanted=lambda s: s.image is not None)
    pictures = [Sample(s.name, image=s.image) for s in pictures]  # each modality is routed on its own
    texts = []
    if text and num_texts > 0:
        try:
            texts = find_samples(images, limit=num_texts, wanted=lambda s: s.text is not None)
        except InputError:  # no text in the inputs: image maps only
            texts = []
        texts = [Sample(s.name, text=s.text) for s in texts]

    image_maps, text_maps, pixels, tokens, top = {}, {}, None, None, 1
    for path, label, backbone in zip(checkpoints, checkpoint_labels(checkpoints), backbones, strict=True):
        moe = backbone.config.moe
        per_sub_token = moe.num_experts if moe.routing == "expert_choice" else moe.top_k  # expert choice: up to all
        top = max(top, min(moe.heads * (per_sub_token if choices == "all" else 1), moe.num_experts))
        if moe.heads == 1:
            print(f"note: checkpoint {path} has heads=1: one expert per token (a constant map)", file=sys.stderr)
        batch = next(make_batches(pictures, backbone.config.image_size, len(pictures), None))
        image_maps[label] = _diversity(backbone, batch, device, image_diversity_maps, choices)
        pixels = pixels or batch.pixels
        encoder = _text_encoder(backbone, path, max_text_length, bool(texts), text_tokenizer)
        if encoder is not None:
            batch = next(make_batches(texts, backbone.config.image_size, len(texts), encoder))
            text_maps[label] = _diversity(backbone, batch, device, text_diversity, choices)
            tokens = tokens or batch.tokens
    written = _draw_image_maps(Path(out), image_maps, pixels, [_sample_name(s) for s in pictures], top)
    if text_maps and tokens:
        written += _draw_text_maps(Path(out), text_maps, tokens, [_sample_name(s) for s in texts], top)
    return written


def _diversity(backbone, batch, device: str, per_key, choices: str) -> dict[str, np.ndarray]:
    """Diversity maps of one batch, by column title (``layer i (modality)``)."""
    with torch.no_grad():
        output = backbone(**_moved_to(batch.inputs, device))
    maps = per_key(output.routing, output.image_len, choices)
    return {_column(key): value.cpu().numpy() for key, value in maps.items()}


def _draw_image_maps(out: Path, image_maps: dict, pixels: list, names: list[str], top: int) -> list[Path]:
    """Per checkpoint a grid images x layers (plain and overlaid); with several, one comparison per layer."""
    from mmoe.viz.maps import draw_patch_grid

    written = []
    for label, maps in image_maps.items():
        title = f"Sub-token assignment diversity per patch — {label}"
        for overlay, path in (
            (False, subtoken_map_path(out, label)),
            (True, out / f"subtoken_overlay_{_file_part(label)}.png"),
        ):
            written.append(draw_patch_grid(pixels, maps, top, title, path, overlay=overlay, row_labels=names))
    if len(image_maps) > 1:
        common = [c for c in next(iter(image_maps.values())) if all(c in m for m in image_maps.values())]
        for column in common:
            columns = {label: maps[column] for label, maps in image_maps.items()}
            title = f"Sub-token assignment diversity per patch, {column}, across checkpoints"
            path = out / f"subtoken_compare_{_file_part(column.replace(' ', '').replace('(', '_').rstrip(')'))}.png"
            written.append(draw_patch_grid(pixels, columns, top, title, path, overlay=True, row_labels=names))
    return written


def _draw_text_maps(out: Path, text_maps: dict, tokens: list, names: list[str], top: int) -> list[Path]:
    """Per checkpoint one panel per text (rows = layers); with several, one figure with rows checkpoint · layer."""
    from mmoe.viz.maps import draw_text_maps

    written = []
    for label, maps in text_maps.items():
        title = f"Sub-token assignment diversity per text token — {label}"
        written.append(draw_text_maps(tokens, maps, top, title, out / f"subtoken_text_{_file_part(label)}.png", names))
    if len(text_maps) > 1:
        rows = {f"{label} · {column}": v for label, maps in text_maps.items() for column, v in maps.items()}
        title = "Sub-token assignment diversity per text token, across checkpoints"
        written.append(draw_text_maps(tokens, rows, top, title, out / "subtoken_text_compare.png", names))
    return written


def _sample_name(sample: Sample) -> str:
    """A file name, or ``shard.tar:key`` for a shard member."""
    shard, colon, key = sample.name.rpartition(":")
    return f"{Path(shard).name}:{key}" if colon and shard.endswith(".tar") else Path(sample.name).name


def _heatmap(args: argparse.Namespace) -> int:
    if args.stats:
        written = draw_stats_heatmaps(args.stats, args.out, args.threshold)
    else:
        samples, sources = data_samples(args.data, args.batches, args.batch_size), []
        for label, path in zip(checkpoint_labels(args.ckpt), args.ckpt, strict=True):
            backbone = _load(path, device=_device(args.device))
            totals = run_over(backbone, path, samples, args).totals
            sources.append((label, {k: v.cpu() for k, v in totals.counts.items()}, totals.tokens()))
        written = draw_heatmaps(sources, args.out, args.threshold)
    print(json.dumps({"written": [str(p) for p in written]}, indent=1))
    return 0


def draw_stats_heatmaps(
    stats: Sequence[str | Path], out: str | Path, threshold: float = DEFAULT_ACTIVATION_THRESHOLD
) -> list[Path]:
    """``mmoe viz heatmap --stats``: :func:`draw_heatmaps` of the loads each ``routing_stats.json`` accumulated."""
    sources = []
    for label, path in zip(checkpoint_labels(stats), stats, strict=True):
        payload = read_stats(path)
        sources.append((label, total_loads(payload), total_tokens(payload)))
    return draw_heatmaps(sources, out, threshold)


def draw_heatmaps(sources: Sequence[tuple[str, dict, dict]], out: str | Path, threshold: float) -> list[Path]:
    """Per (label, loads, tokens) source: the expert-activation heatmap (MH-MoE Fig. 5), the load bars and the
    activation-ratio curve under ``out``; returns the files written."""
    from mmoe.viz.plots import draw_activation_curve, draw_activation_heatmap, draw_load_histograms

    out, written = Path(out), []
    for label, loads, tokens in sources:
        if not loads:
            raise InputError(f"{label}: the data produced no routing (no sample reached a MoE layer)")
        part = _file_part(label)
        written.append(
            draw_activation_heatmap(
                loads, out / f"heatmap_{part}.png", threshold, f"Expert activation — {label}", tokens
            )
        )
        written.append(
            draw_load_histograms(loads, out / f"loads_{part}.png", threshold, f"Expert load — {label}", tokens)
        )
        written.append(
            draw_activation_curve(
                loads,
                out / f"activation_curve_{part}.png",
                chosen=threshold,
                title=f"Activation ratio — {label}",
                tokens=tokens,
            )
        )
    return written


def data_samples(paths: Sequence[str], batches: int, batch_size: int) -> list[Sample]:
    if batches < 1 or batch_size < 1:
        raise InputError(f"--batches and --batch-size must be >= 1, got {batches} and {batch_size}")
    return find_samples(paths, limit=batches * batch_size)


def run_over(backbone, path: str, samples: list[Sample], args: argparse.Namespace, capture_rows: int = 0):
    """Route ``samples`` through ``backbone``; ``capture_rows`` > 0 also keeps that many router-input rows per layer."""
    from mmoe.metrics.routing_collect import run_routing

    device = _device(args.device)
    encoder = _text_encoder(backbone, path, args.max_text_length, not args.no_text, args.text_tokenizer)
    batches = make_batches(samples, backbone.config.image_size, args.batch_size, encoder)
    inputs = (_moved_to(batch.inputs, device) for batch in batches)
    return run_routing(backbone, inputs, capture_inputs=capture_rows > 0, max_rows=capture_rows)


# -- mmoe analyze ----------------------------------------------------------------------------------------------------
