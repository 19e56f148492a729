"""Masked data modeling pre-training (BEiT-3, Wang et al., 2023, §2.2) of a multiway MoE backbone.

One objective over three kinds of batches: masked image modeling on images (block-wise masks, predict the visual
tokens of the masked patches), masked language modeling on texts and masked vision-language modeling on image-text
pairs (predict the masked text tokens, optionally also masked patches). The visual tokens are BEiT-3's own, BEiT v2's
VQ-KD codes from the tokenizer file a user holds (``vqkd_tokenizer``), or the codes of a k-means codebook learned
offline from the training images (``visual_codebook``); regressing an open_clip teacher's patch features
(``teacher_checkpoint``) is the third choice. Total loss (X-MoE Eq. 10) = masked-modeling
loss + alpha * (sum over MoE layers of the balance losses; ``balance_reduce="mean"`` averages them instead, as
Stratified MoE does over blocks). Optionally the pair batches add VLMo's image-text contrastive loss
(``contrastive_coefficient``, Bao et al. 2022 §2.2), which trains the CLS tokens masked modeling leaves untrained.

Batch contract (:mod:`mmoe.data.batches`): a single-kind batch (``ImageBatch``, ``TextBatch``, ``PairBatch``, with
``kind`` in {"image", "text", "pair"}), or the joint form ``{kind: batch}`` (``JointBatch``: one optimisation step over
all of them); :func:`mmoe.data.batches.step_batches` tells them apart.

The balance term of a joint step covers the routing records of all its forwards: with ``balance_reduce="sum"`` a joint
step over image, text and pair batches adds 3 x (number of MoE layers) balance losses, so the same alpha weighs the
balance three times as much as in a mixed step (one forward); ``"mean"`` averages over all of them and has the same
scale in both modes. Every pre-training config runs joint steps with ``"sum"``.
"""

from __future__ import annotations

import math
import sys
from functools import partial
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from mmoe.data.batches import BATCH_KINDS, IMAGE, PAIR, TEXT, PretrainBatch, PretrainStep, step_batches
from mmoe.data.datamodules import PretrainDataModule
from mmoe.data.tokenizer import TextTokenizer
from mmoe.data.transforms import denormalize
from mmoe.model import MultiwayConfig, MultiwayTransformer
from mmoe.model.heads import LOG_LOGIT_SCALE_INIT, retrieval_heads
from mmoe.model.initialization import init_beit3_
from mmoe.model.output_vocab import class_index, classes_of, load_output_vocab
from mmoe.model.vqkd import VQKDTokenizer, load_vqkd, unused_summary
from mmoe.moe import RoutingRecord
from mmoe.runtime.checkpoint import config_from_dict
from mmoe.runtime.optimizer import PRETRAINING_OPTIMIZER, OptimizerConfig
from mmoe.tasks.base import BackboneTask, StepLosses, require_loss_weight
from mmoe.tasks.retrieval import contrastive_loss, gather_with_grad
from mmoe.tasks.visual_codebook import PatchCodebook
from mmoe.tasks.zero_shot_probes import DEFAULT_PROBE_PAIRS, ProbeEncoder, ZeroShotProbeCollector, probe_metrics

__all__ = ["MaskedPretraining"]


#: The image-text contrastive loss (``contrastive_coefficient``), logged as ``<stage>/pair_contrastive_loss``.
CONTRASTIVE = "pair_contrastive"

#: The open_clip model of the teacher when a config names none.
DEFAULT_TEACHER = "ViT-B-16"


class MaskedPretraining(BackboneTask):
    """Pre-train a :class:`MultiwayTransformer` with masked image / language / vision-language modeling.

    Args:
        backbone: the backbone configuration (a preset's fields; ``moe`` decides dense, Switch, X-MoE, MH-MoE or
            Stratified).
        visual_codebook: path of the visual codebook made by ``mmoe tokenizer fit``: MIM predicts the visual token of
            each masked patch (a K-way classification with a perplexity).
        teacher_checkpoint: path of open_clip weights on disk; when given, MIM instead regresses the teacher's
            last-block patch features (resampled to the backbone's patch grid) with a cosine loss. Semantic targets,
            but they need weights a user already has, cost a teacher forward per image batch, and have no perplexity.
        teacher_model: the open_clip model name the weights belong to (e.g. ``ViT-B-16``).
        vqkd_tokenizer: path of BEiT v2's VQ-KD tokenizer file (BEiT-3's own MIM targets, e.g.
            ``vqkd_encoder_base_decoder_3x768x12_clip-d5036aa7.pth``); when given, MIM predicts its code of each
            masked patch (a K-way classification with a perplexity, K = 8192 for the released file). The tokenizer
            sees the images in [0, 1] at its own patch size on the backbone's patch grid, whatever the data's
            normalisation; it is frozen and kept out of checkpoints (:mod:`mmoe.model.vqkd`). Its codes are computed
            without gradients in fp32, by the loader's workers on a CPU run with workers, else by the task.
        text_tokenizer: the SentencePiece model of the texts (BEiT-3's ``beit3.spm``, XLM-R ids); None = open_clip's
            BPE. The data's tokenizer follows it (the mmoe CLI links it); the backbone's text embedding must fit it.
        output_vocab: a JSON list of the token ids the MLM head predicts (:mod:`mmoe.model.output_vocab`, e.g. a
            corpus' ``caption_tokens.json``); a masked token outside it is an error naming it. None = the whole
            vocabulary, as BEiT-3. On the synthetic corpus (43 ids in use) the MLM loss falls below the
            uniform level over the used ids within the demo's steps; over all 49,408 ids it does not.
        contrastive_coefficient: weight of an image-text contrastive loss on the pair batches (VLMo's ITC, Bao et
            al. 2022 §2.2; BEiT-3's retrieval loss): an image-only pass of each pair's whole image and a text-only pass
            of its unmasked text, their first tokens through BEiT-3's retrieval projections (``vision_head``,
            ``language_head``), L2-normalised, scored by CLIP's symmetric cross-entropy with a learnable temperature
            (:func:`mmoe.tasks.retrieval.contrastive_loss`, negatives gathered from every process). It trains the CLS
            tokens, which masked data modelling never predicts from. 0 = off, as BEiT-3.
        balance_coefficient: alpha, the weight of the balance losses (X-MoE Eq. 10; 1e-2 in X-MoE and MH-MoE).
        balance_reduce: ``"sum"`` adds the MoE layers' balance losses (MH-MoE code); ``"mean"`` averages them (the
            z-losses alike).
        z_loss_coefficient: weight of the router z-loss (ST-MoE Eq. 5; ST-MoE uses 1e-3); 0 = off, as in BEiT-3,
            X-MoE and MH-MoE.
        optimizer: AdamW and its warm-up cosine schedule (:class:`mmoe.runtime.optimizer.OptimizerConfig`); the
            default is BEiT-3's pre-training optimiser (:data:`mmoe.runtime.optimizer.PRETRAINING_OPTIMIZER`).
        zero_shot_probes: whether validation logs zero-shot probes on the first held-out pairs of the validation pair
            stream (:mod:`mmoe.tasks.zero_shot_probes`: ``val/probe/...``, image-text matching and the synthetic
            world's colour and shape from class-name prompts), measured by the first process alone. Off in FSDP2 and
            expert-parallel runs, whose forwards are collective.
        probe_pairs: the held-out pairs probed per validation.
    """

    def __init__(
        self,
        backbone: MultiwayConfig,
        visual_codebook: str | None = None,
        teacher_checkpoint: str | None = None,
        teacher_model: str = DEFAULT_TEACHER,
        vqkd_tokenizer: str | None = None,
        text_tokenizer: str | None = None,
        output_vocab: str | None = None,
        contrastive_coefficient: float = 0.0,
        balance_coefficient: float = 1e-2,
        balance_reduce: Literal["sum", "mean"] = "sum",
        z_loss_coefficient: float = 0.0,
        optimizer: OptimizerConfig = PRETRAINING_OPTIMIZER,
        zero_shot_probes: bool = True,
        probe_pairs: int = DEFAULT_PROBE_PAIRS,
    ) -> None:
        super().__init__(balance_reduce, optimizer, text_tokenizer, z_loss_coefficient, balance_coefficient)
        if isinstance(backbone, dict):  # the saved hyper-parameter (``load_from_checkpoint``)
            backbone = config_from_dict(backbone)
        self.save_hyperparameters()
        self.backbone = MultiwayTransformer(backbone)
        self.store_configs()
        mim_outputs = self._load_mim_target(
            backbone, visual_codebook, teacher_checkpoint, teacher_model, vqkd_tokenizer
        )
        self.mim_head = nn.Linear(backbone.dim, mim_outputs)
        mlm_ids = None
        if output_vocab is not None:
            self.tokenizer = TextTokenizer(sentencepiece=text_tokenizer)
            text_ids = self.tokenizer.ids
            mlm_ids = torch.tensor(load_output_vocab(output_vocab, backbone.vocab_size, text_ids, need_end=False))
            self.register_buffer("mlm_class_index", class_index(mlm_ids, backbone.vocab_size), persistent=False)
        self.mlm_head = nn.Linear(backbone.dim, backbone.vocab_size if mlm_ids is None else len(mlm_ids))
        for head in (self.mim_head, self.mlm_head):
            init_beit3_(head.weight)
            nn.init.zeros_(head.bias)
        require_loss_weight("contrastive_coefficient", contrastive_coefficient)
        if contrastive_coefficient > 0:
            self.vision_head, self.language_head = retrieval_heads(backbone.dim)
            self.logit_scale = nn.Parameter(torch.tensor(LOG_LOGIT_SCALE_INIT))
        if probe_pairs < 2:
            raise ValueError(f"model.probe_pairs must be >= 2 (a positive and a negative), got {probe_pairs!r}")
        self.probe_collector = (
            ZeroShotProbeCollector(probe_pairs, TextTokenizer(sentencepiece=text_tokenizer))
            if zero_shot_probes
            else None
        )

    def _load_mim_target(
        self,
        backbone: MultiwayConfig,
        visual_codebook: str | None,
        teacher_checkpoint: str | None,
        teacher_model: str,
        vqkd_tokenizer: str | None,
    ) -> int:
        """Loads the MIM target (exactly one of the visual codebook, the open_clip teacher and the VQ-KD tokenizer;
        BEiT-3 §2.2) and returns the width of the head that predicts it: its number of codes, or the teacher's
        feature width."""
        if sum(target is not None for target in (visual_codebook, teacher_checkpoint, vqkd_tokenizer)) != 1:
            raise ValueError(
                "set exactly one of model.visual_codebook, model.teacher_checkpoint and model.vqkd_tokenizer (the MIM "
                "target)"
            )
        self.codebook = None
        # Lists keep the frozen teacher and tokenizer out of state_dict and the optimiser.
        self._teacher: list[nn.Module] = []
        self._vqkd: list[VQKDTokenizer] = []
        if vqkd_tokenizer is not None:
            tokenizer = load_vqkd_tokenizer(vqkd_tokenizer, backbone.image_size // backbone.patch_size)
            self._vqkd.append(tokenizer)
            return tokenizer.num_codes
        if visual_codebook is not None:
            self.codebook = PatchCodebook.load(visual_codebook)
            if self.codebook.patch_size != backbone.patch_size:
                raise ValueError(
                    f"visual codebook {visual_codebook} was fitted on {self.codebook.patch_size}-px patches, "
                    f"but backbone.patch_size={backbone.patch_size}"
                )
            return self.codebook.size
        teacher = load_teacher(teacher_model, teacher_checkpoint)
        self._teacher.append(teacher)
        return teacher_width(teacher)

    # ----------------------------------------------------------------------------------------------- objective
    def masked_losses(self, batch: PretrainBatch) -> tuple[dict[str, torch.Tensor], list[RoutingRecord]]:
        """Cross-entropy of each masked-modeling target present in one single-kind batch, and the routing."""
        kind = batch["kind"]
        if kind not in BATCH_KINDS:
            raise ValueError(f"batch kind must be one of {BATCH_KINDS}, got {kind!r}")
        image = batch.get("image") if kind != TEXT else None
        text = batch.get("text_ids") if kind != IMAGE else None
        image_mask = batch.get("image_mask") if image is not None else None
        out = self.backbone(
            image=image, text=text, text_padding_mask=batch.get("text_padding_mask"), image_mask=image_mask
        )
        losses = {}
        if image_mask is not None and bool(image_mask.any()):
            predicted = self.mim_head(out.image_hidden[:, 1:][image_mask]).float()
            name = IMAGE if kind == IMAGE else f"{PAIR}_{IMAGE}"  # the loss names: image, pair_image
            if self.codebook is not None:
                losses[name] = F.cross_entropy(predicted, self.codebook.encode(image)[image_mask])
            elif self._vqkd:
                codes = batch.get("image_targets")  # the loader's, when it computes them (see setup)
                if codes is None:
                    codes = vqkd_codes(self._vqkd[0], image)
                losses[name] = F.cross_entropy(predicted, codes.to(image.device)[image_mask])
            else:
                grid = self.backbone.config.image_size // self.backbone.config.patch_size
                targets = teacher_patch_features(self._teacher[0], image, grid)[image_mask]
                losses[f"{name}_cosine"] = 1 - F.cosine_similarity(predicted, targets, dim=-1).mean()
        if text is not None:
            text_mask = batch["text_mask"]
            logits = self.mlm_head(out.text_hidden[text_mask])
            losses[kind] = F.cross_entropy(logits.float(), self.mlm_classes(batch["text_targets"][text_mask]))
        routing = out.routing
        if kind == PAIR and self.hparams.contrastive_coefficient > 0:
            losses[CONTRASTIVE], records = self.contrastive_loss(batch)
            routing = routing + records
        return losses, routing

    def contrastive_loss(self, batch: PretrainBatch) -> tuple[torch.Tensor, list[RoutingRecord]]:
        """The image-text contrastive loss of a pair batch (see ``contrastive_coefficient``) and the routing of its
        image-only and text-only passes."""
        image_out = self.backbone(image=batch["image"])
        text_out = self.backbone(text=batch["text_targets"], text_padding_mask=batch.get("text_padding_mask"))
        image_BD = F.normalize(self.vision_head(image_out.hidden[:, 0]), dim=-1)  # vision CLS
        text_BD = F.normalize(self.language_head(text_out.hidden[:, 0]), dim=-1)  # language CLS
        loss = contrastive_loss(gather_with_grad(image_BD), gather_with_grad(text_BD), self.logit_scale.float().exp())
        return loss, image_out.routing + text_out.routing

    def mlm_classes(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The MLM head's class of each masked token (its id without ``output_vocab``)."""
        if self.hparams.output_vocab is None:
            return token_ids
        option = f"model.output_vocab {self.hparams.output_vocab}"
        return classes_of(self.mlm_class_index, token_ids, option, self.tokenizer.decode)

    def step_losses(self, batch: PretrainStep) -> StepLosses:
        """Masked-modeling losses of every single-kind batch of the step (one in mixed mode, one per stream in joint
        mode), summed; each logged as ``<stage>/<name>_loss`` with its perplexity ``<stage>/<name>_ppl`` (not for
        the teacher's cosine losses)."""
        batches = step_batches(batch)
        masked, routing = {}, []
        for single in batches:
            losses, records = self.masked_losses(single)
            masked.update(losses)
            routing.extend(records)
        weights = {CONTRASTIVE: self.hparams.contrastive_coefficient}
        task_loss = torch.stack([value * weights.get(name, 1.0) for name, value in masked.items()]).sum()
        size = len(batches[0].get("image", batches[0].get("text_ids")))
        logged = {f"{name}_loss": value for name, value in masked.items()}
        logged |= {
            f"{name}_ppl": value.detach().exp()
            for name, value in masked.items()
            if "cosine" not in name and name != CONTRASTIVE
        }
        if CONTRASTIVE in masked:
            logged["logit_scale"] = self.logit_scale.detach().exp()
        return StepLosses(task_loss, logged, routing, size)

    def setup(self, stage: str) -> None:
        """Where the VQ-KD codes are computed: in the loader's workers on a CPU run whose pre-training loader has
        workers (how the two places compare: docs/benchmarks.md, ``benchmarks/vqkd_targets.py``), else in
        the task, on the run's device."""
        super().setup(stage)
        datamodule = self.trainer.datamodule
        if self._vqkd and codes_in_loader(self.trainer.strategy.root_device, datamodule):
            datamodule.image_targets = partial(vqkd_codes, self._vqkd[0])

    def validation_step(self, batch: PretrainStep, batch_idx: int) -> None:
        self.shared_step(batch, "val")
        if self.probing:
            for single in step_batches(batch):
                self.probe_collector.add(self.probe_encoder(), single)

    @property
    def probing(self) -> bool:
        """Whether this process runs the zero-shot probes (``zero_shot_probes``): the first process alone, so that the
        others run no extra forward and every process logs the same keys; never in FSDP2 or expert-parallel runs,
        where a process cannot run a forward of its own."""
        collective = self.fully_sharded or self.expert_groups is not None
        return self.probe_collector is not None and not collective and self.global_rank == 0

    def probe_encoder(self) -> ProbeEncoder:
        """The passes the probes embed images and texts with: the retrieval heads with the contrastive loss on,
        mean-pooled features without."""
        if self.hparams.contrastive_coefficient > 0:
            return ProbeEncoder(self.backbone, self.vision_head, self.language_head)
        return ProbeEncoder(self.backbone)

    def on_validation_epoch_end(self) -> None:
        """Logs the zero-shot probes of the pairs this validation collected (``val/probe/...``)."""
        super().on_validation_epoch_end()
        if not self.probing:
            return
        embeddings = self.probe_collector.finish(self.probe_encoder(), self.device)
        if embeddings is not None:
            # The first process alone logs the probes: with rank_zero_only the sync is a no-op, and sync_dist tells
            # Lightning so (without it, it advises gathering them across the processes).
            metrics = probe_metrics(embeddings)
            self.log_dict(metrics, rank_zero_only=True, sync_dist=True, batch_size=len(embeddings.image_ND))


#: The option that names the VQ-KD tokenizer file, as its errors and report name it.
VQKD_OPTION = "model.vqkd_tokenizer"


def load_vqkd_tokenizer(path: str, grid: int) -> VQKDTokenizer:
    """The frozen VQ-KD tokenizer of ``path`` for a backbone of ``grid x grid`` patches; the file's keys it does not
    need (decoder, EMA statistics, teacher) are reported in one line on stderr."""
    loaded = load_vqkd(path, grid, what=VQKD_OPTION)
    if loaded.unused:
        print(
            f"mmoe: {VQKD_OPTION} {path}: {len(loaded.unused)} tensors not needed for targets left unused "
            f"({unused_summary(loaded.unused)})",
            file=sys.stderr,
        )
    return loaded.tokenizer


def codes_in_loader(device: torch.device, datamodule: object) -> bool:
    """Whether the loader computes the visual tokens: a CPU run with a pre-training loader that has workers."""
    return device.type == "cpu" and isinstance(datamodule, PretrainDataModule) and datamodule.num_workers > 0


@torch.no_grad()
def vqkd_codes(tokenizer: VQKDTokenizer, image: torch.Tensor) -> torch.Tensor:
    """(B, N) VQ-KD codes of (B, 3, H, W) images normalised as the data's transforms normalise them (undone by
    :func:`mmoe.data.transforms.denormalize`, clamped to [0, 1], the tokenizer's own input). The tokenizer runs in
    fp32 whatever the run's precision: a bf16 autocast changes some of the codes of a tokenizer of the released shape
    (how many: docs/explanations/vqkd_targets.md, ``benchmarks/vqkd_targets.py``,
    ``bf16_agreement``), so bf16 does not keep them."""
    tokenizer.to(image.device)
    pixels = denormalize(image.float()).clamp(0, 1)
    with torch.autocast(image.device.type, enabled=False):
        return tokenizer.encode(pixels)


def load_teacher(model_name: str, checkpoint: str) -> nn.Module:
    """A frozen open_clip vision tower from weights on disk (nothing is downloaded)."""
    import open_clip

    if not Path(checkpoint).is_file():
        raise FileNotFoundError(f"model.teacher_checkpoint {checkpoint} does not exist")
    if model_name not in open_clip.list_models():
        raise ValueError(f"model.teacher_model {model_name!r} is not an open_clip model name")
    visual = open_clip.create_model(model_name, pretrained=checkpoint).visual.eval()
    visual.requires_grad_(False)
    return visual


def teacher_width(visual: nn.Module) -> int:
    probe = torch.zeros(1, 3, *visual.image_size)
    with torch.no_grad():
        return visual.forward_intermediates(probe, indices=1, output_fmt="NLC", intermediates_only=True)[
            "image_intermediates"
        ][0].shape[-1]


@torch.no_grad()
def teacher_patch_features(visual: nn.Module, image: torch.Tensor, grid: int) -> torch.Tensor:
    """Last-block patch features of the teacher for (B, 3, H, W) images normalised as the data's transforms normalise
    them (undone by :func:`mmoe.data.transforms.denormalize`, then normalised the teacher's way), average-pooled to
    the backbone's ``grid x grid`` patches: (B, grid^2, C)."""
    from open_clip import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD

    visual.to(image.device)
    pixels = denormalize(image.float())
    mean = torch.tensor(OPENAI_DATASET_MEAN, device=image.device)[:, None, None]
    std = torch.tensor(OPENAI_DATASET_STD, device=image.device)[:, None, None]
    pixels = F.interpolate(pixels, size=tuple(visual.image_size), mode="bicubic", align_corners=False)
    features = visual.forward_intermediates((pixels - mean) / std, indices=1, output_fmt="NLC", intermediates_only=True)
    tokens = features["image_intermediates"][0]  # (B, prefix + g*g, C)
    side = int(math.isqrt(tokens.shape[1]))
    patches = tokens[:, tokens.shape[1] - side * side :]
    feature_map = patches.transpose(1, 2).reshape(tokens.shape[0], -1, side, side)
    return F.adaptive_avg_pool2d(feature_map, grid).flatten(2).transpose(1, 2)
