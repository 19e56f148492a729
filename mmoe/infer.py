"""``mmoe infer vqa | caption | nlvr2``: a fine-tuned checkpoint on the user's own images, without training loaders.

The task is rebuilt from the checkpoint alone (its saved arguments and weights); images are decoded, resized and
normalised as its evaluation data was (:func:`mmoe.data.transforms.eval_transform` at the backbone's image size),
texts tokenized with its tokenizer. Any image size and mode is read (16-bit greyscale included).

* ``vqa --image photo.jpg --question "..." [--top-k 5]``: answers with their sigmoid scores (BEiT-3's VQA head is
  trained with binary cross-entropy).
* ``caption --image photo.jpg [--beam 3]``: the caption (beam search, the checkpoint's length settings).
* ``nlvr2 --left a.png --right b.png --sentence "..."``: true / false and the probability of true.
* ``--image DIR`` (vqa with one question, caption): every image of the folder, with a progress bar, into ``--out``
  (captions in the COCO results format ``[{"image_id", "caption"}]``; VQA ``[{"image", "question", "answer",
  "score"}]``), written whole or not at all.
* ``--shards SPLIT`` (a converted split folder, shard file or glob): every sample, decoded by the task's own decoder,
  into ``--out`` in the benchmark's format, the one ``mmoe predict`` writes (VQAv2 ``[{"question_id", "answer"}]``,
  COCO ``[{"image_id", "caption"}]``, NLVR2 ``identifier,True|False`` lines); corrupt samples are skipped and
  counted.
* ``--routing map.png``: the sub-token expert map of the image(s) (MH-MoE Fig. 1b: distinct experts per patch, top
  choices, every MoE layer) and, in the output, the experts each text token went to in every MoE layer.

Bad input (unreadable image, missing checkpoint, a checkpoint of another task, a pre-training checkpoint or a bare
backbone) is one line on stderr and exit 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from PIL import Image, UnidentifiedImageError

from mmoe.atomic import write_text_atomic
from mmoe.data.tokenizer import TextTokenizer
from mmoe.data.transforms import IMAGE_MEAN, IMAGE_STD, decode_image, eval_transform
from mmoe.metrics.routing import image_diversity_maps, record_key, sort_keys
from mmoe.moe import RoutingRecord
from mmoe.safe_load import load_checkpoint_file
from mmoe.tasks.checkpoint import config_from_dict
from mmoe.tasks.optimizer import nest_optimizer_arguments

#: ``mmoe infer`` task name -> the LightningModule class its checkpoints were trained with.
TASKS = {
    "vqa": "mmoe.tasks.vqa.VQAFineTuning",
    "caption": "mmoe.tasks.captioning.CaptioningFineTuning",
    "nlvr2": "mmoe.tasks.nlvr2.NLVR2FineTuning",
}
#: Image files read from a folder.
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")
#: Text tokens when the checkpoint does not record its data's ``max_text_length``.
DEFAULT_TEXT_LENGTH = 64


class InferError(ValueError):
    """Bad input to ``mmoe infer``; the message names the file or option."""


@dataclasses.dataclass
class FineTuned:
    """A fine-tuned task ready for inference and how its inputs are prepared."""

    task: torch.nn.Module
    tokenizer: TextTokenizer
    image_size: int
    device: torch.device

    def image(self, path: str | Path) -> torch.Tensor:
        """(3, S, S) as the checkpoint's evaluation data: decoded (any size and mode), resized, cropped, normalised."""
        path = Path(path)
        try:
            image = decode_image(path.read_bytes(), self.image_size)
        except FileNotFoundError:
            raise InferError(f"image {path} does not exist") from None
        except (OSError, UnidentifiedImageError, ValueError, Image.DecompressionBombError) as error:
            raise InferError(f"image {path} could not be read: {' '.join(str(error).split())}") from None
        return eval_transform(self.image_size)(image)

    def text(self, text: str) -> tuple[torch.Tensor, torch.Tensor]:
        ids, padding = self.tokenizer(text)
        return ids.to(self.device), padding.to(self.device)


#: Files a checkpoint names by path (its task's arguments) and the ``mmoe infer`` options that replace a moved one.
MOVABLE_FILES = {
    "answer_vocab": "--answer-vocab",
    "output_vocab": "--output-vocab",
    "text_tokenizer": "--text-tokenizer",
}


def load_fine_tuned(
    path: str | Path, task_name: str, device: str = "cpu", moved: dict[str, str | None] | None = None
) -> FineTuned:
    """The task of a Lightning checkpoint of ``mmoe fit`` (``task_name`` a key of :data:`TASKS`), rebuilt from its
    saved arguments and weights; ``moved`` replaces the paths of files it names (keys of :data:`MOVABLE_FILES`:
    the VQA answer list, the captioning output vocabulary, the SentencePiece tokenizer)."""
    path = Path(path)
    state = load_checkpoint_file(path, "checkpoint")
    hyper_parameters, weights = state.get("hyper_parameters"), state.get("state_dict")
    if not isinstance(hyper_parameters, dict) or not isinstance(weights, dict) or "backbone" not in hyper_parameters:
        raise InferError(
            f"checkpoint {path} holds no fine-tuned task (a backbone export or a released BEiT-3 file?): "
            f"fine-tune it with `mmoe fit` first"
        )
    class_path = str(hyper_parameters.get("_class_path", ""))
    if class_path.endswith("MaskedPretraining"):
        raise InferError(
            f"checkpoint {path} is a pre-training checkpoint: `mmoe infer` needs a fine-tuned VQA, NLVR2 or "
            f"captioning checkpoint"
        )
    if class_path != TASKS[task_name]:
        found = next((name for name, known in TASKS.items() if known == class_path), class_path or "unknown task")
        raise InferError(f"checkpoint {path} is a {found} checkpoint, not a {task_name} one")
    arguments = {k: v for k, v in nest_optimizer_arguments(hyper_parameters).items() if not k.startswith("_")}
    arguments["backbone"] = (
        config_from_dict(arguments["backbone"]) if isinstance(arguments["backbone"], dict) else (arguments["backbone"])
    )
    arguments["pretrained"] = None
    arguments |= {name: value for name, value in (moved or {}).items() if value is not None and name in arguments}
    module_name, class_name = class_path.rsplit(".", 1)
    try:
        task = getattr(importlib.import_module(module_name), class_name)(**arguments)
        task.load_state_dict(weights)
    except (FileNotFoundError, ValueError, RuntimeError) as error:
        named = [option for name, option in MOVABLE_FILES.items() if arguments.get(name)]
        hint = f" (a moved file: {', '.join(named)} name its new path)" if isinstance(error, FileNotFoundError) else ""
        raise InferError(f"checkpoint {path}: {' '.join(str(error).split())}{hint}") from None
    data = state.get("datamodule_hyper_parameters")
    length = data.get("max_text_length") if isinstance(data, dict) else None
    tokenizer = TextTokenizer(max_length=length or DEFAULT_TEXT_LENGTH, sentencepiece=arguments.get("text_tokenizer"))
    try:
        target = torch.device(device)
        task = task.eval().to(target)
    except RuntimeError as error:
        raise InferError(f"--device {device}: {' '.join(str(error).split())}") from None
    return FineTuned(task, tokenizer, task.backbone.config.image_size, target)


@torch.no_grad()
def answer_question(model: FineTuned, image: torch.Tensor, question: str, top_k: int) -> tuple[list[dict], list]:
    """The ``top_k`` answers with their scores, and the routing records."""
    ids, padding = model.text(question)
    logits, routing = model.task(image[None].to(model.device), ids, padding)
    scores = logits[0].float().sigmoid()
    best = scores.topk(min(top_k, scores.numel()))
    answers = model.task.answers
    return [
        {"answer": answers[i], "score": round(float(s), 6)} for s, i in zip(best.values, best.indices, strict=True)
    ], routing


@torch.no_grad()
def caption_image(model: FineTuned, image: torch.Tensor, beams: int | None) -> str:
    decoded = model.task.generate(image[None].to(model.device), num_beams=beams)
    return model.task.tokenizer.decode(decoded.tokens[0].cpu())


@torch.no_grad()
def judge_pair(model: FineTuned, left: torch.Tensor, right: torch.Tensor, sentence: str) -> tuple[dict, list]:
    ids, padding = model.text(sentence)
    logits, routing = model.task(left[None].to(model.device), right[None].to(model.device), ids, padding)
    probability = float(logits[0].float().softmax(-1)[1])
    return {"answer": probability > 0.5, "probability_true": round(probability, 6)}, routing


@torch.no_grad()
def routing_of(model: FineTuned, images: torch.Tensor, text: str) -> tuple[dict, list[RoutingRecord], int]:
    """The text tokens' experts per MoE layer, the records and the image length of one backbone pass over ``images``
    (N, 3, S, S) with ``text``."""
    ids, padding = model.text(text)
    ids, padding = ids.expand(len(images), -1), padding.expand(len(images), -1)
    mask = None
    if hasattr(model.task, "caption_mask"):  # the pass a caption is read in: image tokens see the image only
        mask = model.task.caption_mask(ids.shape[1], ids.device)
    out = model.task.backbone(image=images.to(model.device), text=ids, text_padding_mask=padding, attn_mask=mask)
    tokens = [model.tokenizer.token_string(int(i)) for i in ids[0]]
    experts: dict[str, list] = {}
    for record in out.routing:
        if record.modality not in ("language", "shared"):
            continue
        start = out.image_len if record.modality == "shared" else 0
        index = record.expert_index[0, start : start + len(tokens)]  # (T, heads, k)
        experts[record_key(record)] = index.tolist()
    by_layer = {key: experts[key] for key in sort_keys(experts)}
    per_token = [{"token": token, "experts": {k: v[t] for k, v in by_layer.items()}} for t, token in enumerate(tokens)]
    return {"text_tokens": per_token}, out.routing, out.image_len


def draw_routing_map(
    model: FineTuned, images: torch.Tensor, records: list[RoutingRecord], image_len: int, title: str, path: str
) -> None:
    from mmoe.viz.maps import draw_patch_grid

    maps = image_diversity_maps(records, image_len)
    if not maps:
        raise InferError(f"--routing {path}: the checkpoint's backbone has no MoE layer that routes image tokens")
    mean, std = torch.tensor(IMAGE_MEAN).view(3, 1, 1), torch.tensor(IMAGE_STD).view(3, 1, 1)
    pixels = [
        (((image.cpu() * std + mean).clamp(0, 1) * 255).round().byte().permute(1, 2, 0).numpy()) for image in images
    ]
    moe = model.task.backbone.config.moe
    if moe.heads > 1:
        columns = {key: maps[key].cpu().numpy() for key in sort_keys(maps)}
        draw_patch_grid(pixels, columns, max_count=moe.heads, title=title, path=path)
        return
    # One head: every patch counts one expert, so the map shows which expert (its top choice) each patch went to.
    side = math.isqrt(image_len - 1)
    chosen = {
        record_key(r): (r.expert_index[:, 1:image_len, 0, 0] + 1).reshape(-1, side, side).cpu().numpy()
        for r in records
        if r.modality in ("vision", "shared")
    }
    columns = {key: chosen[key] for key in sort_keys(chosen)}
    legend = "top-1 expert of the patch (index + 1)"
    draw_patch_grid(pixels, columns, max_count=moe.num_experts, title=title, path=path, legend=legend)


def folder_images(folder: Path) -> list[Path]:
    images = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    if not images:
        raise InferError(f"--image {folder} holds no image ({', '.join(IMAGE_SUFFIXES)})")
    return images


def image_id(path: Path) -> int | str:
    """COCO results use integer image ids: a file named by a number (``000000391895.jpg``) gives that number."""
    return int(path.stem) if path.stem.isdigit() else path.name


def run_folder(model: FineTuned, args: argparse.Namespace) -> dict:
    from tqdm import tqdm

    if args.out is None:
        raise InferError(f"--image {args.image} is a folder: give --out for the results file")
    results, unreadable = [], 0
    for path in tqdm(folder_images(Path(args.image)), desc="mmoe infer", unit="image", file=sys.stderr):
        try:
            image = model.image(path)
        except InferError as error:
            unreadable += 1
            print(f"mmoe infer: skipped: {error}", file=sys.stderr)
            continue
        if args.task == "caption":
            results.append({"image_id": image_id(path), "caption": caption_image(model, image, args.beam)})
        else:
            answers, _ = answer_question(model, image, args.question, 1)
            results.append({"image": path.name, "question": args.question, **answers[0]})
    if not results:
        raise InferError(f"--image {args.image}: no image could be read")
    write_text_atomic(args.out, json.dumps(results) + "\n")
    return {"results_file": str(args.out), "images": len(results), "unreadable_skipped": unreadable}


def shard_decoder(model: FineTuned, task: str):
    """The task's own sample decoder at the checkpoint's image size and tokenizer (evaluation transform)."""
    from mmoe.data.decoders import CaptionDecoder, NLVR2Decoder, VQADecoder

    transform, size = eval_transform(model.image_size), model.image_size
    if task == "vqa":
        return VQADecoder(transform, model.tokenizer, min_side=size)
    if task == "nlvr2":
        return NLVR2Decoder(transform, model.tokenizer, min_side=size)
    return CaptionDecoder(transform, model.tokenizer, mode="eval", min_side=size)


@torch.no_grad()
def predict_sample(model: FineTuned, task: str, item: dict, beams: int | None = None):
    """The predictions-file entry of one decoded sample, as the task's ``predict_step`` writes it."""
    if task == "caption":
        return {"image_id": item["image_id"], "caption": caption_image(model, item["image"], beams)}
    ids = torch.tensor([item["text_ids"]], device=model.device)
    if task == "vqa":
        logits, _ = model.task(item["image"][None].to(model.device), ids)
        return {"question_id": item["question_id"], "answer": model.task.answers[int(logits[0].argmax())]}
    left, right = item["image_left"][None].to(model.device), item["image_right"][None].to(model.device)
    logits, _ = model.task(left, right, ids)
    return item["identifier"], bool(logits[0].argmax() == 1)


def run_shards(model: FineTuned, args: argparse.Namespace) -> dict:
    from tqdm import tqdm

    from mmoe.data.pipelines import ShardStream
    from mmoe.data.samples import CorruptSampleError
    from mmoe.data.shards import expected_samples, resolve_shards

    if args.out is None:
        raise InferError(f"--shards {args.shards}: give --out for the results file")
    try:
        shards = resolve_shards(args.shards)
    except (FileNotFoundError, ValueError) as error:
        raise InferError(f"--shards: {' '.join(str(error).split())}") from None
    decode, entries, corrupt = shard_decoder(model, args.task), [], 0
    total = sum(expected_samples(shards).values()) or None
    stream = ShardStream(shards, decode=lambda raw: raw, rank=0, world_size=1)  # every sample, also under torchrun
    for sample in tqdm(stream, total=total, desc="mmoe infer", file=sys.stderr):
        try:
            item = decode(sample)
        except CorruptSampleError as error:
            corrupt += 1
            print(f"mmoe infer: skipped: {error}", file=sys.stderr)
            continue
        entries.append(predict_sample(model, args.task, item, getattr(args, "beam", None)))
    if not entries:
        raise InferError(f"--shards {args.shards}: no sample could be read")
    model.task.write_predictions(entries, args.out)  # atomically, one entry per sample, as `mmoe predict`
    return {"results_file": str(args.out), "samples": len(entries), "corrupt_skipped": corrupt}


def run_single(model: FineTuned, args: argparse.Namespace) -> dict:
    if args.task == "nlvr2":
        images = torch.stack([model.image(args.left), model.image(args.right)])
        result, _ = judge_pair(model, images[0], images[1], args.sentence)
        text = args.sentence
    else:
        images = model.image(args.image)[None]
        if args.task == "vqa":
            answers, _ = answer_question(model, images[0], args.question, args.top_k)
            result, text = {"answers": answers}, args.question
        else:
            text = caption_image(model, images[0], args.beam)
            result = {"caption": text}
    if args.routing:
        if model.task.backbone.config.moe is None:
            raise InferError(f"--routing {args.routing}: the checkpoint's backbone is dense (no MoE layer)")
        tokens, records, image_len = routing_of(model, images, text)
        draw_routing_map(model, images, records, image_len, f"{args.task}: distinct experts per patch", args.routing)
        result.update(tokens, routing_map=str(args.routing))
    return result


def printed(result: dict) -> str:
    """The plain-text form of a result."""
    if "answers" in result:
        lines = [f"{entry['answer']}\t{entry['score']:.4f}" for entry in result["answers"]]
    elif "caption" in result:
        lines = [result["caption"]]
    elif "probability_true" in result:
        lines = [f"{result['answer']}\tP(true) = {result['probability_true']:.4f}"]
    elif "samples" in result:
        lines = [
            f"{result['samples']} samples -> {result['results_file']} ({result['corrupt_skipped']} corrupt skipped)"
        ]
    else:
        lines = [f"{result['images']} images -> {result['results_file']} ({result['unreadable_skipped']} unreadable)"]
    for token in result.get("text_tokens", []):
        layers = "  ".join(f"{key}: {experts}" for key, experts in token["experts"].items())
        lines.append(f"{token['token']!r}\t{layers}")
    if "routing_map" in result:
        lines.append(f"routing map: {result['routing_map']}")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="mmoe infer", description=__doc__.split("\n\n")[0])
    tasks = root.add_subparsers(dest="task", required=True)
    for name, help_text in (("vqa", "answer a question"), ("caption", "caption an image"), ("nlvr2", "judge a pair")):
        task = tasks.add_parser(name, help=help_text)
        task.add_argument("--ckpt", required=True, help=f"a checkpoint of `mmoe fit` with {TASKS[name]}")
        inputs = task.add_mutually_exclusive_group(required=True)
        inputs.add_argument("--shards", help="a converted split (folder, shard or glob): results file (needs --out)")
        if name == "nlvr2":
            inputs.add_argument("--left", help="the left image (with --right and --sentence)")
            task.add_argument("--right", help="the right image")
            task.add_argument("--sentence", help="the statement about the pair")
        else:
            inputs.add_argument("--image", help="an image, or a folder of images (needs --out)")
        if name == "vqa":
            task.add_argument("--question", help="the question (with --image)")
            task.add_argument("--top-k", type=int, default=5, help="answers to list (default 5)")
            task.add_argument("--answer-vocab", help="the answer list, when the one the checkpoint names has moved")
        if name == "caption":
            task.add_argument("--output-vocab", help="the output vocabulary, when the one the checkpoint names moved")
        if name == "caption":
            task.add_argument("--beam", type=int, help="beams (default: the checkpoint's num_beams; 1 = greedy)")
        task.add_argument("--text-tokenizer", help="the SentencePiece model, when the one the checkpoint names moved")
        task.add_argument(
            "--routing", help="single input: write the image's expert map to this PNG and list the text's experts"
        )
        task.add_argument("--out", help="results file (JSON) for a folder of images")
        task.add_argument("--json", action="store_true", help="one JSON object on stdout")
        task.add_argument("--device", default="cpu", help="torch device (default cpu; e.g. cuda)")
    return root


def missing_inputs(args: argparse.Namespace) -> str:
    """The options a single-input run lacks ('' when complete or reading shards)."""
    if args.shards:
        return ""
    needed = {"nlvr2": ("right", "sentence"), "vqa": ("question",)}.get(args.task, ())
    return ", ".join(f"--{name}" for name in needed if not getattr(args, name))


def infer_command(argv: Sequence[str]) -> int:
    """``mmoe infer``; exit 2 with one line on bad input."""
    args = parser().parse_args(list(argv))
    try:
        if getattr(args, "top_k", 1) < 1 or (getattr(args, "beam", None) or 1) < 1:
            raise InferError("--top-k and --beam must be at least 1")
        missing = missing_inputs(args)
        if missing:
            raise InferError(f"{missing} needed (or --shards)")
        if args.routing and (args.shards or (args.task != "nlvr2" and Path(args.image).is_dir())):
            raise InferError("--routing works on a single input (one image or one pair)")
        moved = {name: getattr(args, name, None) for name in MOVABLE_FILES}
        model = load_fine_tuned(args.ckpt, args.task, args.device, moved)
        if args.shards:
            result = run_shards(model, args)
        elif args.task != "nlvr2" and Path(args.image).is_dir():
            result = run_folder(model, args)
        else:
            result = run_single(model, args)
    except (InferError, FileNotFoundError, ValueError) as error:
        print(f"mmoe infer: {' '.join(str(error).split())}", file=sys.stderr)
        return 2
    print(json.dumps(result) if args.json else printed(result))
    return 0
