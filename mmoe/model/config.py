"""Typed configuration of the multiway Transformer backbone and of where its MoE layers go.

BEiT-3 (Wang et al., 2023) as released in unilm/beit3 + torchscale: pre-LN with Sub-LN, modality-specific ("multiway")
attention projections, LayerNorms and FFNs over one joint softmax. Dense, Switch, X-MoE and MH-MoE backbones are all
this config with different ``moe`` values.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from mmoe.model.depth_router import DepthRouting
from mmoe.moe import MoEConfig, RoutingChoices
from mmoe.moe.choices.values import finite_at_least
from mmoe.vocabulary import VOCAB_SIZE

#: The modalities of a multiway backbone, as its routing records and ``MoEPlan.experts_by_modality`` name them.
MODALITIES = ("vision", "language")


@dataclass(frozen=True, kw_only=True)
class MoEPlan(RoutingChoices):
    """Which FFNs of the backbone are MoE layers, and the routing choices they share.

    The routing fields are :class:`mmoe.moe.RoutingChoices`' (see there); each layer's ``dim``, ``ffn_dim`` and
    ``subln`` come from the backbone (:meth:`layer_config`).

    Args:
        expert_parallel: W > 1 holds num_experts / W experts of every MoE layer on each rank of an expert-parallel
            group of W ranks in a distributed run (:mod:`mmoe.runtime.expert_parallel`); 1 = every rank holds every
            expert. Refused with ``strata``: Stratified MoE layers are not expert-sharded.
        every: layer i (0-based) is a MoE layer iff ``(i + 1) % every == 0`` (torchscale's ``moe_freq`` rule);
            2 = every other layer.
        layers: explicit 0-based MoE layer indices; overrides ``every`` when given.
        mode: ``"per_modality"`` turns the vision FFN and the language FFN each into its own MoE; ``"shared"`` routes
            all tokens of both modalities through one MoE. With Soft MoE (``routing: soft``) this chooses the slot
            pools: per modality, each modality's FFN has its own slots and sees only its own tokens (image tokens go
            to image slots, text to text slots); shared, one pool of slots mixes the image and text tokens of each
            sequence, as a VL-FFN (``vl_layers``) on image-text input always does.
        experts_by_modality: MoMa's modality-aware expert pools (Lin et al., 2024): with ``mode: per_modality``, the
            number of experts of each modality's MoE FFN, e.g. ``{vision: 4, language: 8}``; each pool routes only
            its modality's tokens, by the plan's routing (MoMa: expert choice inside each pool). A modality left out,
            and a VL-FFN (``vl_layers``, which serves both), keep ``num_experts``. Every other routing choice must
            hold for each pool's count (``top_k``, ``expert_groups``, ``global_entropy_min_experts``, ...). None =
            every MoE FFN has ``num_experts``. Refused with ``mode: shared`` (one pool) and with
            ``expert_parallel > 1``.
    """

    expert_parallel: int = 1
    every: int = 2
    layers: list[int] | None = None
    mode: Literal["per_modality", "shared"] = "per_modality"
    experts_by_modality: dict[str, int] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.every <= 0:
            raise ValueError(f"MoEPlan.every must be a positive integer, got {self.every!r}")
        if not isinstance(self.expert_parallel, int) or self.expert_parallel < 1:
            raise ValueError(f"MoEPlan.expert_parallel must be a positive integer, got {self.expert_parallel!r}")
        if self.num_experts % self.expert_parallel:
            raise ValueError(
                f"MoEPlan.num_experts={self.num_experts} is not divisible by MoEPlan.expert_parallel="
                f"{self.expert_parallel}: each rank of the expert-parallel group holds num_experts / expert_parallel"
            )
        if self.strata is not None and self.expert_parallel > 1:
            raise ValueError(
                f"MoEPlan.strata={self.strata!r} with MoEPlan.expert_parallel={self.expert_parallel}: Stratified MoE "
                "layers are not expert-sharded (every gate pass indexes all experts); set expert_parallel: 1"
            )
        if self.may_choose_no_expert and self.expert_parallel > 1:
            raise ValueError(
                f"MoEPlan.expert_parallel={self.expert_parallel} with an adaptive router (a (sub-)token may use fewer "
                "than top_k experts): its rows are not expert-sharded; set expert_parallel: 1"
            )
        if self.routing == "soft" and self.expert_parallel > 1:
            raise ValueError(
                f"MoEPlan.expert_parallel={self.expert_parallel} with routing='soft': Soft MoE layers are not "
                "expert-sharded (every sequence feeds every expert's slots); set expert_parallel: 1"
            )
        if self.mode not in ("per_modality", "shared"):
            raise ValueError(f"MoEPlan.mode must be 'per_modality' or 'shared', got {self.mode!r}")
        if self.experts_by_modality is not None:
            self._validate_pools()
        if self.gating_residual and self.experts_by_modality is not None:
            raise ValueError(
                f"MoEPlan.experts_by_modality={self.experts_by_modality!r} with gating_residual=True: the carried "
                "logits need one pool size in every MoE layer; leave experts_by_modality null"
            )

    def _validate_pools(self) -> None:
        """Each modality's pool: a known modality, a positive count, and the plan's routing choices valid at it."""
        pools = self.experts_by_modality
        if not isinstance(pools, dict) or not pools:
            raise ValueError(f"MoEPlan.experts_by_modality must map {MODALITIES} to expert counts, got {pools!r}")
        if self.mode != "per_modality":
            raise ValueError(
                f"MoEPlan.experts_by_modality={pools!r} with mode={self.mode!r}: one shared MoE is one pool; "
                "set mode: per_modality"
            )
        if self.expert_parallel > 1:
            raise ValueError(
                f"MoEPlan.experts_by_modality={pools!r} with expert_parallel={self.expert_parallel}: pools of "
                "different sizes are not expert-sharded; set expert_parallel: 1"
            )
        routing = {f.name: getattr(self, f.name) for f in dataclasses.fields(RoutingChoices)}
        for modality, count in pools.items():
            where = f"MoEPlan.experts_by_modality[{modality!r}]"
            if modality not in MODALITIES:
                raise ValueError(f"{where}: unknown modality; expected one of {MODALITIES}")
            if not isinstance(count, int) or isinstance(count, bool) or count < 1:
                raise ValueError(f"{where} must be a positive integer number of experts, got {count!r}")
            try:
                RoutingChoices(**routing | {"num_experts": count})
            except ValueError as error:
                raise ValueError(f"{where}={count}: {error}") from None

    def experts_of(self, modality: str) -> int:
        """The number of experts of ``modality``'s MoE FFNs ("vision", "language"; "shared" for a shared FFN or a
        VL-FFN): its pool's count in ``experts_by_modality``, else ``num_experts``."""
        return (self.experts_by_modality or {}).get(modality, self.num_experts)

    def is_moe_layer(self, index: int) -> bool:
        """Whether the 0-based layer ``index`` has MoE FFNs: listed in ``layers``, else every ``every``-th layer."""
        if self.layers is not None:
            return index in self.layers
        return (index + 1) % self.every == 0

    def layer_config(
        self, dim: int, ffn_dim: int, subln: bool, modality: str = "shared", layernorm_eps: float = 1e-5
    ) -> MoEConfig:
        """The :class:`MoEConfig` of one MoE layer of a backbone of width ``dim`` and FFN width ``ffn_dim``: this
        plan's routing choices, whatever fields :class:`RoutingChoices` has, with ``modality``'s pool of experts
        (:meth:`experts_of`) and the backbone's LayerNorm epsilon ``layernorm_eps``."""
        routing = {f.name: getattr(self, f.name) for f in dataclasses.fields(RoutingChoices)}
        routing["num_experts"] = self.experts_of(modality)
        return MoEConfig(dim=dim, ffn_dim=ffn_dim, subln=subln, layernorm_eps=layernorm_eps, **routing)


@dataclass
class MultiwayConfig:
    """BEiT-3 style multiway Transformer.

    Args:
        dim: hidden width D.
        depth: number of layers.
        num_heads: attention heads.
        ffn_dim: dense FFN inner width (4 D in BEiT-3).
        image_size: input image side in pixels.
        patch_size: patch side in pixels.
        in_channels: image channels.
        vocab_size: text vocabulary (open_clip BPE + pad + mask by default).
        max_text_positions: rows of the text position table (BEiT-3: 1024).
        position_offset: first position index of each modality. BEiT-3 starts at 2 ("consistent with Fairseq"), which
            adds 2 unused rows to the vision table (199 rows at 224 px); mmoe defaults to 0.
        attention: ``"multiway"`` gives each modality its own q/k/v/out projections and LayerNorms over one joint
            softmax (the released BEiT-3 code); ``"shared"`` shares them (the paper's description).
        vl_layers: the top ``vl_layers`` layers get a vision-language FFN used for fused image-text input (BEiT-3
            paper, VLMo). Default 0: the released BEiT-3 models have none.
        subln: Sub-LN LayerNorms inside attention (before the output projection) and inside the FFN (before fc2).
        drop_path: stochastic depth rate, linearly increasing over the layers.
        dropout: Transformer dropout (torchscale's ``dropout``): on the embedded tokens and on every attention and FFN
            sub-layer output before its residual add. 0 as BEiT-3 (which regularises with drop path only); MH-MoE
            App. C (Table 10) and X-MoE (Table 9) pre-train with 0.1.
        layernorm_eps: the epsilon of every LayerNorm, the MoE layers' included (the experts' Sub-LN, a Stratified
            layer's LayerNorm per stratum).
        output_norm: the final per-modality LayerNorm (torchscale's ``normalize_output``); BEiT-3's VQAv2 models are
            released without it.
        moe: where MoE layers go and how they route; None = dense.
        depth_routing: Mixture-of-Depths over the image patches (Raposo et al., 2024): which layers run only a
            router's top share of each image's patches (:class:`DepthRouting`); None = every token runs every layer.
        checkpoint_activations: recompute each layer's activations in the backward pass to save memory.
    """

    dim: int = 768
    depth: int = 12
    num_heads: int = 12
    ffn_dim: int = 3072
    image_size: int = 224
    patch_size: int = 16
    in_channels: int = 3
    vocab_size: int = VOCAB_SIZE
    max_text_positions: int = 1024
    position_offset: int = 0
    attention: Literal["multiway", "shared"] = "multiway"
    vl_layers: int = 0
    subln: bool = True
    drop_path: float = 0.0
    dropout: float = 0.0
    layernorm_eps: float = 1e-5
    output_norm: bool = True
    moe: MoEPlan | None = None
    depth_routing: DepthRouting | None = None
    checkpoint_activations: bool = False
    num_patches: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("dim", "depth", "num_heads", "ffn_dim", "image_size", "patch_size", "in_channels", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"MultiwayConfig.{name} must be a positive integer, got {value!r}")
        for name in ("dropout", "drop_path"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"MultiwayConfig.{name} must lie in [0, 1), got {getattr(self, name)!r}")
        if not finite_at_least(self.layernorm_eps, 0.0):  # nn.LayerNorm's range
            raise ValueError(f"MultiwayConfig.layernorm_eps must be a finite number >= 0, got {self.layernorm_eps!r}")
        if self.dim % self.num_heads:
            raise ValueError(f"MultiwayConfig.dim={self.dim} is not divisible by num_heads={self.num_heads}")
        if self.image_size % self.patch_size:
            raise ValueError(
                f"MultiwayConfig.image_size={self.image_size} is not divisible by patch_size={self.patch_size}"
            )
        if self.attention not in ("multiway", "shared"):
            raise ValueError(f"MultiwayConfig.attention must be 'multiway' or 'shared', got {self.attention!r}")
        if not 0 <= self.vl_layers <= self.depth:
            raise ValueError(f"MultiwayConfig.vl_layers must be in [0, depth={self.depth}], got {self.vl_layers!r}")
        if self.position_offset < 0:
            raise ValueError(f"MultiwayConfig.position_offset must be >= 0, got {self.position_offset!r}")
        if self.moe is not None and self.moe.layers is not None:
            bad = [i for i in self.moe.layers if not 0 <= i < self.depth]
            if bad:
                raise ValueError(f"MoEPlan.layers={self.moe.layers} has indices outside [0, {self.depth}): {bad}")
        if self.moe is not None:
            self.moe.require_divisible_width(self.dim, "MultiwayConfig")  # the one MoE fact that needs the width
        if self.depth_routing is not None:
            self.depth_routing.require_layers_within(self.depth)
            if self.moe is not None and self.moe.gating_residual:
                raise ValueError(
                    "MultiwayConfig.depth_routing with MoEPlan.gating_residual=True: a patch that skips a layer "
                    "would carry no logits through it; use one of the two"
                )
        self.num_patches = (self.image_size // self.patch_size) ** 2

    @classmethod
    def preset(cls, name: Literal["test", "tiny", "base", "beit3_base"], **overrides) -> MultiwayConfig:
        """A named shape from :data:`PRESETS` with ``overrides`` over it.

        ``test``: 2 layers, 32 wide, 32 px images (the tests' backbone, milliseconds). ``tiny``: 4 layers, 192 wide,
        64 px images (CPU minutes). ``base``: BEiT-3 base, 12 x 768, 224 px. ``beit3_base``: BEiT-3 base as
        released (XLM-R's 64010 text ids through ``beit3.spm``, position offset 2), the shape ``from_beit3`` reads
        from its files.
        """
        if name not in PRESETS:
            raise ValueError(f"unknown MultiwayConfig preset {name!r}; expected one of {sorted(PRESETS)}")
        fields = dict(PRESETS[name])
        fields.update(overrides)
        return cls(**fields)

    def moe_layer_indices(self) -> list[int]:
        if self.moe is None:
            return []
        return [i for i in range(self.depth) if self.moe.is_moe_layer(i)]

    def depth_routed_layers(self) -> list[int]:
        """The 0-based layers whose image patches are depth-routed (:class:`DepthRouting`); [] without it."""
        if self.depth_routing is None:
            return []
        return [i for i in range(self.depth) if self.depth_routing.is_routed(i)]


PRESETS: dict[str, dict] = {
    "test": dict(dim=32, depth=2, num_heads=4, ffn_dim=64, image_size=32, patch_size=16, max_text_positions=40),
    "tiny": dict(dim=192, depth=4, num_heads=3, ffn_dim=768, image_size=64, patch_size=16, max_text_positions=64),
    "base": dict(dim=768, depth=12, num_heads=12, ffn_dim=3072, image_size=224, patch_size=16, max_text_positions=1024),
    "beit3_base": dict(
        dim=768,
        depth=12,
        num_heads=12,
        ffn_dim=3072,
        image_size=224,
        patch_size=16,
        vocab_size=64010,
        max_text_positions=1024,
        position_offset=2,
    ),
}


def config_to_dict(config: MultiwayConfig) -> dict:
    """``config`` as plain JSON-safe values: what checkpoints' hyper-parameters and ``config.json`` files hold."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init} | {
        "moe": None if config.moe is None else dataclasses.asdict(config.moe),
        "depth_routing": None if config.depth_routing is None else dataclasses.asdict(config.depth_routing),
    }


def config_from_dict(fields: dict) -> MultiwayConfig:
    """The backbone config of a checkpoint, as one process runs it: a checkpoint holds every expert whatever the
    expert-parallel size it was trained with, so ``expert_parallel`` is not carried over and reading the backbone
    (a fine-tuning's ``pretrained`` file, ``load_from_checkpoint``, ``mmoe export`` / ``info`` / ``infer``) needs no
    expert-parallel group. A run sets its own: ``mmoe fit --ckpt_path`` parses the saved hyper-parameters with the
    CLI's parser, not here, and keeps the saved size unless the command line names one.

    Raises:
        TypeError: a field this :class:`MultiwayConfig`, :class:`MoEPlan` or :class:`DepthRouting` does not have.
        ValueError: a value the config refuses.
    """
    fields = dict(fields)
    if isinstance(fields.get("moe"), dict):
        fields["moe"] = MoEPlan(**{key: value for key, value in fields["moe"].items() if key != "expert_parallel"})
    if isinstance(fields.get("depth_routing"), dict):
        fields["depth_routing"] = DepthRouting(**fields["depth_routing"])
    return MultiwayConfig(**fields)
