"""The bake-off's report, generated from the files its runs wrote (``results/<router>-seed<s>.json``) and its plan:
``report.json`` (every value, test and decision) and ``report.md`` (the plan's hash, the routers' active FLOPs per
token, per measure each seed's value, the mean with its interval, Welch's test against the baseline and Holm's
decision). ``docs/routers_bakeoff.md`` is the report of the full CPU run under the committed plan."""

from __future__ import annotations

from mmoe.atomic import write_text_atomic
from mmoe.io import read_json, write_json
from mmoe.study.bakeoff_plan import BakeoffPlan
from mmoe.study.bakeoff_runs import BakeoffRun
from mmoe.study.bakeoff_statistics import bakeoff_decisions, seed_values, summary
from mmoe.study.provenance import decision_code, decision_code_text


def read_results(run: BakeoffRun, plan: BakeoffPlan) -> list[dict]:
    """Every (router, seed) results file of the plan, in the plan's order."""
    return [
        read_json(run.results(router.name, seed), "bake-off results") for router in plan.routers for seed in plan.seeds
    ]


def report_of(plan: BakeoffPlan, digest: str, results: list[dict], command: str) -> dict:
    """The report's JSON: the plan and its hash, each router's per-measure summary, the decisions."""
    level = plan.test.level
    routers = {
        router.name: {
            "active_flops_per_token": router.active_flops_per_token,
            "flops_gap": router.flops_gap,
            "measures": {
                measure.name: {"values": seed_values(results, router.name, measure.name)}
                | (summary(seed_values(results, router.name, measure.name), level) or {})
                for measure in plan.measures
            },
        }
        for router in plan.routers
    }
    return {
        "command": command,
        "plan": {"sha256": digest} | plan.to_json(),
        "decision_code": decision_code(),
        "routers": routers,
        "decisions": bakeoff_decisions(plan, results),
    }


def _number(value: float | None) -> str:
    return "—" if value is None else f"{value:.4g}"


def _interval(interval: list[float] | None) -> str:
    return "—" if interval is None else f"[{interval[0]:.4g}, {interval[1]:.4g}]"


def _header(report: dict) -> list[str]:
    plan = report["plan"]
    test = plan["test"]
    training = plan["training"]
    return [
        "# Routers at equal active compute: the bake-off",
        "",
        f"Made by `{report['command']}` under plan `{plan['sha256']}` (SHA-256 of the plan's canonical JSON, fixed "
        f"before the runs; preset `{plan['preset']}`), {decision_code_text(report['decision_code'])}. Every router is "
        f"pre-trained {training['pretrain_steps']} steps on the same data under seeds {plan['seeds']} (the unit: one "
        f"pre-training), then fine-tuned {training['finetune_steps']['vqav2']} VQA steps at the same seed. Each "
        f"measure's routers are tested against `{test['against']}` by Welch's t ({test['level']:.0%} intervals), "
        f"the p-values Holm-adjusted over the routers, decided at alpha {test['alpha']}. Generated from "
        "`results/*.json` by `mmoe.study.bakeoff_report`.",
        "",
    ]


def _routers_table(report: dict) -> list[str]:
    lines = [
        "| router | active MFLOPs per token | gap to dense (share of the dense FFNs) | experts per vision token | "
        "experts per language token |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, router in report["routers"].items():
        experts = [_number(router["measures"].get(f"experts_{m}", {}).get("mean")) for m in ("vision", "language")]
        lines.append(
            f"| {name} | {router['active_flops_per_token'] / 1e6:.3f} | {router['flops_gap']:+.2%} | "
            + " | ".join(experts)
            + " |"
        )
    return lines


def _measure_table(report: dict, measure: dict) -> list[str]:
    lines = [
        f"### {measure['what']} (`{measure['name']}`, {measure['unit']}, {measure['better']} is better)",
        "",
        "| router | per seed | mean [interval] | minus baseline [interval] | Welch p | Holm p | decision |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    rows = {row["router"]: row for row in report["decisions"] if row["measure"] == measure["name"]}
    for name, router in report["routers"].items():
        cell = router["measures"][measure["name"]]
        seeds = ", ".join(_number(value) for value in cell["values"]) if cell["values"] else "—"
        mean = f"{_number(cell.get('mean'))} {_interval(cell.get('interval'))}" if cell["values"] else "—"
        row = rows.get(name)
        welch = (row or {}).get("welch")
        gap = "baseline" if name == report["plan"]["test"]["against"] and measure["tested"] else "—"
        if welch is not None:
            gap = f"{welch['difference']:+.4g} {_interval(welch['interval'])}"
        p = "—" if welch is None else f"{welch['p_value']:.3g}"
        holm = "—" if row is None or row["holm_p"] is None else f"{row['holm_p']:.3g}"
        lines.append(
            f"| {name} | {seeds} | {mean} | {gap} | {p} | {holm} | {'—' if row is None else row['decision']} |"
        )
    return [*lines, ""]


def report_markdown(report: dict) -> str:
    lines = [*_header(report), "## Active compute", "", *_routers_table(report), "", "## Measures", ""]
    for measure in report["plan"]["measures"]:
        lines += _measure_table(report, measure)
    return "\n".join(lines)


def write_report(run: BakeoffRun, plan: BakeoffPlan, digest: str, command: str) -> dict:
    """``report.json`` and ``report.md`` in the run's folder, from its results files."""
    report = report_of(plan, digest, read_results(run, plan), command)
    write_json(run.out / "report.json", report)
    write_text_atomic(run.out / "report.md", report_markdown(report))
    return report
