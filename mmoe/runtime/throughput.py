"""Tokens per second, model FLOPs utilisation (MFU) and a progress line with ETA, for every ``mmoe fit``, ``validate``,
``test`` and ``predict`` (:class:`Throughput`; ``--throughput.*`` options, added by :class:`mmoe.config.cli.MMoECLI`).

Tokens are counted where the backbone reads them (a hook before :meth:`MultiwayTransformer.forward`), so every task
and batch type of :mod:`mmoe.data.batches` counts the same way: each image is its patches plus the CLS token, each
text its real tokens (``text_padding_mask`` False), every backbone pass of a step counted (NLVR2's sentence once per
image; the doubled batch is one pass of twice the sequences).

FLOPs are model FLOPs (PaLM, Chowdhery et al., 2022, App. B): per token the backbone's forward FLOPs in its weights
(:func:`mmoe.model.cost.backbone_cost`: attention projections, dense FFNs, the active experts of MoE layers, MH-MoE
App. D; a Stratified MoE layer counted at its first gate), plus the attention scores, ``4 * depth * dim * L**2`` for a
sequence of ``L`` real tokens. Training counts 3x the forward (the backward is about twice the forward); evaluation
and prediction 1x. Embeddings, heads and recomputed activations are left out. MFU is those FLOPs per second over
``peak_flops`` times the number of processes; without ``peak_flops`` it is not logged (the peak depends on the
device and the precision: an H100 SXM gives 989e12 dense bf16 FLOP/s, 67e12 in fp32).

Logged every ``every_n_steps`` training steps straight to the trainer's loggers (so no value waits for Lightning's
``log_every_n_steps``): ``train/tokens_per_s`` and ``train/mfu`` over the steps since the last line, with one line on
stdout, ``<label>: step S/MAX  loss L  T tokens/s  MFU M%  elapsed H:MM:SS  ETA H:MM:SS``. Each stage ends with one
line over the whole stage: ``mmoe fit: N tokens in S s: T tokens/s, MFU M% ...``. Validation inside ``mmoe fit`` is
timed apart and left out of the training numbers.
"""

from __future__ import annotations

import dataclasses
import datetime
import inspect
import time
from typing import Any

import lightning as L
import torch

from mmoe.model import MultiwayTransformer
from mmoe.model.config import MultiwayConfig
from mmoe.model.cost import backbone_cost
from mmoe.runtime.backbone_training import BackboneTraining

#: FLOPs of a training step over those of the forward pass (forward + backward of about twice the forward).
TRAINING_FLOPS_FACTOR = 3


def sequence_lengths(config: MultiwayConfig, image: Any, text: Any, text_padding_mask: Any) -> torch.Tensor | None:
    """(B,) real tokens of each sequence of one backbone pass: the image's patches and CLS token, plus the text's
    tokens less its padding; None without image and text."""
    lengths = None
    if image is not None:
        patches = (image.shape[-2] // config.patch_size) * (image.shape[-1] // config.patch_size)
        lengths = torch.full((image.shape[0],), patches + 1, device=image.device)
    if text is not None:
        text_lengths = torch.full((text.shape[0],), text.shape[1], device=text.device)
        if text_padding_mask is not None:
            text_lengths = text_lengths - text_padding_mask.sum(dim=1)
        lengths = text_lengths if lengths is None else lengths + text_lengths
    return lengths


class BackboneTokens:
    """Counts the real tokens of every pass through a backbone, and the sum of the squared sequence lengths (the
    attention scores' share), on the backbone's device (no host sync): a forward pre-hook, removed by :meth:`close`."""

    def __init__(self, backbone: MultiwayTransformer) -> None:
        self.config = backbone.config
        self._signature = inspect.signature(backbone.forward)
        self._counts: torch.Tensor | None = None  # (tokens, sum of squared lengths)
        self._hook = backbone.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        given = self._signature.bind(*args, **kwargs).arguments
        lengths = sequence_lengths(self.config, given.get("image"), given.get("text"), given.get("text_padding_mask"))
        if lengths is None:  # neither image nor text: the backbone refuses the call itself
            return
        lengths = lengths.double()
        counts = torch.stack([lengths.sum(), lengths.square().sum()])
        self._counts = counts if self._counts is None else self._counts + counts

    def take(self) -> torch.Tensor | None:
        """The counts since the last call: a (2,) tensor (tokens, sum of squared lengths), None when no pass ran."""
        counts, self._counts = self._counts, None
        return counts

    def close(self) -> None:
        self._hook.remove()


def forward_flops(config: MultiwayConfig, tokens: float, squared_lengths: float) -> float:
    """Model forward FLOPs of ``tokens`` real tokens in sequences whose squared lengths sum to ``squared_lengths``:
    the weights' FLOPs per token times the tokens, plus the attention scores (module docstring). A Soft MoE layer's
    per-token FLOPs are counted at the token-weighted mean length ``squared_lengths / tokens``."""
    length = max(1, round(squared_lengths / tokens)) if tokens else 1
    per_token = backbone_cost(config, sequence_length=length)["flops_per_token"]
    return per_token * tokens + 4 * config.depth * config.dim * squared_lengths


def clock(seconds: float) -> str:
    """``H:MM:SS``."""
    return str(datetime.timedelta(seconds=round(seconds)))


@dataclasses.dataclass
class Meter:
    """Tokens, FLOPs and busy seconds of one stage (or one window of training steps)."""

    tokens: float = 0.0
    flops: float = 0.0
    seconds: float = 0.0

    def add(self, other: Meter) -> None:
        self.tokens += other.tokens
        self.flops += other.flops
        self.seconds += other.seconds

    def rates(self, peak_flops: float | None, world_size: int) -> dict[str, float]:
        """``tokens_per_s`` and, with a peak, ``mfu`` (a fraction of ``peak_flops`` x ``world_size``)."""
        seconds = max(self.seconds, 1e-9)
        rates = {"tokens_per_s": self.tokens / seconds}
        if peak_flops:
            rates["mfu"] = self.flops / seconds / (peak_flops * world_size)
        return rates


class Throughput(L.Callback):
    """Logs tokens per second and MFU, prints progress lines with an ETA while training and one line per stage
    (module docstring).

    Args:
        every_n_steps: training steps between logged values and progress lines; None: the trainer's
            ``log_every_n_steps``. The last step always gets a line.
        peak_flops: the peak FLOP/s of one device at the run's precision (989e12: H100 SXM, dense bf16); None logs
            no MFU.
        label: what the progress lines start with; None: ``mmoe fit``.
    """

    def __init__(self, every_n_steps: int | None = None, peak_flops: float | None = None, label: str | None = None):
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"throughput.every_n_steps must be >= 1, got {every_n_steps!r}")
        if peak_flops is not None and not peak_flops > 0:
            raise ValueError(f"throughput.peak_flops must be > 0 FLOP/s, got {peak_flops!r}")
        self.every_n_steps = every_n_steps
        self.peak_flops = peak_flops
        self.label = label
        self._tokens: BackboneTokens | None = None
        self._stage = Meter()
        self._window = Meter()
        self._window_counts: torch.Tensor | None = None
        self._mark = time.perf_counter()
        self._first_step = 0
        self._last_line_step = -1
        #: The training meters while a validation inside ``mmoe fit`` is measured.
        self._saved: tuple[Meter, Meter, torch.Tensor | None] = (Meter(), Meter(), None)

    # ---------------------------------------------------------------------------------------------- counting
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if isinstance(pl_module, BackboneTraining) and self._tokens is None:  # other modules count no tokens
            self._tokens = BackboneTokens(pl_module.backbone)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._tokens is not None:
            self._tokens.close()
            self._tokens = None

    def _start(self, trainer: L.Trainer) -> None:
        self._stage, self._window, self._window_counts = Meter(), Meter(), None
        if self._tokens is not None:
            self._tokens.take()  # what ran before the stage (a sanity check) is not the stage's
        self._mark = time.perf_counter()

    def _batch_done(self) -> None:
        """Adds the time since the last mark and the tokens counted since to the window (no host sync)."""
        now = time.perf_counter()
        self._window.seconds += now - self._mark
        self._mark = now
        counts = self._tokens.take() if self._tokens is not None else None
        if counts is not None:
            self._window_counts = counts if self._window_counts is None else self._window_counts + counts

    def _close_window(self, trainer: L.Trainer, factor: int) -> Meter:
        """The window's tokens and FLOPs summed over the processes (a collective: every process calls it), added to
        the stage; the window starts again."""
        counts = self._window_counts
        if counts is None:
            counts = torch.zeros(2, dtype=torch.float64, device=trainer.strategy.root_device)
        counts = trainer.strategy.reduce(counts, reduce_op="sum").tolist()
        window = self._window
        window.tokens = counts[0]
        if self._tokens is not None:
            window.flops = factor * forward_flops(self._tokens.config, counts[0], counts[1])
        self._stage.add(window)
        self._window, self._window_counts = Meter(), None
        return window

    def _summary(self, trainer: L.Trainer, command: str, what: str) -> None:
        stage = self._stage
        if not trainer.is_global_zero or stage.tokens == 0:
            return
        rates = stage.rates(self.peak_flops, trainer.world_size)
        mfu = f", MFU {rates['mfu']:.2%} of {self.peak_flops:.3g} FLOP/s per device" if "mfu" in rates else ""
        print(
            f"mmoe {command}: {what} {stage.tokens:,.0f} tokens in {stage.seconds:.2f} s: "
            f"{rates['tokens_per_s']:,.0f} tokens/s{mfu}",
            flush=True,
        )

    # ---------------------------------------------------------------------------------------------- training
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start(trainer)
        self._first_step = trainer.global_step
        self._last_line_step = -1

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        self._batch_done()
        step = trainer.global_step
        every = self.every_n_steps or trainer.log_every_n_steps
        if step == self._last_line_step or (step % every and step != trainer.max_steps):
            return
        self._last_line_step = step
        window = self._close_window(trainer, TRAINING_FLOPS_FACTOR)
        if not trainer.is_global_zero:
            return
        rates = window.rates(self.peak_flops, trainer.world_size)
        for logger in trainer.loggers:
            logger.log_metrics({f"train/{name}": value for name, value in rates.items()}, step=step)
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        self._print(trainer, self._progress_line(trainer, step, loss, rates))

    def _progress_line(self, trainer: L.Trainer, step: int, loss: Any, rates: dict[str, float]) -> str:
        total = trainer.max_steps if trainer.max_steps > 0 else trainer.estimated_stepping_batches
        known = total != float("inf")  # an iterable loader without a length and no max_steps: no ETA
        done = step - self._first_step
        elapsed = self._stage.seconds
        parts = [f"{self.label or 'mmoe fit'}: step {step}" + (f"/{int(total)}" if known else "")]
        if loss is not None:
            parts.append(f"loss {float(loss):.4g}")
        parts.append(f"{rates['tokens_per_s']:,.0f} tokens/s")
        if "mfu" in rates:
            parts.append(f"MFU {rates['mfu']:.2%}")
        parts.append(f"elapsed {clock(elapsed)}")
        if done > 0 and known:
            parts.append(f"ETA {clock(elapsed / done * max(total - step, 0))}")
        return "  ".join(parts)

    def _print(self, trainer: L.Trainer, line: str) -> None:
        """On stdout, through the progress bar when there is one (it keeps its bar below the line)."""
        if trainer.progress_bar_callback is not None:
            trainer.progress_bar_callback.print(line)
        else:
            print(line, flush=True)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._batch_done()
        self._close_window(trainer, TRAINING_FLOPS_FACTOR)
        self._summary(trainer, "fit", "trained on")

    # ---------------------------------------------------------------------------------------------- evaluation
    def _evaluation_start(self, trainer: L.Trainer) -> None:
        if trainer.state.fn == "fit":
            self._batch_done()  # the training time up to here; the validation that follows is not training's
            self._saved = (self._stage, self._window, self._window_counts)
        self._start(trainer)

    def _evaluation_end(self, trainer: L.Trainer, command: str) -> None:
        self._batch_done()
        self._close_window(trainer, 1)
        if trainer.state.fn == "fit":
            self._stage, self._window, self._window_counts = self._saved
            self._mark = time.perf_counter()
            return
        self._summary(trainer, command, "evaluated" if command != "predict" else "predicted from")

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._evaluation_start(trainer)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self._batch_done()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._evaluation_end(trainer, "validate")

    def on_test_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start(trainer)

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self._batch_done()

    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._evaluation_end(trainer, "test")

    def on_predict_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start(trainer)

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self._batch_done()

    def on_predict_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._evaluation_end(trainer, "predict")
