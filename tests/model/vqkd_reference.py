"""A VQ-KD tokenizer file in the released key layout (microsoft/unilm ``beit2``: encoder, decoder, both task layers,
the EMA quantizer's statistics, teacher and scaling-layer keys), with random weights of realistic scale, and a
straightforward per-patch reference of its codes written from the release's description, sharing no code with
:mod:`mmoe.model.vqkd`.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

EPS = 1e-6


def vit_keys(
    prefix: str, dim: int, depth: int, mlp: int, channels: int, patch: int, grid: int, layer_scale: bool = False
) -> dict:
    """(key -> shape) of a release ``VisionTransformer`` with mean pooling (``fc_norm``, no ``norm``) and no head; with
    ``layer_scale`` its blocks have the ``gamma_1`` / ``gamma_2`` of a model built with ``init_values`` > 0."""
    shapes = {
        f"{prefix}.cls_token": (1, 1, dim),
        f"{prefix}.pos_embed": (1, grid * grid + 1, dim),
        f"{prefix}.patch_embed.proj.weight": (dim, channels, patch, patch),
        f"{prefix}.patch_embed.proj.bias": (dim,),
    }
    for i in range(depth):
        block = f"{prefix}.blocks.{i}"
        shapes |= {
            f"{block}.norm1.weight": (dim,), f"{block}.norm1.bias": (dim,),
            f"{block}.attn.q_bias": (dim,), f"{block}.attn.v_bias": (dim,),
            f"{block}.attn.qkv.weight": (3 * dim, dim),
            f"{block}.attn.proj.weight": (dim, dim), f"{block}.attn.proj.bias": (dim,),
            f"{block}.norm2.weight": (dim,), f"{block}.norm2.bias": (dim,),
            f"{block}.mlp.fc1.weight": (mlp, dim), f"{block}.mlp.fc1.bias": (mlp,),
            f"{block}.mlp.fc2.weight": (dim, mlp), f"{block}.mlp.fc2.bias": (dim,),
        }  # fmt: skip
        if layer_scale:
            shapes |= {f"{block}.gamma_1": (dim,), f"{block}.gamma_2": (dim,)}
    return shapes | {f"{prefix}.fc_norm.weight": (dim,), f"{prefix}.fc_norm.bias": (dim,)}


def random_value(key: str, shape: tuple, generator: torch.Generator) -> torch.Tensor:
    """Weights of a trained network's scale: linears ~ 1 / sqrt(fan in), LayerNorm gains around 1, biases and
    embeddings that matter, layer scales spread around 0.1 (none at 1, so a layer scale left out changes the codes)."""
    noise = torch.randn(shape, generator=generator)
    if key.endswith(("gamma_1", "gamma_2")):
        return 0.1 * (1 + 0.5 * noise).abs() + 0.01
    if key.endswith(("norm1.weight", "norm2.weight", "fc_norm.weight")):
        return 1 + 0.2 * noise
    if key.endswith(("pos_embed", "cls_token")):
        return 0.5 * noise
    if len(shape) >= 2:
        return noise / math.sqrt(math.prod(shape[1:]))
    return 0.1 * noise


def released_state(
    dim: int = 128, depth: int = 2, mlp: int = 512, patch: int = 16, grid: int = 4, codes: int = 512,
    code_dim: int = 32, seed: int = 0, layer_scale: bool = False,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """The ``model`` dict of a VQ-KD file (``vqkd_encoder_base_decoder_3x768x12_clip`` at these sizes: a 3-block
    decoder over the codes, a 512-wide CLIP target), every key the release saves; with ``layer_scale``, of a tokenizer
    built with ``init_values`` > 0 (``gamma_1`` / ``gamma_2`` in every encoder and decoder block)."""
    generator = torch.Generator().manual_seed(seed)
    shapes = vit_keys("encoder", dim, depth, mlp, 3, patch, grid, layer_scale)
    shapes |= vit_keys("decoder", dim, 3, mlp, code_dim, 1, grid, layer_scale)
    shapes |= {
        "encode_task_layer.0.weight": (dim, dim), "encode_task_layer.0.bias": (dim,),
        "encode_task_layer.2.weight": (code_dim, dim), "encode_task_layer.2.bias": (code_dim,),
        "decode_task_layer.0.weight": (dim, dim), "decode_task_layer.0.bias": (dim,),
        "decode_task_layer.2.weight": (512, dim), "decode_task_layer.2.bias": (512,),
        "quantize.embedding.cluster_size": (codes,), "quantize.embedding.embed_avg": (codes, code_dim),
        "quantize.cluster_size": (codes,),
        "teacher_model.visual.proj": (dim, 512),
        "scaling_layer.shift": (1, 3, 1, 1), "scaling_layer.scale": (1, 3, 1, 1),
    }  # fmt: skip
    state = {key: random_value(key, shape, generator) for key, shape in shapes.items()}
    codebook = torch.randn(codes, code_dim, generator=generator)
    state["quantize.embedding.weight"] = codebook / codebook.norm(dim=-1, keepdim=True)  # the EMA keeps unit rows
    state["quantize.embedding.initted"] = torch.tensor([1.0])
    return state


def save_released(path: Path, state: dict, wrapper: str | None = "model") -> Path:
    """Writes ``state`` as the release does (``torch.save`` of ``{"model": state}``), or unwrapped."""
    torch.save(state if wrapper is None else {wrapper: state}, path)
    return path


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    mean = x.mean()
    return (x - mean) / torch.sqrt(((x - mean) ** 2).mean() + EPS) * weight + bias


def reference_codes(state: dict, images: torch.Tensor) -> torch.Tensor:
    """(B, N) code ids of (B, 3, S, S) images in [0, 1] at the file's own size, in float64: every token and every
    patch one at a time. A block with layer scale scales each residual branch by its gamma, as the release's
    ``Block.forward`` does: x + gamma_1 * attn(norm1(x)), then x + gamma_2 * mlp(norm2(x))."""
    w = {key: value.double() for key, value in state.items()}
    proj = w["encoder.patch_embed.proj.weight"]
    dim, patch = proj.shape[0], proj.shape[-1]
    heads = max(1, dim // 64)
    head_dim = dim // heads
    depth = 1 + max(int(key.split(".")[2]) for key in w if key.startswith("encoder.blocks."))
    codebook = w["quantize.embedding.weight"]
    codebook = codebook / codebook.norm(dim=-1, keepdim=True)
    all_codes = []
    for image in images.double() * 2 - 1:  # [0, 1] -> [-1, 1]
        side = image.shape[-1] // patch
        tokens = [w["encoder.cls_token"][0, 0]]
        for row in range(side):
            for col in range(side):
                pixels = image[:, row * patch : (row + 1) * patch, col * patch : (col + 1) * patch]
                tokens.append(proj.flatten(1) @ pixels.flatten() + w["encoder.patch_embed.proj.bias"])
        x = torch.stack(tokens) + w["encoder.pos_embed"][0]
        for i in range(depth):
            b = f"encoder.blocks.{i}."
            normed = torch.stack([layer_norm(t, w[b + "norm1.weight"], w[b + "norm1.bias"]) for t in x])
            bias = torch.cat([w[b + "attn.q_bias"], torch.zeros(dim, dtype=x.dtype), w[b + "attn.v_bias"]])
            q, k, v = (normed @ w[b + "attn.qkv.weight"].T + bias).split(dim, dim=-1)
            mixed = torch.zeros_like(x)
            for h in range(heads):
                part = slice(h * head_dim, (h + 1) * head_dim)
                for t in range(len(x)):
                    scores = torch.stack([q[t, part] @ k[s, part] for s in range(len(x))]) / math.sqrt(head_dim)
                    mixed[t, part] = scores.softmax(0) @ v[:, part]
            gamma_1, gamma_2 = w.get(b + "gamma_1", 1.0), w.get(b + "gamma_2", 1.0)
            x = x + gamma_1 * (mixed @ w[b + "attn.proj.weight"].T + w[b + "attn.proj.bias"])
            out = []
            for t in x:
                hidden = w[b + "mlp.fc1.weight"] @ layer_norm(t, w[b + "norm2.weight"], w[b + "norm2.bias"])
                hidden = hidden + w[b + "mlp.fc1.bias"]
                hidden = 0.5 * hidden * (1 + torch.erf(hidden / math.sqrt(2)))  # exact GELU
                out.append(t + gamma_2 * (w[b + "mlp.fc2.weight"] @ hidden + w[b + "mlp.fc2.bias"]))
            x = torch.stack(out)
        codes = []
        for token in x[1:]:  # patch tokens only
            h = layer_norm(token, w["encoder.fc_norm.weight"], w["encoder.fc_norm.bias"])
            h = torch.tanh(w["encode_task_layer.0.weight"] @ h + w["encode_task_layer.0.bias"])
            z = w["encode_task_layer.2.weight"] @ h + w["encode_task_layer.2.bias"]
            z = z / z.norm()
            codes.append(int(torch.stack([z @ row for row in codebook]).argmax()))
        all_codes.append(codes)
    return torch.tensor(all_codes)
