"""The multiway + MoE architecture as mmoe builds it, drawn as boxes and arrows (docs/explanations/architecture.png).

    .venv/bin/python scripts/architecture_figure.py [--config configs/pretrain/base/mhmoe.yaml]
        [--out docs/explanations/architecture.png]

Three panels, every number read from the config's ``moe`` part over the ``base`` preset (``MoEPlan``,
``MultiwayConfig.moe_layer_indices``, ``MoEPlan.layer_config``):

- the layer stack, MoE layers where ``MoEPlan`` puts them (BEiT-3, Wang et al., 2023, §2.1; torchscale's ``moe_freq``);
- one multiway block (``mmoe.model.layers.MultiwayBlock``): per-modality attention projections over one joint softmax,
  then the vision FFN for image tokens and the language FFN for text tokens (the VL-FFN in the top ``vl_layers``);
- one MoE FFN (``mmoe.moe.MoELayer``): MH-MoE's split into sub-tokens (Wu et al., 2024, Eq. 3-4), X-MoE's cosine
  router (Chi et al., 2022, Eq. 7-8), top-k of E experts, the weighted sum and the merge (MH-MoE Eq. 5-9).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import ConnectionPatch, FancyBboxPatch

from mmoe.model import MoEPlan, MultiwayConfig
from mmoe.moe import MoEConfig

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "pretrain" / "base" / "mhmoe.yaml"
OUT = ROOT / "docs" / "explanations" / "architecture.png"

VISION, LANGUAGE, SHARED = "#cfe2f3", "#d9ead3", "#fff2cc"
MOE, DENSE, ROUTER, NEUTRAL = "#f9cb9c", "#e6e6e6", "#ead1dc", "#ffffff"


def backbone_config(config: Path) -> MultiwayConfig:
    """The ``base`` preset with the ``moe`` part of a pre-training config (``model.init_args.backbone.moe``)."""
    moe = yaml.safe_load(config.read_text())["model"]["init_args"]["backbone"]["moe"]
    return MultiwayConfig.preset("base", moe=MoEPlan(**moe))


def box(ax: Axes, x: float, y: float, width: float, height: float, text: str, color: str, **style) -> None:
    """A rounded box centred at (x, y) with its text."""
    patch = FancyBboxPatch(
        (x - width / 2, y - height / 2), width, height, boxstyle="round,pad=0.02,rounding_size=0.15",
        facecolor=color, edgecolor=style.pop("edgecolor", "#333333"), linewidth=1, linestyle=style.pop("ls", "-"),
    )  # fmt: skip
    ax.add_patch(patch)
    ax.text(x, y, text, ha="center", va="center", fontsize=style.pop("fontsize", 8), **style)


def arrow(ax: Axes, start: tuple[float, float], end: tuple[float, float], **style) -> None:
    ax.annotate("", xy=end, xytext=start, arrowprops={"arrowstyle": "-|>", "color": "#333333", "lw": 1} | style)


def residual_add(ax: Axes, x: float, y: float) -> None:
    ax.add_patch(FancyBboxPatch((x - 0.18, y - 0.18), 0.36, 0.36, boxstyle="circle,pad=0", facecolor=NEUTRAL))
    ax.text(x, y, "+", ha="center", va="center", fontsize=10)


def blank(ax: Axes, title: str) -> None:
    ax.set_xlim(0, 10)
    ax.set_ylim(0, 10)
    ax.axis("off")
    ax.set_title(title, fontsize=10, loc="left")


def draw_stack(ax: Axes, config: MultiwayConfig) -> None:
    """The layers bottom to top, each MoE or dense as ``MultiwayConfig.moe_layer_indices`` says."""
    moe_layers = set(config.moe_layer_indices())
    rule = f"layers {config.moe.layers}" if config.moe.layers is not None else f"(i + 1) % {config.moe.every} == 0"
    blank(ax, f"a. {config.depth} layers; MoE iff\n{rule}")
    box(ax, 5, 0.45, 8, 0.6, "patch + token embeddings\n(per-modality positions)", NEUTRAL, fontsize=7)
    step = 8.2 / config.depth
    for index in range(config.depth):
        y = 1.3 + step * (index + 0.5)
        moe = index in moe_layers
        box(ax, 5, y, 8, step * 0.75, f"layer {index}: {'MoE FFNs' if moe else 'dense FFNs'}", MOE if moe else DENSE)
    box(ax, 5, 9.75, 8, 0.45, "final LayerNorm per modality", NEUTRAL, fontsize=7)


def draw_block(ax: Axes, config: MultiwayConfig) -> None:
    """One ``MultiwayBlock``: inputs bottom, output top, the residual stream on the outside."""
    attention = "one set per modality" if config.attention == "multiway" else "shared by both modalities"
    pools = "own pool each" if config.moe.mode == "per_modality" else "one shared MoE for all tokens"
    blank(ax, f"b. one multiway block (BEiT-3 §2.1), mode={config.moe.mode!r}")
    columns = ((2.2, VISION, "vision", "image tokens\n[CLS, patches]"), (7.8, LANGUAGE, "language", "text tokens"))
    for x, color, name, tokens in columns:
        box(ax, x, 0.5, 3.2, 0.8, tokens, color)
        box(ax, x, 1.9, 2.6, 0.55, f"LayerNorm ({name})", color)
        arrow(ax, (x, 0.9), (x, 1.62))
        arrow(ax, (x, 2.18), (x, 2.85))
        residual_add(ax, x, 4.45)
        arrow(ax, (x, 3.95), (x, 4.27))
        box(ax, x, 5.35, 2.6, 0.55, f"LayerNorm ({name})", color)
        arrow(ax, (x, 4.63), (x, 5.07))
        arrow(ax, (x, 5.63), (x, 6.25))
        residual_add(ax, x, 8.2)
        arrow(ax, (x, 7.45), (x, 8.02))
        box(ax, x, 9.35, 3.2, 0.7, f"{name} tokens out", color)
        arrow(ax, (x, 8.38), (x, 9.0))
        side = x - 1.85 if x < 5 else x + 1.85  # the residual stream, around the attention and the FFN
        ax.plot([x, side, side, x - 0.18 if x < 5 else x + 0.18], [1.3, 1.3, 4.45, 4.45], color="#777777", lw=1)
        ax.plot([x, side, side, x - 0.18 if x < 5 else x + 0.18], [4.8, 4.8, 8.2, 8.2], color="#777777", lw=1)
    box(
        ax, 5, 3.4, 8.2, 1.1,
        f"multi-head self-attention over [image, text]\nq, k, v, output projections: {attention}\none joint softmax",
        NEUTRAL,
    )  # fmt: skip
    box(ax, 2.2, 6.85, 3.2, 1.2, "vision FFN\nimage tokens only", VISION)
    box(ax, 7.8, 6.85, 3.2, 1.2, "language FFN\ntext tokens only", LANGUAGE)
    vl_ffn = f"VL-FFN\nimage + text\nin the top\nvl_layers ({config.vl_layers})"
    box(ax, 5, 6.85, 2.0, 1.2, vl_ffn, SHARED, ls="--", fontsize=7)
    ax.text(5, 5.95, f"in a MoE layer each FFN is a MoE FFN ({pools})", ha="center", fontsize=7, style="italic")


def draw_moe(ax: Axes, layer: MoEConfig) -> None:
    """One ``MoELayer``: split into sub-tokens, route, run top-k experts, weighted sum, merge."""
    heads, experts, top_k = layer.heads, layer.num_experts, layer.top_k
    sub_dim = layer.dim // heads
    blank(ax, f"c. one MoE FFN: {experts} experts, top-{top_k}, {heads} sub-tokens (MH-MoE on X-MoE routing)")
    box(ax, 5, 0.45, 5.0, 0.6, f"token after LayerNorm, width {layer.dim}", NEUTRAL)
    box(ax, 5, 1.6, 8.4, 0.8, f"multi-head linear, split into {heads} sub-tokens of {sub_dim} (MH-MoE Eq. 3-4)", SHARED)
    arrow(ax, (5, 0.75), (5, 1.2))
    for head in range(heads):
        x = 5 + (head - (heads - 1) / 2) * 0.9
        box(ax, x, 2.55, 0.6, 0.45, f"x{head + 1}", SHARED, fontsize=7)
        arrow(ax, (x, 2.0), (x, 2.32))
    gate = "softmax" if layer.gate == "softmax" else "sigmoid"
    router = "cos(W x, e_i) / tau" if layer.router == "xmoe" else "x . e_i"
    box(
        ax, 5, 3.75, 8.4, 1.0,
        f"router per sub-token: s_i = {router}, W: {sub_dim} -> {layer.routing_dim} (X-MoE Eq. 7-8)\n"
        f"{gate} gate g_i, top-{top_k} of {experts} experts",
        ROUTER,
    )  # fmt: skip
    arrow(ax, (5, 2.78), (5, 3.25))
    width = 8.4 / experts
    chosen = set(range(1, experts, max(experts // top_k, 1))[:top_k])  # an example choice for one sub-token
    for expert in range(experts):
        x = 0.8 + width * (expert + 0.5)
        picked = expert in chosen
        box(ax, x, 5.5, width * 0.8, 0.9, f"FFN\n{expert + 1}", MOE if picked else DENSE, fontsize=7)
        if picked:
            arrow(ax, (5, 4.25), (x, 5.05), lw=1.4)
            arrow(ax, (x, 5.95), (5, 6.65), lw=1.4)
    ax.text(5, 4.6, f"each sub-token runs on its top-{top_k} experts only", ha="center", fontsize=7, style="italic")
    weights = "divided by their sum" if layer.renormalize else "raw gate values"
    box(ax, 5, 7.05, 8.4, 0.75, f"weighted sum: sum over chosen i of g_i FFN_i(x) ({weights}; MH-MoE Eq. 5-6)", MOE)
    box(ax, 5, 8.25, 8.4, 0.75, "merge sub-tokens, merge linear (MH-MoE Eq. 7-9)", SHARED)
    arrow(ax, (5, 7.43), (5, 7.87))
    box(ax, 5, 9.4, 5.0, 0.6, f"update of width {layer.dim}, added to the residual", NEUTRAL)
    arrow(ax, (5, 8.63), (5, 9.1))


def draw(config: MultiwayConfig, out: Path) -> None:
    figure = Figure(figsize=(16, 7.2))
    stack, block, moe = figure.subplots(1, 3, gridspec_kw={"width_ratios": [0.75, 1.75, 1.6]})
    draw_stack(stack, config)
    draw_block(block, config)
    draw_moe(moe, config.moe.layer_config(config.dim, config.ffn_dim, config.subln, "language"))
    first_moe = config.moe_layer_indices()[0] if config.moe_layer_indices() else None
    if first_moe is not None:  # the stack's first MoE layer is the block; its language FFN is the MoE FFN
        y = 1.3 + 8.2 / config.depth * (first_moe + 0.5)
        for start, end, axes in (((9.0, y), (0.1, 5.0), (stack, block)), ((9.4, 6.85), (0.1, 5.5), (block, moe))):
            figure.add_artist(
                ConnectionPatch(start, end, "data", "data", axesA=axes[0], axesB=axes[1], color="#b45f06", ls=":")
            )
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=100)
    print(out)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=CONFIG, help="a pre-training config part with a moe block")
    parser.add_argument("--out", type=Path, default=OUT, help="the PNG to write")
    args = parser.parse_args(argv)
    draw(backbone_config(args.config), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
