"""The study's report: one figure per claim (PNG), ``report.json`` (every claim with its numbers) and ``report.md``
(claim, paper, measurement, verdict, figure)."""

from __future__ import annotations

from pathlib import Path

from mmoe.atomic import write_text_atomic
from mmoe.io import write_json
from mmoe.study.claims import TASK_SCORES, Claim
from mmoe.study.decisions import decision_text, short_verdict
from mmoe.study.report_figures import draw_figures
from mmoe.study.report_runs import activation_rows, activation_verdict, rerun_lines, reruns_section
from mmoe.study.routers import router_table

#: The report's files in the study's folder.
REPORT_FILE, REPORT_MARKDOWN = "report.json", "report.md"
ROUTERS_HEADING = "## Routers beyond top-1 token choice (measured, not a claim)"
RULE_CHANGES_HEADING = "## Rules changed after results were seen"
ROUTERS_TEXT = (
    "Each router's tiny pre-training part with its own plan (Switch top-1 over 8 experts the baseline), pre-trained "
    "as many steps as the activation-ratio runs, "
    "measured on the same held-out pairs; per modality the mean over its MoE layers (the load CV also at its worst "
    "layer, the busiest expert's load over the mean load at the layer where it is largest). No paper states these "
    "numbers at this scale: no verdict. Activated per token divides by every real token, those no expert took "
    "(expert choice) included."
)


def markdown(
    claims: list[Claim],
    figures: dict[str, Path],
    header: str,
    root: Path,
    chance: dict[str, float],
    settings: dict[str, str],
    routers: list[dict] | None = None,
    decisions: list[dict] | None = None,
    rule_changes: list[dict] | None = None,
    reruns: dict | None = None,
) -> str:
    """The report as Markdown; figure links relative to ``root`` (where report.md lies); ``settings``: claim id ->
    mmoe's setting, put beside the paper's; ``routers``: the rows of the router table after the claims
    (:func:`mmoe.study.routers.router_rows`); ``decisions``: each claim decided over runs
    (:func:`mmoe.study.decisions.run_decisions`); ``rule_changes``: each changed rule with the verdicts under the old
    and the new rule; ``reruns``: the runs made under the same plan (:func:`mmoe.study.reruns.reruns_report`), shown
    side by side with the rerun rule's reading where they differ."""
    decided = {decision["id"]: decision for decision in decisions or []}
    numbers = claim_numbers(claims)
    lines = [header, "", *_summary(claims, numbers, decided, reruns)]
    if rule_changes:
        lines += ["", RULE_CHANGES_HEADING, "", *_rule_change_lines(rule_changes)]
    if reruns:
        lines += ["", *reruns_section(reruns, numbers)]
    for claim in claims:
        number = numbers[claim.id]
        lines += ["", f"## {number}. {claim.title}", "", f"**Paper.** {claim.paper}.", ""]
        if claim.id in settings:
            lines += [f"**mmoe's setting.** {settings[claim.id]}.", ""]
        lines += [f"**mmoe, within one run.** {claim.summary}. **Within-run verdict: {claim.verdict}.**", ""]
        if claim.id in decided:
            lines += [*_decided_lines(number, decided[claim.id], reruns), *rerun_lines(claim.id, reruns)]
        if claim.id == "tasks":
            lines += _score_table(claim.measured["scores"], chance)
        if claim.id in figures:
            lines += [f"![{claim.title}]({figures[claim.id].relative_to(root)})"]
    if routers:
        lines += ["", ROUTERS_HEADING, "", ROUTERS_TEXT, "", *router_table(routers)]
    return "\n".join(lines) + "\n"


def _summary(claims: list[Claim], numbers: dict[str, str], decided: dict, reruns: dict | None) -> list[str]:
    """The summary table: one row per claim (claim 1 as 1a and 1b), the decision over runs of this run, or the
    rerun rule's reading where the runs under the plan differ."""
    lines = [
        "| # | claim | paper | mmoe (within one run) | within-run verdict | decided over runs |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for claim in claims:
        number = numbers[claim.id]
        if claim.id == "activation":
            lines += activation_rows(number, claim, decided.get(claim.id))
            continue
        over_runs = short_verdict(decided[claim.id]) if claim.id in decided else "not computed"
        runs = (reruns or {}).get("claims", {}).get(claim.id)
        if runs and len(set(runs["runs"])) > 1:
            over_runs = f"{runs['reading']} (this run: {over_runs})"
        lines.append(f"| {number} | {claim.title} | {claim.paper} | {claim.summary} | {claim.verdict} | {over_runs} |")
    return lines


def _decided_lines(number: str, decision: dict, reruns: dict | None) -> list[str]:
    """A claim's decision over runs in its section, claim 1's verdict read as 1a and 1b; "of this run" where the runs
    under the plan differ (their reading follows)."""
    runs = (reruns or {}).get("claims", {}).get(decision["id"])
    this_run = " of this run" if runs and len(set(runs["runs"])) > 1 else ""
    verdict = f"**Verdict{this_run}: {decision['verdict']}.**"
    verdict = activation_verdict(number, decision) if decision.get("parts") else verdict
    return [f"**Decided over runs.** {decision_text(decision)}. {verdict}", ""]


def claim_numbers(claims: list[Claim]) -> dict[str, str]:
    """Each claim's number in the report: the claims in order from 1, claim 5's second fine-tuning rule as 5b beside
    5a (so the later claims keep their numbers)."""
    numbers, number = {}, 0
    for claim in claims:
        if claim.id == "consistency_trained":
            numbers[claim.id] = f"{number}b"
            numbers["consistency"] = f"{number}a"
            continue
        number += 1
        numbers[claim.id] = str(number)
    return numbers


def _rule_change_lines(rule_changes: list[dict]) -> list[str]:
    lines = [
        "| claim | rule | old | new | why (date) | verdicts under the old rule | under the new rule |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for change in rule_changes:
        old, new = change["old_verdicts"], change["new_verdicts"]
        lines.append(
            f"| {change['claim']} | {change['rule']} | {change['old']} | {change['new']} | {change['why']} "
            f"({change['date']}) | within run: {old['within_run']}; over runs: {old['over_runs']} | within "
            f"run: {new['within_run']}; over runs: {new['over_runs']} |"
        )
    return lines


def _score_table(scores: dict, chance: dict[str, float]) -> list[str]:
    head = "| variant | " + " | ".join(label for _, _, label in TASK_SCORES) + " |"
    lines = [head, "| --- |" + " --- |" * len(TASK_SCORES)]
    for variant, cells in scores.items():
        values = []
        for task, _, _ in TASK_SCORES:
            cell = cells[task]
            seeds = len(cell["values"])
            text = f"{cell['mean']:.3f}"
            values.append(f"{text} ± {cell['std']:.3f} ({seeds} seeds)" if seeds > 1 else text)
        lines.append(f"| {variant} | " + " | ".join(values) + " |")
    levels = [f"{chance[task]:.3f}" if task in chance else "" for task, _, _ in TASK_SCORES]
    lines.append(
        "| chance level (VQA prior per question type, constant NLVR2 answer, constant caption) | "
        + " | ".join(levels)
        + " |"
    )
    return [*lines, ""]


def write_report(
    claims: list[Claim],
    out: Path,
    header: str,
    extra: dict,
    chance: dict[str, float],
    settings: dict[str, str] | None = None,
    routers: list[dict] | None = None,
    decisions: list[dict] | None = None,
    rule_changes: list[dict] | None = None,
    reruns: dict | None = None,
    markdown_path: Path | None = None,
) -> dict:
    """``out/report.json``, ``out/report.md`` and ``out/figures/*.png``; ``chance``: task -> its chance level (drawn
    with the scores); ``settings``: claim id -> mmoe's setting in one line; ``routers``: the router table's rows;
    ``decisions``: each claim decided over runs; ``rule_changes``: the plan's changed rules with the verdicts under
    the old and the new rule; ``reruns``: the runs under the same plan (kept as ``reruns``); ``markdown_path``: where
    the Markdown goes (``out/report.md`` by default), its figure links relative to its folder. Returns the JSON
    object."""
    figures = draw_figures(claims, out / "figures", chance)
    claims_json = [claim.to_json() for claim in claims]
    settings = settings or {}
    report = (
        extra
        | {
            "claim_settings": settings,
            "claims": claims_json,
            "decisions": decisions or [],
            "rule_changes": rule_changes or [],
            "chance": chance,
            "figures": {key: str(path) for key, path in figures.items()},
            "routers": routers or [],
        }
        | ({"reruns": reruns} if reruns else {})
    )
    write_json(out / REPORT_FILE, report)
    markdown_path = markdown_path or out / REPORT_MARKDOWN
    text = markdown(
        claims, figures, header, markdown_path.parent, chance, settings, routers, decisions, rule_changes, reruns
    )
    write_text_atomic(markdown_path, text)
    return report
