"""Summary rows computed from the raw measurements in a results JSON (pure Python).

One row per method, mode, dataset, concurrency and group ("all", plus each
Spec-Bench category in latency mode, where every request is timed alone). Sampled
runs measure each of these once per engine seed; their row holds the means over the
seeds and, in ``spread``, the standard deviations of the headline numbers. The
report regenerates tables and plots from these rows, so they can always be
recomputed from a results file.
"""

from __future__ import annotations

import statistics
from collections import defaultdict

from benchmarks.records import SpecDecodeCounters

BASELINE = "none"
#: Datasets whose categories get rows of their own (Spec-Bench reports per category).
PER_CATEGORY = {"spec_bench"}
#: Numbers whose standard deviation over seeds a row reports.
SPREAD = ("tokens_per_second", "speedup", "compression", "mean_acceptance_length",
          "decode_tokens_per_second")


def summarize(measurements: list[dict]) -> list[dict]:
    baselines = {_key(m): m for m in measurements if m["method"] == BASELINE}
    rows = []
    for m in measurements:
        baseline = baselines.get(_key(m))
        # sampled outputs differ between methods by design: compared only when greedy
        reference = ({(r["id"], r["turn"]): r["output_tokens"] for r in baseline["requests"]}
                     if baseline and not m.get("temperature") else None)
        for group, requests in _groups(m):
            row = _row(m, group, requests)
            row["equality"] = equality(requests, reference) if reference is not None else None
            row["round_speedups"] = round_speedups(m, baseline) if group == "all" else None
            rows.append(row)
    by_key = {_row_key(r): r for r in rows if r["method"] == BASELINE}
    for row in rows:
        base = by_key.get(_row_key(row))
        row["speedup"] = (row["tokens_per_second"] / base["tokens_per_second"]
                          if base and base["tokens_per_second"] else None)
    return _over_seeds(rows)


def round_speedups(m: dict, baseline: dict | None) -> list[float] | None:
    """Where the methods took turns on rounds of conversations (throughput and server
    modes with ``--interleave``): each round's tokens/s over the baseline's on the same
    round (paired: the machine's drift from one round to the next cancels)."""
    rounds, base = m.get("rounds"), (baseline or {}).get("rounds")
    if not rounds or not base or len(rounds) != len(base):
        return None
    return [(r["output_tokens"] / r["wall_seconds"]) / (b["output_tokens"] / b["wall_seconds"])
            for r, b in zip(rounds, base)]


def by_round(ratios: list[float]) -> dict | None:
    """The round speedups' mean, standard deviation and standard error."""
    if len(ratios) < 2:
        return None
    stdev = statistics.stdev(ratios)
    return {"mean": statistics.fmean(ratios), "stdev": stdev,
            "stderr": stdev / len(ratios) ** 0.5, "rounds": len(ratios)}


def _key(m: dict) -> tuple:
    return m["mode"], m["dataset"], m["concurrency"], m.get("seed", 0)


def _row_key(row: dict) -> tuple:
    return row["mode"], row["dataset"], row["concurrency"], row["seed"], row["group"]


#: What a summary row is of, besides its seed: kept as they are where seeds are merged.
SETTING_KEYS = ("method", "mode", "dataset", "concurrency", "group")


def _over_seeds(rows: list[dict]) -> list[dict]:
    """One row per method, mode, dataset, concurrency and group: the mean over its
    seeds (speedups taken against the baseline of the same seed first)."""
    by_setting: dict[tuple, list[dict]] = defaultdict(list)
    for row in rows:
        by_setting[(row["method"], *_row_key(row)[:3], row["group"])].append(row)
    merged = []
    for same in by_setting.values():
        # the setting's keys as they are (a mean would turn concurrency 16 into 16.0)
        row = {key: same[0][key] if key in SETTING_KEYS else _mean([r[key] for r in same])
               for key in same[0]}
        row["seeds"] = [r["seed"] for r in same]
        # every seed's rounds together
        row["round_speedups"] = [x for r in same for x in r["round_speedups"] or []] or None
        row["speedup_by_round"] = by_round(row["round_speedups"] or [])
        row["spread"] = ({key: _stdev([r[key] for r in same]) for key in SPREAD}
                         if len(same) > 1 else None)
        del row["seed"]
        merged.append(row)
    return merged


def _mean(values: list):
    """Numbers: their mean (None if any is missing); lists and dicts of numbers: by
    element; anything else: the first value (the same for every seed)."""
    first = values[0]
    if len(values) == 1 or isinstance(first, (str, bool)):
        return first
    if isinstance(first, (int, float)):
        return None if None in values else statistics.fmean(values)
    if isinstance(first, list) and all(isinstance(v, list) and len(v) == len(first)
                                       for v in values):
        return [_mean(list(column)) for column in zip(*values)]
    if isinstance(first, dict) and all(isinstance(v, dict) and v.keys() == first.keys()
                                       for v in values):
        return {key: _mean([v[key] for v in values]) for key in first}
    return first


def _stdev(values: list) -> float | None:
    return None if None in values else statistics.stdev(values)


def _groups(m: dict) -> list[tuple[str, list[dict]]]:
    groups = [("all", m["requests"])]
    if m["mode"] == "latency" and m["dataset"] in PER_CATEGORY:
        by_category: dict[str, list[dict]] = defaultdict(list)
        for request in m["requests"]:
            by_category[request["category"]].append(request)
        groups += list(by_category.items())
    return groups


def _row(m: dict, group: str, requests: list[dict]) -> dict:
    whole = group == "all"
    tokens = sum(len(r["output_tokens"]) for r in requests)
    passes = sum(r["forward_passes"] for r in requests)
    # Batch 1: the requests' own times; batched: the wall time they shared.
    seconds = sum(r["seconds"] for r in requests) if m["mode"] == "latency" else m["wall_seconds"]
    counters = _counters(m, requests, whole)
    return {
        "method": m["method"], "mode": m["mode"], "dataset": m["dataset"],
        "concurrency": m["concurrency"], "seed": m.get("seed", 0), "group": group,
        "requests": len(requests), "output_tokens": tokens, "forward_passes": passes,
        "seconds": seconds,
        "tokens_per_second": tokens / seconds if seconds else None,
        "compression": tokens / passes if passes else None,
        # tokens/s = S / step time: the step time of a pass, and the graph modes of steps
        "step_ms": seconds / passes * 1e3 if passes else None,
        "steps_by_graph_mode": m.get("steps_by_graph_mode") if whole else None,
        **acceptance(counters),
        **latency_stats(requests),
        **_proposer(m if whole else None),
        "accepted_share_by_source": _accepted_shares(m if whole else None,
                                                     counters.accepted if counters else 0),
    }


def _counters(m: dict, requests: list[dict], whole: bool) -> SpecDecodeCounters | None:
    """Per-request counters where every request has them, else the measurement's own."""
    if requests and all(r.get("spec_decode") for r in requests):
        return sum((SpecDecodeCounters(**r["spec_decode"]) for r in requests),
                   SpecDecodeCounters())
    return SpecDecodeCounters(**m["spec_decode"]) if whole else None


def acceptance(counters: SpecDecodeCounters | None) -> dict:
    """vLLM's definitions: mean acceptance length = 1 + accepted / drafts, per-position
    acceptance = accepted at position i / drafts; only steps that had a draft count."""
    drafts = counters.drafts if counters else None
    if not drafts:
        return {"drafts": drafts, "mean_acceptance_length": None,
                "draft_acceptance_rate": None, "acceptance_per_position": None}
    return {
        "drafts": drafts,
        "mean_acceptance_length": 1 + counters.accepted / drafts,
        "draft_acceptance_rate": counters.accepted / counters.draft_tokens,
        "acceptance_per_position": [a / drafts for a in counters.accepted_per_pos],
    }


def latency_stats(requests: list[dict]) -> dict:
    """TTFT per request; ITL = mean gap between token-carrying steps or chunks; TPOT =
    mean time per output token after the first, and its inverse, the decode's tokens/s
    (pooled over requests: without the prefill, which speculation does not change and
    which, sampled, weighs each method by the lengths of the texts it happened to draw)."""
    ttfts = [r["ttft"] * 1e3 for r in requests if r["output_tokens"]]
    decode = [r for r in requests if r["forward_passes"] > 1]
    decode_seconds = sum(r["decode_seconds"] for r in decode)
    gaps = sum(r["forward_passes"] - 1 for r in decode)
    later_tokens = sum(len(r["output_tokens"]) - 1 for r in decode)
    return {
        "ttft_ms_mean": statistics.fmean(ttfts) if ttfts else None,
        "ttft_ms_p50": statistics.median(ttfts) if ttfts else None,
        "itl_ms": decode_seconds / gaps * 1e3 if gaps else None,
        "tpot_ms": decode_seconds / later_tokens * 1e3 if later_tokens else None,
        "decode_tokens_per_second": later_tokens / decode_seconds if decode_seconds else None,
    }


def _proposer(m: dict | None) -> dict:
    """The drafter's time per engine step and its share of the mean engine step (in
    server mode, where the harness counts no engine steps, of the steps the drafter ran
    in); the draft tokens the cut kept: their acceptance estimated, summed, and matched;
    the steps that verified trees and the tree nodes off the main drafts."""
    stats = (m and m.get("proposer")) or {}
    counted = {field: stats.get(field) for field in
               ("kept_tokens_expected", "kept_tokens_matched", "tree_steps", "tree_nodes")}
    steps = m and (m.get("engine_steps") or stats.get("steps"))
    if not stats.get("steps") or not steps:
        return {"proposer_ms_per_step": None, "mean_step_ms": None, "proposer_share": None,
                **counted}
    per_step = stats["seconds"] / stats["steps"] * 1e3
    mean_step = m["wall_seconds"] / steps * 1e3
    return {"proposer_ms_per_step": per_step, "mean_step_ms": mean_step,
            "proposer_share": per_step / mean_step, **counted}


def _accepted_shares(m: dict | None, accepted: int) -> dict[str, float] | None:
    """Lookahead's accepted draft tokens by source, as shares of vLLM's count of accepted
    draft tokens; what the sources do not add up to is ``uncounted`` (a proposer that
    misreads its verifications shows here; the server's lagging /metrics too)."""
    by_source = ((m and m.get("proposer")) or {}).get("accepted_by_source")
    counted = sum(by_source.values()) if by_source else 0
    if not counted:
        return None
    total = accepted or counted
    shares = {source: count / total for source, count in by_source.items()}
    if counted != total:
        shares["uncounted"] = (total - counted) / total
    return shares


def equality(requests: list[dict], reference: dict[tuple[str, int], list[int]]) -> dict:
    """Greedy outputs identical to the baseline's, per turn.

    A later turn is compared only where every earlier turn of its conversation was
    identical, since otherwise its prompt (which contains those answers) differs.
    """
    identical_so_far: dict[str, bool] = {}
    per_turn: dict[int, dict] = {}
    for request in sorted(requests, key=lambda r: (r["turn"], r["id"])):
        turn, key = request["turn"], (request["id"], request["turn"])
        stats = per_turn.setdefault(turn, {"compared": 0, "identical": 0,
                                           "prompt_differed": 0, "divergences": []})
        if key not in reference:
            continue
        if not identical_so_far.get(request["id"], True):
            stats["prompt_differed"] += 1
            continue
        position = first_divergence(request["output_tokens"], reference[key])
        stats["compared"] += 1
        if position is None:
            stats["identical"] += 1
        else:
            stats["divergences"].append(position)
        identical_so_far[request["id"]] = position is None
    return {str(turn): _divergence_summary(stats) for turn, stats in sorted(per_turn.items())}


def _divergence_summary(stats: dict) -> dict:
    divergences = stats.pop("divergences")
    return {**stats,
            "first_divergence_mean": statistics.fmean(divergences) if divergences else None,
            "first_divergence_min": min(divergences) if divergences else None}


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (the shorter length if one is a prefix), or None."""
    for index, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))
