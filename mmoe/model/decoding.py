"""Batched greedy and beam-search decoding over any next-token scorer (BEiT-3 captioning, ``CaptioningHandler``).

Both run one loop over output positions; every step scores all sequences of the batch (and all beams) in one call,
so there is no per-sample Python loop. The scorer recomputes the whole prefix each step (no key/value cache): the
caller's ``step(tokens)`` maps (N, t) token ids, starting with the start token, to (N, V) next-token
log-probabilities.

Beam search keeps ``num_beams`` hypotheses per sample and ranks candidates by the length-penalised score
``sum of log-probabilities / length ** length_penalty`` (BEiT-3: ``--length_penalty 0.6``; length = generated tokens,
the end token included). A hypothesis that produced the end token stays in its beam: its only continuation is a pad
token at no cost, and it competes with the open hypotheses on its final penalised score. At the end the best of the
``num_beams`` hypotheses is returned. With one beam every candidate has the same length, so the ranking is the
argmax of the next-token log-probability and beam search equals greedy decoding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

Step = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class Decoded:
    """Attributes:
    tokens: (B, T) generated ids after the start token; after the end token, ``pad_id``.
    scores: (B,) length-penalised score of each returned sequence.
    lengths: (B,) generated tokens, the end token included.
    """

    tokens: torch.Tensor
    scores: torch.Tensor
    lengths: torch.Tensor


def _constrain(logprobs: torch.Tensor, position: int, eos_id: int, min_length: int, forbidden: Sequence[int]):
    """Forbidden ids never; the end token not before ``min_length`` generated tokens."""
    logprobs = logprobs.float().clone()
    if forbidden:
        logprobs[..., list(forbidden)] = -torch.inf
    if position < min_length:
        logprobs[..., eos_id] = -torch.inf
    return logprobs


def greedy_search(
    step: Step,
    batch_size: int,
    bos_id: int,
    eos_id: int,
    pad_id: int,
    max_length: int,
    min_length: int = 0,
    length_penalty: float = 1.0,
    forbidden: Sequence[int] = (),
    device: torch.device | str = "cpu",
) -> Decoded:
    """Greedy decoding of ``batch_size`` sequences of at most ``max_length`` generated tokens (arguments as
    :func:`beam_search`; ``length_penalty`` only sets the reported score)."""
    tokens = torch.full((batch_size, 1), bos_id, dtype=torch.long, device=device)
    total = torch.zeros(batch_size, device=device)
    lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
    finished = torch.zeros(batch_size, dtype=torch.bool, device=device)
    for position in range(max_length):
        logprobs = _constrain(step(tokens), position, eos_id, min_length, forbidden)
        best, token = logprobs.max(dim=-1)
        token = torch.where(finished, torch.full_like(token, pad_id), token)
        total = total + torch.where(finished, torch.zeros_like(best), best)
        lengths = lengths + (~finished).long()
        finished = finished | (token == eos_id)
        tokens = torch.cat([tokens, token[:, None]], dim=1)
        if bool(finished.all()):
            break
    return Decoded(tokens[:, 1:], total / lengths.clamp(min=1).float() ** length_penalty, lengths)


def beam_search(
    step: Step,
    batch_size: int,
    num_beams: int,
    bos_id: int,
    eos_id: int,
    pad_id: int,
    max_length: int,
    min_length: int = 0,
    length_penalty: float = 1.0,
    forbidden: Sequence[int] = (),
    device: torch.device | str = "cpu",
) -> Decoded:
    """Beam search, batched over samples and beams (see the module docstring for the scoring).

    Args:
        step: (B * num_beams, t) ids -> (B * num_beams, V) next-token log-probabilities; rows are sample-major
            (the beams of sample 0 first).
        batch_size: number of samples B.
        num_beams: hypotheses kept per sample.
        bos_id: start token every sequence begins with (not returned).
        eos_id: end token.
        pad_id: filler after the end token.
        max_length: most generated tokens (the end token included); unfinished hypotheses are cut there.
        min_length: fewest generated tokens before the end token may come.
        length_penalty: alpha in ``score = sum log p / length ** alpha`` (0 = raw sum).
        forbidden: ids never generated (start, pad, mask).
        device: where the search runs.
    """
    beams = num_beams
    tokens = torch.full((batch_size * beams, 1), bos_id, dtype=torch.long, device=device)
    total = torch.zeros(batch_size, beams, device=device)
    total[:, 1:] = -torch.inf  # all beams start identical: expand only the first one
    lengths = torch.zeros(batch_size, beams, dtype=torch.long, device=device)
    finished = torch.zeros(batch_size, beams, dtype=torch.bool, device=device)
    for position in range(max_length):
        logprobs = _constrain(step(tokens), position, eos_id, min_length, forbidden)
        vocab = logprobs.shape[-1]
        logprobs = _pad_when_finished(logprobs.view(batch_size, beams, vocab), finished, pad_id)
        candidates_BKV = total[..., None] + logprobs
        lengths_BK = lengths + (~finished).long()
        penalised_BKV = candidates_BKV / lengths_BK[..., None].float() ** length_penalty

        _, index_BK = penalised_BKV.view(batch_size, beams * vocab).topk(beams, dim=-1)
        source_BK, token_BK = index_BK // vocab, index_BK % vocab
        total = candidates_BKV.view(batch_size, -1).gather(1, index_BK)
        lengths = lengths_BK.gather(1, source_BK)
        finished = finished.gather(1, source_BK) | (token_BK == eos_id)
        history = tokens.view(batch_size, beams, -1).gather(1, source_BK[..., None].expand(-1, -1, position + 1))
        tokens = torch.cat([history, token_BK[..., None]], dim=-1).view(batch_size * beams, -1)
        if bool(finished.all()):
            break
    return _best_hypotheses(tokens, total, lengths, length_penalty)


def _pad_when_finished(logprobs_BKV: torch.Tensor, finished_BK: torch.Tensor, pad_id: int) -> torch.Tensor:
    """A finished hypothesis continues only with a pad, at no cost."""
    filler = torch.full((logprobs_BKV.shape[-1],), -torch.inf, device=finished_BK.device)
    filler[pad_id] = 0.0
    return torch.where(finished_BK[..., None], filler, logprobs_BKV)


def _best_hypotheses(
    tokens: torch.Tensor, total_BK: torch.Tensor, lengths_BK: torch.Tensor, length_penalty: float
) -> Decoded:
    """The best of each sample's beams by length-penalised score; ``tokens`` (B * num_beams, t) with the start token."""
    batch_size, beams = total_BK.shape
    final_BK = total_BK / lengths_BK.clamp(min=1).float() ** length_penalty
    best_B = final_BK.argmax(dim=-1)
    rows = torch.arange(batch_size, device=tokens.device) * beams + best_B
    return Decoded(
        tokens[rows, 1:], final_BK.gather(1, best_B[:, None])[:, 0], lengths_BK.gather(1, best_B[:, None])[:, 0]
    )
