"""exactness.json and exactness.md of a ``benchmarks.exactness`` run."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import machine


def where_measured() -> dict:
    """The machine, software and commit, kept with each configuration's results."""
    return {"machine": machine.describe(), "software": machine.software_versions(),
            **machine.git_state()}


def write_report(output_dir: Path, model: str, results: list[dict], failed: list[str]) -> None:
    measured = next((r["measured"] for r in results if "measured" in r), None) or where_measured()
    report = {"model": model, **measured, "configurations": results,
              "configurations_that_did_not_finish": failed}
    (output_dir / "exactness.json").write_text(json.dumps(report, indent=1))
    (output_dir / "exactness.md").write_text(markdown(report))


def markdown(report: dict) -> str:
    lines = [f"# Greedy exactness against no speculation: {Path(report['model']).name}", "",
             "| configuration | backend | graphs | variant | batch | identical | filled steps "
             "| tree steps | steps FULL / PIECEWISE / eager | preemptions | required |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for result in report["configurations"]:
        for run in result["runs"]:
            modes = run["steps_by_graph_mode"]
            lines.append(
                f"| {result['name']} | {result['attention_backend']} | "
                f"{result['cudagraph_mode']} | {run['variant']} | {run['batch']} | "
                f"{run['identical']}/{run['total']} | {run['filled_steps']} | "
                f"{run['tree_steps']} | {modes['FULL']} / {modes['PIECEWISE']} / {modes['NONE']} | "
                f"{run['preemptions']:g} | {verdict(result)} |")
    lines += ["", "Plain decoding's own batch 1 against the whole batch (the reference), and how many "
              "of its positions are near-ties:", "",
              "| configuration | identical | near-tie positions | best logit's change "
              "(max / median) |", "|---|---|---|---|"]
    for result in report["configurations"]:
        same, ties = result["reference_batch_1_vs_all"], result["near_tie_positions"]
        noise = result.get("reference_wobble")
        lines.append(f"| {result['name']} | {same['identical']}/{same['total']} | "
                     f"{ties['near_ties']} of {ties['positions']} | "
                     + (f"{noise['max']:.3g} / {noise['median']:.3g} |" if noise else "- |"))
    lines += ["", "Every first divergence, with the reference's gap between its two best "
              "logits there (near-tie: at most `NEAR_TIE_ULPS` ulps of the dtype; within "
              "noise: at most twice the largest change of plain decoding's best logit "
              "between batch 1 and the whole batch):", "",
              "| configuration | variant | batch | prompt | index | expected | got | "
              "second best | top logit | gap | gap (ulps) | near-tie | within noise |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for result in report["configurations"]:
        runs = [("reference batch 1", {"batch": 1, **result["reference_batch_1_vs_all"]}),
                *((run["variant"], run) for run in result["runs"])]
        for variant, run in runs:
            for d in run["divergences"]:
                if "gap" not in d:  # lengths differ
                    lines.append(f"| {result['name']} | {variant} | {run['batch']} | "
                                 f"{d['prompt']} | {d['index']} | length {d['expected_length']}"
                                 f" | length {d['length']} | | | | | | |")
                    continue
                lines.append(
                    f"| {result['name']} | {variant} | {run['batch']} | {d['prompt']} | "
                    f"{d['index']} | {d['expected']} | {d['got']} | {d['second']} | "
                    f"{d['top_logit']:.4g} | {d['gap']:.4g} | {d['gap_ulps']:.3g} | "
                    f"{'yes' if d['near_tie'] else '**no**'} | "
                    f"{_yes(d.get('within_noise'))} |")
    if report["configurations_that_did_not_finish"]:
        lines += ["", "Did not finish (see their logs): "
                  + ", ".join(report["configurations_that_did_not_finish"])]
    return "\n".join(lines) + "\n"


def _yes(flag: bool | None) -> str:
    return "-" if flag is None else "yes" if flag else "**no**"


def verdict(result: dict) -> str:
    if not result.get("complete", True):
        return "stopped before its last variant"
    wanted = "identical" if result.get("exact", result.get("asserted")) else "rounding only"
    return f"{wanted}: " + ("passed" if result["passed"] else "**FAILED**")
