"""What every claim of the study is: :class:`Statement`, a paper's claim as the report words it, and :class:`Claim`,
that statement measured. :func:`modality_claim` builds the claims judged per modality, on the tokens their paper
measured (the plan's :attr:`mmoe.study.plan.ClaimPlan.paper_modality`) with the other modality beside them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mmoe.study.verdicts import MODALITIES, NOT_SEPARATED


@dataclass(frozen=True)
class Claim:
    """One claim of a paper, measured.

    Attributes:
        id: short name (``activation``, ``diversity``, ``collapse``, ``fluctuation``, ``consistency``, ``tasks``).
        title: the claim in one line.
        paper: the paper's figure or table, its setting and its numbers.
        measured: mmoe's numbers (JSON-able): per modality where the claim is about routing, each with its
            difference, interval and verdict.
        verdict: one of :data:`mmoe.study.verdicts.VERDICTS`: the paper's modality's, for routing claims.
        summary: the measurement in one line.
    """

    id: str
    title: str
    paper: str
    measured: dict[str, Any]
    verdict: str
    summary: str

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Statement:
    """A paper's claim as the report words it, before anything is measured: the fields of :class:`Claim` that do not
    depend on the measurements."""

    id: str
    title: str
    paper: str

    def measured(self, measured: dict[str, Any], verdict: str, summary: str) -> Claim:
        """The claim with mmoe's measurement, its verdict and its one-line summary."""
        return Claim(self.id, self.title, self.paper, measured, verdict, summary)


def modality_summary(by_modality: dict, paper_modality: str, text: Callable[[dict], str]) -> str:
    """``language (the paper's): ..., verdict; vision: ..., verdict``: ``text`` of each measured modality with its
    verdict, the paper's first."""
    parts = []
    for name in (paper_modality, *[m for m in MODALITIES if m != paper_modality]):
        if name in by_modality:
            label = f"{name} (the paper's)" if name == paper_modality else name
            parts.append(f"{label}: {text(by_modality[name])}, {by_modality[name]['verdict']}")
    return "; ".join(parts)


def paper_verdict(by_modality: dict, paper_modality: str) -> str:
    """The verdict on the paper's modality; not separated where that modality was not measured."""
    return by_modality[paper_modality]["verdict"] if paper_modality in by_modality else NOT_SEPARATED


def modality_claim(
    statement: Statement, measured: dict[str, Any], text: Callable[[dict], str], note: str = ""
) -> Claim:
    """``statement`` measured per modality: ``measured`` holds ``paper_modality`` and ``by_modality`` (modality ->
    its entry, with a ``verdict``). The claim's verdict is the paper's modality's (:func:`paper_verdict`); its summary
    gives each modality's ``text`` and verdict (:func:`modality_summary`), then ``note``."""
    by_modality, paper_modality = measured["by_modality"], measured["paper_modality"]
    summary = modality_summary(by_modality, paper_modality, text) + note
    return statement.measured(measured, paper_verdict(by_modality, paper_modality), summary)


def empty_claim(claim_id: str) -> Claim:
    """The claim where its runs were not measured (a router or the runs missing)."""
    return Claim(claim_id, claim_id, "", {}, NOT_SEPARATED, "nothing measured")
