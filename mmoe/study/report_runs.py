"""The report's Markdown beyond one claim per row: claim 1 read as its two statements (1a, 1b), and the runs made
under the same plan side by side with the plan's rerun rule (:mod:`mmoe.study.reruns`)."""

from __future__ import annotations

from mmoe.study.claims import Claim
from mmoe.study.claims.mhmoe_routing import ACTIVATION_PARTS
from mmoe.study.decisions import short_verdict

RERUNS_HEADING = "## Runs under the same plan"
#: Claim 1b's within-run cell: routing seed 0's interval is of the most heads against X-MoE (1a's) only.
NO_WITHIN_RUN = "no within-run interval of this gap (one run's shares per h: row 1a)"


def _parts_text(part: dict) -> str:
    return "; ".join(f"{name}: {verdict}" for name, verdict in part["modalities"].items())


def activation_rows(number: str, claim: Claim, decision: dict | None) -> list[str]:
    """Claim 1's rows of the summary table: 1a (MH-MoE against X-MoE) with the within-run interval, 1b (the rise
    with h), each with its gap's verdict over runs per modality (the paper's first)."""
    parts = (decision or {}).get("parts")
    if not parts:  # not decided over runs (one run per arm), or not computed
        over_runs = short_verdict(decision) if decision else "not computed"
        return [f"| {number} | {claim.title} | {claim.paper} | {claim.summary} | {claim.verdict} | {over_runs} |"]
    within = [(claim.summary, claim.verdict), (NO_WITHIN_RUN, "—")]
    return [
        f"| {number}{letter} | {statement.title} | {statement.paper} | {summary} | {verdict} | {_parts_text(part)} |"
        for letter, statement, part, (summary, verdict) in zip("ab", ACTIVATION_PARTS, parts, within, strict=True)
    ]


def activation_verdict(number: str, decision: dict) -> str:
    """Claim 1's verdict line: each statement's verdicts per modality, then the plan's order verdict (both gaps)."""
    parts = "; ".join(
        f"{number}{letter} ({part['title']}): {_parts_text(part)}"
        for letter, part in zip("ab", decision.get("parts", []), strict=False)
    )
    return f"**Verdict: {parts}** (the plan's order verdict over both gaps: {decision['verdict']})."


def reruns_section(reruns: dict, numbers: dict[str, str]) -> list[str]:
    """The runs made under the plan, side by side per claim with the rule's reading over them, and the rule."""
    runs = reruns["runs"]
    rule = reruns["rule"]
    head = ["#", "claim", *(f"run {run['label']} ({run['date']})" for run in runs), "read over the runs by the rule"]
    lines = [
        RERUNS_HEADING,
        "",
        f"{len(runs)} default runs were made under this plan, the last being this report's ("
        + "; ".join(f"{run['label']}: {run['note']}" for run in runs)
        + "). Each is decided here by the same code from its own `measures.json`. The rule for reruns "
        f"under the same plan (`reruns.json`, written {rule['written']}, after these runs and before any later one; "
        f"SHA-256 of its text `{rule['sha256']}`): {rule['text']}",
        "",
        "| " + " | ".join(head) + " |",
        "|" + " --- |" * len(head),
    ]
    for claim_id, entry in reruns["claims"].items():
        cells = [numbers.get(claim_id, claim_id), claim_id, *entry["runs"], entry["reading"]]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def rerun_lines(claim_id: str, reruns: dict | None) -> list[str]:
    """A claim's section's lines on the runs under the plan: the rule's reading over them where the runs differ,
    and for claim 7 each run's scores per backbone side by side."""
    if reruns is None or claim_id not in reruns["claims"]:
        return []
    entry = reruns["claims"][claim_id]
    if len(set(entry["runs"])) == 1:
        return []
    lines = [f"**Over the {len(reruns['runs'])} runs under the plan (the rerun rule): {entry['reading']}.**", ""]
    if claim_id == "pretraining":
        lines += ["| run | task | pre-trained (per backbone) | random init (per backbone) | decided over runs |"]
        lines += ["| --- | --- | --- | --- | --- |"]
        for run, cell in zip(reruns["pretraining_scores"], entry["runs"], strict=True):
            for task, arms in run["tasks"].items():
                scores = [" / ".join(f"{value:.1f}" for value in arms[arm]) for arm in ("pretrained", "random_init")]
                lines.append(f"| {run['label']} | {task} | {scores[0]} | {scores[1]} | {cell} |")
        lines.append("")
    return lines
