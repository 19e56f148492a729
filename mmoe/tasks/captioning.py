"""COCO captioning fine-tuning, BEiT-3 style (Wang et al., 2023, §3.1; unilm ``BEiT3ForCaptioning``).

The backbone sees ``[image tokens, caption tokens]`` under one attention mask: image tokens attend to all image tokens
and never to text; caption tokens attend to all image tokens and causally to the caption (themselves and earlier
tokens). Training is masked-token prediction under that mask (BEiT-3's s2s-style recipe): the collator corrupts a share
of the caption tokens after the start token (``text_mask``, mostly the mask token) and a linear head over the
vocabulary predicts the original ids (``text_targets``) at those positions with BEiT-3's label-smoothed loss (eps 0.1:
the target gets 1 - eps, every other id eps / (V - 1)).

With ``output_vocab`` the head predicts only the ids of a list (the tokens of the training captions, written by the
caption converters as ``caption_tokens.json``) instead of the whole 49,410-id vocabulary: the same loss over fewer
classes, and decoding never writes an id outside the list. On the synthetic corpus the full head is most of a tiny
model's training step (``benchmarks/caption_head.py``).

Generation feeds ``[start, w_1 .. w_{t-1}, mask]`` and reads the next token at the mask slot, greedily or by beam
search (:mod:`mmoe.model.decoding`), batched over images and beams. The whole prefix is recomputed every step (no
key/value cache): captions are short (BEiT-3: 32 tokens), and the backbone stays a plain ``forward``. Validation
decodes every image, writes ``[{"image_id", "caption"}]`` when ``results_dir`` is set (in the run folder), and logs
the COCO caption metrics of :func:`mmoe.metrics.captions.score_captions` against the references in the batches.

The caption is causal, in the MoE layers too: dropless token-choice routing (as shipped) routes each token on its own
state, so no token's output depends on a later one (tested). With a capacity factor, which choices are dropped depends
on the whole batch (first choices, then earlier tokens of the flattened batch, win), other captions' later tokens
included. Expert-choice routing, batch-priority drops and top-k > 1 under a finite capacity are refused
(:attr:`CaptioningFineTuning.causal_text`): each expert picks its top-C tokens of the whole batch, batch priority drops
the least confident choices of the whole batch first, and with top-2 a later token's first choice can drop an earlier
token's second choice of the same caption, so a token's routing would depend on the tokens after it.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_warn

from mmoe.data.batches import CaptionBatch
from mmoe.data.tokenizer import TextTokenizer
from mmoe.metrics.captions import ScorerUnavailableError, score_captions
from mmoe.model import MultiwayConfig
from mmoe.model.decoding import Decoded, beam_search, greedy_search
from mmoe.model.heads import token_head
from mmoe.model.output_vocab import class_index, classes_of, load_output_vocab
from mmoe.moe import RoutingRecord
from mmoe.moe.choices.values import finite_at_least
from mmoe.runtime.predictions import as_ids
from mmoe.tasks.finetuning import FineTuningTask


def caption_attention_mask(image_len: int, text_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """(1, L, L) bool, True = the query (row) may attend to the key (column), L = image_len + text_len: image rows see
    the image only; text rows see the image and the caption up to themselves."""
    length = image_len + text_len
    mask = torch.zeros(1, length, length, dtype=torch.bool, device=device)
    mask[:, :, :image_len] = True
    mask[:, image_len:, image_len:] = torch.ones(text_len, text_len, dtype=torch.bool, device=device).tril()
    return mask


def label_smoothed_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, smoothing: float) -> torch.Tensor:
    """BEiT-3's ``BertCaptioningLoss`` (without its drop-worst option): cross-entropy against the target
    distribution ``1 - smoothing`` on the target and ``smoothing / (V - 1)`` on every other id, averaged over tokens.
    BEiT-3 writes it as a KL divergence, which differs by the target distribution's constant entropy; torch's
    ``label_smoothing`` spreads s / V over all V ids, so s = smoothing * V / (V - 1) gives the same distribution."""
    vocab = logits.shape[-1]
    return F.cross_entropy(logits.float(), targets, label_smoothing=smoothing * vocab / (vocab - 1))


class CaptioningFineTuning(FineTuningTask):
    """Fine-tune a multiway backbone for image captioning (BEiT-3 style masked-token training, beam search).

    Batches (:class:`mmoe.data.collate.CaptionCollator`): training ``image``, ``text_ids`` (corrupted),
    ``text_padding_mask``, ``text_targets``, ``text_mask``; evaluation ``image``, ``image_id`` and ``captions`` (the
    references; absent at prediction time).

    Args:
        label_smoothing: eps of the label-smoothed loss (BEiT-3: 0.1).
        num_beams: beams for validation and prediction; 1 = greedy decoding (BEiT-3: 3).
        max_length: most generated tokens, the end token included (BEiT-3: 32-token captions with the start token).
        min_length: fewest generated tokens before the end token may come.
        length_penalty: alpha of the beam score ``sum log p / length ** alpha`` (BEiT-3: 0.6).
        results_dir: directory for ``captions_val_step<N>.json`` at each validation; a relative path lies in the run
            folder (``trainer.default_root_dir``; the current folder without one), an absolute one is used as
            given; None = not written.
        predictions_file: where ``mmoe predict`` writes ``[{"image_id", "caption"}]`` (atomically). None = not
            written.
        spice: also compute SPICE at validation (slow; needs its Stanford CoreNLP jars, else reported unavailable).
        output_vocab: ``caption_tokens.json`` of the training split: the head predicts these ids only (label
            smoothing spreads over them); None = the whole vocabulary (BEiT-3).
        **kwargs: the shared fine-tuning arguments of :class:`mmoe.tasks.finetuning.FineTuningTask` (backbone,
            pretrained, frozen_routing, balance and optimiser settings). A backbone with ``routing:
            expert_choice`` is refused (the caption is causal; module docstring).
    """

    name = "captioning"
    causal_text = True
    beit3_heads = {"mlm_head.": "head."}
    prediction_key = "image_id"
    file_arguments = ("output_vocab", "text_tokenizer")

    def __init__(
        self,
        label_smoothing: float = 0.1,
        num_beams: int = 3,
        max_length: int = 31,
        min_length: int = 0,
        length_penalty: float = 0.6,
        results_dir: str | None = None,
        predictions_file: str | None = None,
        spice: bool = False,
        output_vocab: str | None = None,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        self.predictions_file, self.results_dir = predictions_file, results_dir
        if num_beams < 1:
            raise ValueError(f"model.num_beams must be >= 1, got {num_beams!r}")
        if not (finite_at_least(label_smoothing, 0.0) and label_smoothing < 1):
            raise ValueError(f"model.label_smoothing must lie in [0, 1), got {label_smoothing!r}")
        if not finite_at_least(length_penalty, -math.inf):
            raise ValueError(f"model.length_penalty must be a finite number, got {length_penalty!r}")
        if not 1 <= max_length < self.backbone.config.max_text_positions - self.backbone.config.position_offset:
            raise ValueError(
                f"model.max_length={max_length} must lie in [1, backbone.max_text_positions - position_offset - 1]"
            )
        tokenizer_file = self.hparams.get("text_tokenizer")
        self.tokenizer = TextTokenizer(max_length + 1, tokenizer_file)
        text_ids = self.tokenizer.ids
        vocab_size = self.backbone.config.vocab_size
        text_ids.check_embedding(vocab_size, f"model.text_tokenizer {tokenizer_file or '(open_clip BPE)'}")
        ids = list(range(vocab_size)) if output_vocab is None else load_output_vocab(output_vocab, vocab_size, text_ids)
        # Head class k is token output_ids[k]; output_index maps a token id back to its class (-1: not predicted).
        # Not saved: the hyperparameters name the file, and the head's shape checks a checkpoint against it.
        self.register_buffer("output_ids", torch.tensor(ids, dtype=torch.long), persistent=False)
        self.register_buffer("output_index", class_index(self.output_ids, vocab_size), persistent=False)
        self.head = token_head(self.backbone.config.dim, len(ids))
        self.load_beit3_head(rows=self.output_ids)

    @classmethod
    def head_parameters(cls, config: MultiwayConfig, init_args: dict[str, Any]) -> dict[str, int]:
        classes = config.vocab_size
        if init_args.get("output_vocab"):
            classes = len(load_output_vocab(init_args["output_vocab"], config.vocab_size))
        return {"head": sum(p.numel() for p in token_head(config.dim, classes).parameters())}

    # ---------------------------------------------------------------------------------------------- training
    def forward(
        self,
        image: torch.Tensor,
        text: torch.Tensor,
        text_padding_mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[RoutingRecord]]:
        """Head logits of the text tokens under the captioning mask: (B, T, K), or (M, K) at the ``positions``
        (B, T) bool mask, K = ``len(output_ids)`` (the vocabulary size without ``output_vocab``); and the routing
        records."""
        attn_mask = self.text_attention_mask(text.shape[1], text.device)
        out = self.backbone(image=image, text=text, text_padding_mask=text_padding_mask, attn_mask=attn_mask)
        hidden = out.text_hidden if positions is None else out.text_hidden[positions]
        return self.head(hidden), out.routing

    def text_attention_mask(self, text_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """:func:`caption_attention_mask` for this backbone's image tokens and ``text_len`` text tokens."""
        return caption_attention_mask(1 + self.backbone.config.num_patches, text_len, device)

    def forward_batch(self, batch: CaptionBatch) -> tuple[torch.Tensor, list[RoutingRecord]]:
        return self(batch["image"], batch["text_ids"], batch.get("text_padding_mask"), batch["text_mask"])

    def task_loss(self, logits: torch.Tensor, batch: CaptionBatch) -> torch.Tensor:
        return label_smoothed_cross_entropy(
            logits, self.head_classes(batch["text_targets"][batch["text_mask"]]), self.hparams.label_smoothing
        )

    def head_classes(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Head class of each token id; an id outside ``output_vocab`` is an error naming it."""
        if self.hparams.output_vocab is None:
            return token_ids  # the whole vocabulary: class = id
        return classes_of(
            self.output_index, token_ids, f"model.output_vocab {self.hparams.output_vocab}", self.tokenizer.decode
        )

    # ---------------------------------------------------------------------------------------------- generation
    def next_token_scorer(self, image: torch.Tensor, beams: int = 1):
        """The decoders' ``step``: (B * beams, t) prefixes (sample-major) -> (B * beams, V) next-token
        log-probabilities, read at a mask token appended to the prefix (BEiT-3's ``[..., <mask>]`` slot).

        The image tokens attend to the image only, so where every MoE layer routes each token on its own
        (:meth:`mmoe.model.MultiwayTransformer.routes_each_token_alone`) the image's keys and values are computed
        once and each step runs the text alone (:meth:`~mmoe.model.MultiwayTransformer.forward_text`); otherwise
        (a capacity factor in force, whose drops depend on the other tokens) each step runs the whole sequence."""
        logits_of = self._text_logits(image, beams)

        def step(prefix: torch.Tensor) -> torch.Tensor:
            slot = torch.full((prefix.shape[0], 1), self.tokenizer.ids.mask, dtype=prefix.dtype, device=prefix.device)
            logits = logits_of(torch.cat([prefix, slot], dim=1))
            logprobs = torch.log_softmax(logits[:, -1].float(), dim=-1)
            if self.hparams.output_vocab is None:  # the head covers the whole vocabulary
                return logprobs
            full = logprobs.new_full((logprobs.shape[0], self.backbone.config.vocab_size), -torch.inf)
            return full.index_copy_(1, self.output_ids, logprobs)

        return step

    def _text_logits(self, image: torch.Tensor, beams: int):
        """(B * beams, T) text -> (B * beams, T, K) head logits of the text after ``image`` (each image's beams
        consecutive), under the captioning mask."""
        if not self.backbone.routes_each_token_alone():
            expanded = image.repeat_interleave(beams, dim=0) if beams > 1 else image
            return lambda text: self(expanded, text)[0]
        context = [layer.repeat_interleave(beams) for layer in self.backbone.image_context(image)]
        image_len = 1 + self.backbone.config.num_patches  # a depth-routed layer's context holds fewer keys

        def logits_of(text: torch.Tensor) -> torch.Tensor:
            mask = self.text_attention_mask(text.shape[1], text.device)[:, image_len:]  # the text rows
            return self.head(self.backbone.forward_text(text, context, mask).text_hidden)

        return logits_of

    def decoding_options(self) -> dict:
        hparams, ids = self.hparams, self.tokenizer.ids
        return dict(
            bos_id=ids.start,
            eos_id=ids.end,
            pad_id=ids.pad,
            max_length=hparams.max_length,
            min_length=hparams.min_length,
            length_penalty=hparams.length_penalty,
            forbidden=(ids.start, ids.pad, ids.mask),
        )

    @torch.no_grad()
    def generate(self, image: torch.Tensor, num_beams: int | None = None) -> Decoded:
        """Captions of a batch of images: generated ids after the start token (pad after the end token); greedy
        with one beam."""
        beams = self.hparams.num_beams if num_beams is None else num_beams
        step = self.next_token_scorer(image, beams)
        if beams == 1:
            return greedy_search(step, image.shape[0], device=image.device, **self.decoding_options())
        return beam_search(step, image.shape[0], beams, device=image.device, **self.decoding_options())

    def captions(self, image: torch.Tensor) -> list[str]:
        return [self.tokenizer.decode(ids) for ids in self.generate(image).tokens.cpu()]

    def validation_step(self, batch: CaptionBatch, batch_idx: int) -> None:
        if "text_mask" in batch:  # a masked (training-style) validation batch also gets a loss
            self.shared_step(batch, "val")
        if "image_id" not in batch or "captions" not in batch:
            return
        image_ids = as_ids(batch["image_id"])
        for image_id, caption, references in zip(
            image_ids, self.captions(batch["image"]), batch["captions"], strict=True
        ):
            self.validation_outputs.append({"image_id": image_id, "caption": caption, "references": references})

    def on_validation_epoch_end(self) -> None:
        super().on_validation_epoch_end()
        outputs = {o["image_id"]: o for o in self.gathered_validation_outputs()}
        if not outputs or self.trainer.sanity_checking:
            return
        if self.results_dir is not None and self.trainer.is_global_zero:
            folder = Path(self.trainer.default_root_dir) / self.results_dir  # an absolute results_dir stays
            path = folder / f"captions_val_step{self.global_step}.json"
            self.write_predictions([{"image_id": i, "caption": o["caption"]} for i, o in outputs.items()], path)
        references = {i: o["references"] for i, o in outputs.items()}
        predictions = {i: o["caption"] for i, o in outputs.items()}
        try:
            scores = score_captions(references, predictions, spice=self.hparams.spice)
        except ScorerUnavailableError as error:
            rank_zero_warn(f"caption metrics not computed: {error}")
            return
        self.log_dict({f"val/{name}": float(value) for name, value in scores.items() if isinstance(value, float)})

    def prediction_entries(self, batch: CaptionBatch) -> list[dict]:
        """``{"image_id", "caption"}`` per image: the COCO results file's entries."""
        captions = self.captions(batch["image"])
        return [
            {"image_id": image_id, "caption": caption}
            for image_id, caption in zip(as_ids(batch["image_id"]), captions, strict=True)
        ]
