"""What ``mmoe infer --routing`` shows: the experts each text token went to, and the image's expert map."""

from __future__ import annotations

import math

import torch

from mmoe.data.transforms import denormalize
from mmoe.infer.load import FineTuned, InferError
from mmoe.metrics.routing import image_diversity_maps, record_key, sort_keys
from mmoe.moe import RoutingRecord


@torch.no_grad()
def routing_of(model: FineTuned, images: torch.Tensor, text: str) -> tuple[list[dict], list[RoutingRecord], int]:
    """The text tokens' experts per MoE layer (``{"token", "experts": {layer: experts}}`` per token), the records and
    the image length of one backbone pass over ``images`` (N, 3, S, S) with ``text``."""
    ids, padding = model.text(text)
    ids, padding = ids.expand(len(images), -1), padding.expand(len(images), -1)
    mask = model.task.text_attention_mask(ids.shape[1], ids.device)  # the pass the task reads its text in
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
    return per_token, out.routing, out.image_len


def draw_routing_map(
    model: FineTuned, images: torch.Tensor, records: list[RoutingRecord], image_len: int, path: str
) -> None:
    """The image's expert map in every MoE layer: with sub-tokens (MH-MoE) the distinct experts among each patch's
    sub-tokens, with one head the top-1 expert of each patch, numbered from 0 as the text tokens' experts are."""
    from mmoe.viz.maps import draw_expert_grid, draw_patch_grid

    maps = image_diversity_maps(records, image_len)
    if not maps:
        raise InferError(f"--routing {path}: the checkpoint's backbone has no MoE layer that routes image tokens")
    pixels = [(denormalize(image.cpu()).clamp(0, 1) * 255).round().byte().permute(1, 2, 0).numpy() for image in images]
    moe, task = model.task.backbone.config.moe, model.task.name
    if moe.heads > 1:
        columns = {key: maps[key].cpu().numpy() for key in sort_keys(maps)}
        title = f"{task}: distinct experts among each patch's {moe.heads} sub-tokens"
        draw_patch_grid(pixels, columns, max_count=moe.heads, title=title, path=path)
        return
    side = math.isqrt(image_len - 1)
    chosen = {
        record_key(r): r.expert_index[:, 1:image_len, 0, 0].reshape(-1, side, side).cpu().numpy()
        for r in records
        if r.modality in ("vision", "shared")
    }
    columns = {key: chosen[key] for key in sort_keys(chosen)}
    title = f"{task}: top-1 expert of each patch (one head: no sub-tokens)"
    draw_expert_grid(pixels, columns, moe.num_experts, title, path)
