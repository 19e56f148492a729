"""Small backbones, checkpoints, images and shards shared by the routing-analysis and viz tests."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from mmoe.model import MoEPlan, MultiwayConfig, MultiwayTransformer
from mmoe.moe import RoutingRecord
from mmoe.runtime.checkpoint import export_backbone


def tiny_config(moe: MoEPlan | None | str = "mh-moe", **overrides) -> MultiwayConfig:
    """2 layers, 32 wide, 32 px images in 8 px patches (a 4 x 4 grid), open_clip's vocabulary; by default an MH-MoE
    with 4 experts and 2 heads in every layer."""
    if moe == "mh-moe":
        moe = MoEPlan(num_experts=4, heads=2, every=1)
    return MultiwayConfig.preset("test", **({"num_heads": 2, "patch_size": 8, "moe": moe} | overrides))


def tiny_part_plan(variant: str) -> MoEPlan:
    """The MoE plan of ``configs/pretrain/tiny/<variant>.yaml`` as the CLI reads it, in every layer."""
    from mmoe.pipeline.launch import configured_moe

    return MoEPlan(**(configured_moe(variant).as_dict() | {"every": 1}))


def make_checkpoint(path: Path, seed: int = 0, **config) -> Path:
    torch.manual_seed(seed)
    export_backbone(MultiwayTransformer(tiny_config(**config)), path)
    return path


def png_bytes(seed: int, size: tuple[int, int] = (40, 32)) -> bytes:
    """An image with large flat regions and some noise (so patches route differently)."""
    rng = np.random.default_rng(seed)
    pixels = np.zeros((size[1], size[0], 3), dtype=np.uint8)
    pixels[:] = rng.integers(0, 255, 3)
    pixels[size[1] // 2 :, : size[0] // 2] = rng.integers(0, 255, 3)
    pixels[: size[1] // 3, size[0] // 2 :] = rng.integers(0, 255, (size[1] // 3, size[0] - size[0] // 2, 3))
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def image_dir(path: Path, count: int = 3) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for index in range(count):
        (path / f"image{index}.png").write_bytes(png_bytes(index))
    return path


def shard(path: Path, count: int = 8, texts: bool = True, start: int = 0) -> Path:
    """A webdataset shard of ``count`` samples with ``png``, ``txt`` and ``json`` members."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as archive:
        for index in range(start, start + count):
            members = {"png": png_bytes(100 + index), "json": json.dumps({"image_id": index}).encode()}
            if texts:
                members["txt"] = f"a small red square and {index} blue circles".encode()
            for extension, data in members.items():
                info = tarfile.TarInfo(f"{index:06d}.{extension}")
                info.size = len(data)
                archive.addfile(info, io.BytesIO(data))
    return path


def record(expert_index: torch.Tensor, num_experts: int, layer: int = 0, modality: str = "vision") -> RoutingRecord:
    """A routing record holding hand-made choices; counts derived from them."""
    valid = expert_index[expert_index >= 0]
    return RoutingRecord(
        balance_loss=torch.zeros(()),
        z_loss=torch.zeros(()),
        expert_counts=torch.bincount(valid, minlength=num_experts),
        expert_index=expert_index,
        dropped_fraction=torch.zeros(()),
        requested_capacity=torch.ones(()),
        router_entropy=torch.zeros(()),
        layer=layer,
        modality=modality,
    )
