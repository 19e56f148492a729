"""Greedy and beam-search decoding: beam 1 equals greedy, beam search finds the best-scoring sequence of a hand-made
scorer (checked against exhaustive search), and the length constraints hold."""

from __future__ import annotations

import itertools

import pytest
import torch

from mmoe.model.decoding import beam_search, greedy_search

BOS, EOS, PAD, A, B, C = 0, 1, 2, 3, 4, 5
VOCAB = 6
WORDS = (EOS, A, B, C)


def markov_step(table: torch.Tensor):
    """A scorer whose next-token log-probabilities depend on the last token only: ``table[last]`` (V, V)."""

    def step(tokens: torch.Tensor) -> torch.Tensor:
        return table[tokens[:, -1]]

    return step


def random_table(seed: int) -> torch.Tensor:
    logits = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2
    logits[:, [BOS, PAD]] = -torch.inf
    return torch.log_softmax(logits, dim=-1)


def exhaustive_best(table: torch.Tensor, max_length: int, min_length: int, alpha: float) -> tuple[list[int], float]:
    """Best sequence under ``sum log p / length ** alpha`` over every sequence that ends with EOS (after at least
    ``min_length`` tokens) or is cut at ``max_length``."""
    best, best_score = None, -float("inf")
    for length in range(1, max_length + 1):
        for words in itertools.product((A, B, C), repeat=length):
            for ending in ((EOS,), ()):
                sequence = list(words[: length - len(ending)]) + list(ending)
                if len(sequence) != length or (ending and length <= min_length) or (not ending and length < max_length):
                    continue
                if EOS in sequence[:-1]:
                    continue
                total, last = 0.0, BOS
                for token in sequence:
                    total += float(table[last, token])
                    last = token
                score = total / length**alpha
                if score > best_score:
                    best, best_score = sequence, score
    return best, best_score


def trimmed(tokens: torch.Tensor) -> list[int]:
    out = []
    for token in tokens.tolist():
        out.append(token)
        if token == EOS:
            break
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("alpha", [0.0, 0.6, 1.0])
def test_wide_beam_finds_the_exhaustive_optimum(seed, alpha):
    table = random_table(seed)
    max_length, min_length = 4, 1
    expected, expected_score = exhaustive_best(table, max_length, min_length, alpha)
    # 3 words + EOS over 4 steps: 81 beams keep every hypothesis until the last step, which keeps the best.
    decoded = beam_search(markov_step(table), 1, 81, BOS, EOS, PAD, max_length, min_length, alpha, forbidden=(BOS, PAD))
    assert trimmed(decoded.tokens[0]) == expected
    assert decoded.scores[0].item() == pytest.approx(expected_score, abs=1e-5)
    assert decoded.lengths[0].item() == len(expected)


def test_two_beams_beat_greedy_on_a_garden_path():
    # Greedy takes A (p = 0.6) but every continuation of A is poor; B (0.4) ends with near certainty.
    probs = torch.full((VOCAB, VOCAB), 1e-9)
    probs[BOS, A], probs[BOS, B] = 0.6, 0.4
    probs[A, A], probs[A, B], probs[A, C], probs[A, EOS] = 0.25, 0.25, 0.25, 0.25
    probs[B, EOS] = 0.99
    probs[C, EOS] = probs[C, A] = 0.5
    table = (probs / probs.sum(-1, keepdim=True)).log()
    greedy = greedy_search(markov_step(table), 1, BOS, EOS, PAD, max_length=3, length_penalty=0.0)
    beam = beam_search(markov_step(table), 1, 2, BOS, EOS, PAD, max_length=3, length_penalty=0.0)
    assert trimmed(greedy.tokens[0])[0] == A
    assert trimmed(beam.tokens[0]) == [B, EOS]
    assert beam.scores[0] > greedy.scores[0]


@pytest.mark.parametrize("seed", range(4))
def test_one_beam_equals_greedy_batched(seed):
    tables = torch.stack([random_table(seed * 10 + i) for i in range(5)])

    def step(tokens: torch.Tensor) -> torch.Tensor:  # a different scorer per sample: rows are batch-major
        return tables[torch.arange(len(tokens)), tokens[:, -1]]

    options = dict(bos_id=BOS, eos_id=EOS, pad_id=PAD, max_length=6, min_length=2, length_penalty=0.6)
    greedy = greedy_search(step, 5, forbidden=(BOS, PAD), **options)
    beam = beam_search(step, 5, 1, forbidden=(BOS, PAD), **options)
    torch.testing.assert_close(beam.tokens, greedy.tokens)
    torch.testing.assert_close(beam.scores, greedy.scores)
    torch.testing.assert_close(beam.lengths, greedy.lengths)


def test_length_limits_and_padding_after_the_end():
    table = torch.full((VOCAB, VOCAB), -5.0)
    table[:, EOS] = -0.01  # the scorer wants to stop at once
    for search in (
        lambda **o: greedy_search(markov_step(table), 2, BOS, EOS, PAD, **o),
        lambda **o: beam_search(markov_step(table), 2, 3, BOS, EOS, PAD, **o),
    ):
        decoded = search(max_length=5, min_length=3, forbidden=(BOS, PAD))
        for row in decoded.tokens:
            sequence = trimmed(row)
            assert len(sequence) == 4 and sequence[-1] == EOS  # no EOS among the first 3 tokens
            assert all(token == PAD for token in row.tolist()[4:])
        assert decoded.lengths.tolist() == [4, 4]
        unfinished = search(max_length=2, min_length=3, forbidden=(BOS, PAD))
        assert unfinished.lengths.tolist() == [2, 2] and EOS not in unfinished.tokens.tolist()[0]
