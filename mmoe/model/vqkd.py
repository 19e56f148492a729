"""BEiT v2's VQ-KD visual tokenizer (Peng et al., 2022, §2.1), BEiT-3's masked-image-modeling targets (Wang et al.,
2023, §2.2), built from the shapes of the released file (microsoft/unilm ``beit2/modeling_vqkd.py``, e.g.
``vqkd_encoder_base_decoder_3x768x12_clip-d5036aa7.pth``: 8,192 codes of dimension 32).

The tokenizer maps an image in [0, 1] to one code id per patch:

1. rescale to [-1, 1] (``x * 255 / 127.5 - 1``, the released ``pre_process``);
2. encode with a ViT (timm's ``Beit``: separate q and v biases, no k bias, absolute position embeddings, LayerNorm eps
   1e-6; layer scale where the file has it, x + gamma_1 * attn(norm1(x)) then x + gamma_2 * mlp(norm2(x)) as the
   release's ``Block`` with ``init_values`` > 0, none in the released tokenizers); the encoder pools by mean, so its
   ``norm`` is the identity and its ``fc_norm`` LayerNorm is applied to every patch token;
3. ``encode_task_layer`` (Linear -> Tanh -> Linear down to the code dimension), in fp32 as the release runs it;
4. Eq. 1: z_i = argmin_j ||l2(h_i) - l2(v_j)||_2, the nearest L2-normalised codebook row
   (``quantize.embedding.weight``) to the L2-normalised patch vector, i.e. the row of largest cosine. The EMA update
   of the release keeps every row at unit norm, so normalising the rows here changes nothing for a released file.

The file's keys under ``encoder.`` are timm ``Beit``'s own, so the encoder loads unchanged; ``quantize.embedding.
weight`` is :attr:`VQKDTokenizer.codebook`. The decoder, its task layer, the EMA statistics and any teacher weights
of the file are not needed for targets and are returned as unused; an encoder or task-layer weight the tokenizer does
not apply (a relative position bias, say) is refused, since leaving it out would change the codes. A codebook needs
at least two codes. The training arguments the release saves beside the weights (``args``, an
``argparse.Namespace``) are read under ``weights_only`` too. The head count is not stored: width / 64, as in
every released size. A backbone whose patch grid differs from the file's gets the position table resampled as the
release resamples it for another input size (``interpolate_pos_encoding``: bicubic, scale factor (g + 0.1) / side).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from timm.models.beit import Beit
from torch import nn

from mmoe.model.beit3 import HEAD_DIM, unwrap
from mmoe.safe_load import load_checkpoint_file, require_finite_weights

#: What a VQ-KD tokenizer file is, as errors name it.
VQKD_FILE = "BEiT v2's VQ-KD tokenizer (unilm beit2), e.g. vqkd_encoder_base_decoder_3x768x12_clip-d5036aa7.pth"
#: The codebook's key in the file.
CODEBOOK_KEY = "quantize.embedding.weight"
#: The LayerNorm epsilon of the released encoder.
LAYER_NORM_EPS = 1e-6
#: The key whose presence says the encoder's blocks have layer scale.
LAYER_SCALE_KEY = "encoder.blocks.0.gamma_1"
#: The fewest codes a codebook may have.
MIN_CODES = 2
#: The tensors the shapes are read from, with their number of dimensions in the release.
SHAPE_SOURCES = {
    "encoder.patch_embed.proj.weight": 4,
    "encoder.pos_embed": 3,
    "encoder.blocks.0.mlp.fc1.weight": 2,
    "encode_task_layer.2.weight": 2,
    CODEBOOK_KEY: 2,
}


@dataclass(frozen=True)
class VQKDShape:
    """The shapes of a VQ-KD tokenizer, as read from its file.

    Attributes:
        dim: encoder width (768 in the released base tokenizer).
        depth: encoder blocks (12).
        mlp_dim: hidden width of the encoder's MLPs (3072).
        patch_size: patch side in pixels (16).
        grid: patches per side of the position table (14: 224-px images).
        code_dim: dimension of a code (32).
        num_codes: codebook rows K (8192).
        in_channels: image channels (3).
        layer_scale: whether every block scales its two residual branches by learnt vectors (``gamma_1``,
            ``gamma_2``: a tokenizer built with ``init_values`` > 0; the released ones have none).
    """

    dim: int
    depth: int
    mlp_dim: int
    patch_size: int
    grid: int
    code_dim: int
    num_codes: int
    in_channels: int = 3
    layer_scale: bool = False

    @property
    def num_heads(self) -> int:
        return max(1, self.dim // HEAD_DIM)

    @classmethod
    def of(cls, state: Mapping[str, torch.Tensor], source: str) -> VQKDShape:
        """The shapes of the tokenizer weights ``state`` (unwrapped); ``source`` names the file in errors.

        Raises:
            ValueError: a key the shapes are read from is missing or of another rank (or has a dimension of 0), the
                position table is not 1 + a square, the blocks are not numbered from 0, or the codebook has fewer
                than :data:`MIN_CODES` rows (none leaves nothing to pick; one makes every target code 0, a MIM task
                with nothing to learn).
        """
        for key, rank in SHAPE_SOURCES.items():
            require_rank(state.get(key), key, rank, source)
        codebook = state[CODEBOOK_KEY]  # (K, code_dim)
        if codebook.shape[0] < MIN_CODES:
            raise ValueError(
                f"{source}: {CODEBOOK_KEY} has shape {tuple(codebook.shape)}, expected at least {MIN_CODES} codebook "
                "rows (one per code) of the code dimension"
            )
        patch = state["encoder.patch_embed.proj.weight"]  # (D, C, p, p)
        rows = state["encoder.pos_embed"].shape[-2]
        grid = math.isqrt(rows - 1)
        if grid < 1 or grid * grid != rows - 1:
            raise ValueError(f"{source}: encoder.pos_embed has {rows} rows, not 1 + a square (CLS and a patch grid)")
        return cls(
            dim=patch.shape[0],
            depth=encoder_depth(state, source),
            mlp_dim=state["encoder.blocks.0.mlp.fc1.weight"].shape[0],
            patch_size=patch.shape[-1],
            grid=grid,
            code_dim=codebook.shape[1],
            num_codes=codebook.shape[0],
            in_channels=patch.shape[1],
            layer_scale=LAYER_SCALE_KEY in state,
        )


def require_rank(value: object, key: str, rank: int, source: str) -> None:
    """Refuses a missing ``key`` or one that is not a ``rank``-dimensional tensor whose dimensions are all at least 1
    (the codebook's rows are checked apart, with their own reason).

    Raises:
        ValueError: one line naming ``source``, ``key`` and its shape.
    """
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{source} is not a VQ-KD tokenizer: it has no key {key} (expected {VQKD_FILE})")
    sizes = value.shape[1:] if key == CODEBOOK_KEY else value.shape
    if value.dim() != rank or 0 in sizes:
        raise ValueError(
            f"{source}: {key} has shape {tuple(value.shape)}, expected {rank} dimensions, each at least 1 "
            f"(expected {VQKD_FILE})"
        )


def encoder_depth(state: Mapping[str, torch.Tensor], source: str) -> int:
    """The number of encoder blocks: their keys ``encoder.blocks.<i>.`` must number them 0, 1, ... without a gap, so
    a key's number cannot make the tokenizer build more blocks than the file holds.

    Raises:
        ValueError: a block number that is not one, or a gap (the first missing block named).
    """
    numbers = set()
    for key in state:
        if key.startswith("encoder.blocks."):
            number = key.split(".")[2]
            if not number.isdigit():
                raise ValueError(f"{source}: {key} does not number its encoder block (expected {VQKD_FILE})")
            numbers.add(int(number))
    missing = min(set(range(len(numbers))) - numbers, default=None)
    if missing is not None:
        raise ValueError(
            f"{source} is not a VQ-KD tokenizer: it has encoder blocks up to {max(numbers)} but none numbered "
            f"{missing} (expected blocks numbered from 0, {VQKD_FILE})"
        )
    return len(numbers)


class VQKDTokenizer(nn.Module):
    """The encoder half of VQ-KD: images -> one code id per patch (see the module docstring).

    Args:
        shape: the file's shapes.
        grid: patches per side of the images it will tokenize (the backbone's grid); None = the file's.
    """

    def __init__(self, shape: VQKDShape, grid: int | None = None) -> None:
        super().__init__()
        self.shape, self.grid = shape, grid or shape.grid
        if int(shape.dim * (shape.mlp_dim / shape.dim)) != shape.mlp_dim or shape.dim % shape.num_heads:
            raise ValueError(f"VQ-KD encoder width {shape.dim} with MLP width {shape.mlp_dim} is not a ViT shape")
        self.encoder = Beit(
            img_size=self.grid * shape.patch_size,
            patch_size=shape.patch_size,
            in_chans=shape.in_channels,
            num_classes=0,
            global_pool="avg",  # the release pools by mean: `norm` is the identity, `fc_norm` normalises patches
            embed_dim=shape.dim,
            depth=shape.depth,
            num_heads=shape.num_heads,
            qkv_bias=True,
            mlp_ratio=shape.mlp_dim / shape.dim,
            norm_layer=partial(nn.LayerNorm, eps=LAYER_NORM_EPS),
            init_values=1.0 if shape.layer_scale else None,  # the gammas' values come from the file
            use_abs_pos_emb=True,
        )
        self.encode_task_layer = nn.Sequential(
            nn.Linear(shape.dim, shape.dim), nn.Tanh(), nn.Linear(shape.dim, shape.code_dim)
        )
        self.register_buffer("codebook", torch.zeros(shape.num_codes, shape.code_dim))

    @property
    def num_codes(self) -> int:
        return self.shape.num_codes

    @property
    def image_size(self) -> int:
        """The image side the encoder sees: the backbone's grid of this tokenizer's patches."""
        return self.grid * self.shape.patch_size

    def patch_vectors(self, pixels: torch.Tensor) -> torch.Tensor:
        """(B, 3, S, S) pixels in [0, 1] at :attr:`image_size` -> (B, grid^2, code_dim) L2-normalised patch vectors."""
        tokens = self.encoder.forward_features(pixels * 255.0 / 127.5 - 1.0)  # (B, 1 + N, D)
        patches = self.encoder.fc_norm(tokens[:, 1:])
        with torch.autocast(pixels.device.type, enabled=False):  # the release's task layer runs in fp32
            vectors = self.encode_task_layer(patches.float())
        return F.normalize(vectors, dim=-1)

    @torch.no_grad()
    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) pixels in [0, 1] -> (B, grid^2) long code ids, patches in row-major order.

        Images of another side than :attr:`image_size` are resized to it first (bicubic, antialiased), so the codes
        fall on the backbone's patch grid whatever the tokenizer's patch size.
        """
        if pixels.shape[-2:] != (self.image_size, self.image_size):
            pixels = F.interpolate(pixels, size=self.image_size, mode="bicubic", antialias=True).clamp(0, 1)
        vectors = self.patch_vectors(pixels)
        return (vectors @ F.normalize(self.codebook.float(), dim=-1).T).argmax(-1)  # Eq. 1 as the largest cosine


@dataclass
class VQKDLoad:
    """What :func:`load_vqkd` built and what of the file it did not use.

    Attributes:
        tokenizer: the tokenizer, in eval mode and frozen.
        unused: the file's keys it did not read (decoder, decoder task layer, EMA statistics, teacher), in file order.
    """

    tokenizer: VQKDTokenizer
    unused: list[str]


def file_key(key: str) -> str:
    """The file's key of one :class:`VQKDTokenizer` state-dict key."""
    return CODEBOOK_KEY if key == "codebook" else key


def resample_positions(table: torch.Tensor, grid: int) -> torch.Tensor:
    """The (1, 1 + side^2, D) position table for a ``grid x grid`` patch grid, as the release resamples it for other
    input sizes (``VisionTransformer.interpolate_pos_encoding``): CLS row kept, patch rows bicubic with the scale
    factor (grid + 0.1) / side (the 0.1 keeps the output size from rounding down)."""
    side = math.isqrt(table.shape[1] - 1)
    if side == grid:
        return table
    patches = table[:, 1:].reshape(1, side, side, -1).permute(0, 3, 1, 2).float()
    scale = (grid + 0.1) / side
    patches = F.interpolate(patches, scale_factor=(scale, scale), mode="bicubic")
    return torch.cat([table[:, :1], patches.permute(0, 2, 3, 1).reshape(1, grid * grid, -1).to(table.dtype)], dim=1)


def read_vqkd_state(path: str | Path, what: str) -> tuple[Mapping[str, torch.Tensor], str]:
    """(the weights of the VQ-KD file at ``path``, unwrapped from ``model`` / ``state_dict``; how errors name it). The
    training arguments the release saves beside them (``args``, an ``argparse.Namespace``) may be unpickled for this
    read, nothing else beyond what :func:`mmoe.safe_load.load_checkpoint_file` allows.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: not a readable ``torch.save`` file, or its weights are not finite.
    """
    raw = load_checkpoint_file(path, what, VQKD_FILE, allowed=(argparse.Namespace,))
    require_finite_weights(raw, path, what)
    return unwrap(raw), f"{what} {path}"


def read_vqkd_shape(path: str | Path, what: str = "VQ-KD tokenizer") -> VQKDShape:
    """The shapes of the VQ-KD file at ``path`` (errors as :func:`load_vqkd`'s)."""
    return VQKDShape.of(*read_vqkd_state(path, what))


def load_vqkd(path: str | Path, grid: int | None = None, what: str = "VQ-KD tokenizer") -> VQKDLoad:
    """A :class:`VQKDTokenizer` with the weights of a released VQ-KD file.

    Args:
        path: the file (``.pth``, or the same zip archive named ``.zip``; read with ``weights_only=True``), its
            weights at the top level or under ``model`` / ``state_dict``, maybe beside the training arguments
            (``args``: an ``argparse.Namespace``).
        grid: the backbone's patches per side; None = the file's.
        what: what the file is to the caller (e.g. the option that named it), the first words of the errors.

    Raises:
        FileNotFoundError: ``path`` does not exist (the message names ``what`` and ``path``).
        ValueError: unreadable, non-finite, or of another layout: one line naming the first missing or mis-shaped key
            (with both shapes), the first encoder weight it does not apply, or a codebook of fewer than
            :data:`MIN_CODES` codes.
    """
    state, source = read_vqkd_state(path, what)
    shape = VQKDShape.of(state, source)
    with torch.device("meta"):  # the shapes alone: nothing allocated before the file's tensors are known to fit
        expected = {key: value.shape for key, value in VQKDTokenizer(shape, grid).state_dict().items()}
    weights = matching_weights(state, expected, grid or shape.grid, source)
    used = {file_key(key) for key in weights}
    unused = [key for key in state if key not in used]
    unapplied = [key for key in unused if str(key).startswith(("encoder.", "encode_task_layer."))]
    if unapplied:
        more = f" (and {len(unapplied) - 1} more)" if len(unapplied) > 1 else ""
        raise ValueError(
            f"{source}: {unapplied[0]}{more} is an encoder weight this tokenizer does not apply, so its codes would "
            f"not be the file's (expected {VQKD_FILE})"
        )
    tokenizer = VQKDTokenizer(shape, grid)
    tokenizer.load_state_dict(weights)
    return VQKDLoad(tokenizer.eval().requires_grad_(False), unused)


def matching_weights(
    state: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Size], grid: int, source: str
) -> dict[str, torch.Tensor]:
    """The tokenizer's weights (its state-dict keys) from the file's ``state``, checked against the ``expected``
    shapes, the position table resampled to ``grid``.

    Raises:
        ValueError: the first key missing from the file, or the first of another shape (both shapes named).
    """
    weights = {}
    for key, shape in expected.items():
        stored = file_key(key)
        value = state.get(stored)
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{source} is not a VQ-KD tokenizer: it has no key {stored} (expected {VQKD_FILE})")
        if key == "encoder.pos_embed" and value.dim() == 3:
            value = resample_positions(value, grid)
        if value.shape != shape:
            raise ValueError(
                f"{source}: {stored} has shape {tuple(value.shape)}, but a VQ-KD tokenizer of the file's other shapes "
                f"needs {tuple(shape)}"
            )
        weights[key] = value
    return weights


def unused_summary(keys: list[str]) -> str:
    """``keys`` counted by their first part, e.g. ``decoder 40, decode_task_layer 4, quantize 3``."""
    counts: dict[str, int] = {}
    for key in keys:
        part = str(key).split(".", 1)[0]
        counts[part] = counts.get(part, 0) + 1
    return ", ".join(f"{part} {count}" for part, count in counts.items())


def vqkd_cost(shape: VQKDShape, grid: int | None = None) -> dict[str, int]:
    """What tokenizing one image costs, apart from the model being trained: the parameters the tokenizer reads
    (encoder at ``grid``, task layer, codebook) and its forward FLOPs per image (a multiply-add counted as 2: patch
    embedding, the blocks' weights, attention scores over the CLS and patch tokens, task layer, cosine to every
    code)."""
    grid = grid or shape.grid
    dim, mlp, code, patches = shape.dim, shape.mlp_dim, shape.code_dim, grid * grid
    tokens = patches + 1
    patch_weights = shape.in_channels * shape.patch_size**2 * dim
    # Per block: two LayerNorms, q/k/v without k bias, output projection, MLP, the two layer-scale vectors if any.
    layer_scale = 2 * dim if shape.layer_scale else 0
    block = 4 * dim + 3 * dim * dim + 2 * dim + dim * dim + dim + 2 * dim * mlp + mlp + dim + layer_scale
    task_layer = dim * dim + dim + dim * code + code
    parameters = patch_weights + dim + dim + tokens * dim + shape.depth * block + 2 * dim + task_layer
    block_flops = tokens * 2 * (4 * dim * dim + 2 * dim * mlp) + 4 * tokens * tokens * dim
    flops = (
        2 * patch_weights * patches
        + shape.depth * block_flops
        + patches * 2 * (dim * dim + dim * code)
        + patches * 2 * code * shape.num_codes
    )
    return {"parameters": parameters + shape.num_codes * code, "flops_per_image": flops}
