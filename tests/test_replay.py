"""The replay (``benchmarks.replay``): its simulated clock, its loop over one clock for
a batch, its proposers and oracles, and its command line (no vLLM engine)."""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import pytest

from benchmarks import methods
from benchmarks.replay.loop import StepCost


def test_the_replay_clock_prices_requests_and_draft_tokens_apart():
    split = StepCost.parse("16,1.07,0.8")
    assert split(64 + 10, 64) == pytest.approx(0.016 + 0.00107 * 64 + 0.0008 * 10)
    assert "0.8 ms/draft token" in split.label
    assert StepCost.parse("30,1.1")(10) == pytest.approx(0.041)
    same = StepCost.parse("16,1.07")
    assert same(74, 64) == same(74) == pytest.approx(0.016 + 0.00107 * 74)
    assert same.label == "16 ms + 1.07 ms/token (15 free tokens)"
    verified = StepCost.parse("40,1.7,1.7,3")
    assert verified(16, 16) == pytest.approx(0.040 + 0.0017 * 16)
    assert verified(18, 16) == pytest.approx(0.040 + 0.0017 * 18 + 0.003)
    assert "+ 3 ms with drafts" in verified.label


@pytest.mark.parametrize("bad", ["30", "a,b", "30,0", "-1,2", "16,1,1,-1", "16,1,1,1,1",
                                 "16,1,0", "nan,1", "16,inf"])
def test_replay_step_cost_option_names_its_format(bad):
    with pytest.raises(argparse.ArgumentTypeError, match="--step-cost"):
        StepCost.parse(bad)


@pytest.mark.parametrize("bad", ["0", "a", "1,,2"])
def test_the_replay_names_its_bad_batch_size(bad, monkeypatch, capsys):
    from benchmarks.replay import cli

    monkeypatch.setattr("sys.argv", ["replay", "run", "trace.json", "--batch-size", bad])
    with pytest.raises(SystemExit):
        cli.main()
    assert "--batch-size" in capsys.readouterr().err


@pytest.mark.parametrize("second_dataset, second_helped", [("b", False), ("a", True)])
def test_replay_gives_each_dataset_a_fresh_proposer(second_dataset, second_helped):
    from benchmarks.replay.loop import Request, replay
    from benchmarks.replay.replayers import LookaheadReplayer

    answer = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51]
    trace = [Request("a", "c", [1, 2, 3], answer), Request(second_dataset, "c", [1, 2, 3], answer)]
    # linear: a tree's Jacobi window would draft its guesses with nothing to copy
    results = replay(lambda: LookaheadReplayer({"method": "lookahead", "trees": "off"}), trace)
    (tokens, passes, _, _), (tokens_2, passes_2, drafted_2, _) = results
    assert tokens == tokens_2 == len(answer) and passes == len(answer)  # nothing to copy
    # within one dataset the first answer is in the corpus and the second one copies it
    assert (passes_2 < passes) == second_helped and (drafted_2 > 0) == second_helped


def test_replay_oracle_cut_keeps_s_and_verifies_only_accepted_tokens():
    from benchmarks.replay.loop import Request, StepCost, replay
    from benchmarks.replay.replayers import Replayer

    class HalfRight(Replayer):
        """Drafts the next two answer tokens, then two wrong ones."""

        def __init__(self, answer):
            super().__init__({"num_speculative_tokens": 4})
            self.answer = answer

        def propose_row(self, row, sampled):
            done = int(self.num_tokens[row]) - 1  # one prompt token
            return self.answer[done : done + 2] + [0, 0]

    answer = list(range(10, 29))  # the prefill's token, then 6 passes of 3 tokens
    trace = [Request("a", "c", [1], answer)]
    cost = StepCost(0.010, 0.001)
    (tokens, passes, drafted, seconds), = replay(lambda: HalfRight(answer), trace, cost)
    (tokens_2, passes_2, drafted_2, seconds_2), = replay(lambda: HalfRight(answer), trace,
                                                        cost, oracle_cut=True)
    assert (tokens_2, passes_2) == (tokens, passes)  # the same accepted tokens
    accepted = tokens - passes  # every pass yields one token more than it accepts
    assert drafted == 4 * (passes - 1) and drafted_2 == accepted
    assert seconds_2 == pytest.approx(seconds - 0.001 * (drafted - drafted_2))


def test_copy_oracle_copies_the_best_continuation_of_the_longest_match():
    from benchmarks.replay.replayers import best_copy

    text = np.array([7, 1, 2, 3, 8, 1, 2, 4, 7, 1], dtype=np.int32)
    # "7 1" repeats once (a continuation right for one token); "1" alone also repeats
    # after 8, right for two: the longest match decides, then the continuation
    assert best_copy(text, len(text), text[-2:], np.array([2, 4], np.int32)) == (2, 2, 1)
    assert best_copy(text, len(text), text[-1:], np.array([2, 4], np.int32)) == (1, 6, 2)
    # no continuation right: nothing to copy; a continuation stops at the text's end
    assert best_copy(text, len(text), text[-2:], np.array([5], np.int32))[2] == 0
    assert best_copy(text, 4, np.array([1], np.int32), np.array([2, 3, 8], np.int32)) == (
        1, 2, 2)


def test_replay_copy_oracle_copies_earlier_outputs_of_its_dataset():
    from benchmarks.replay.loop import Request, replay
    from benchmarks.replay.replayers import REPLAY_ONLY_METHODS, CopyOracleReplayer

    answer = list(range(10, 40))  # no token repeats: the first answer copies nothing
    trace = [Request("a", "c", [1, 2], answer), Request("a", "c", [1, 2], answer)]
    spec = REPLAY_ONLY_METHODS["copy-oracle"].config
    first, second = replay(lambda: CopyOracleReplayer(spec), trace)
    assert first == (30, 30, 0, 0.0)
    # the prefill's token, then 24 copied tokens and one, then the last 4 copied
    assert second == (30, 3, 28, 0.0)


def test_replay_copy_oracle_copies_only_after_its_min_match():
    from benchmarks.replay.loop import Request, replay
    from benchmarks.replay.replayers import CopyOracleReplayer

    # after "9 5" only "5" repeats (the prompt's first token): the oracle copies "6 7 8"
    # there; with min_match 2 it waits for "5 6", then copies "7 8"
    trace = [Request("a", "c", [5, 6, 7, 8], [9, 5, 6, 7, 8, 4])]
    spec = {"method": "copy-oracle", "num_speculative_tokens": 24}
    assert replay(lambda: CopyOracleReplayer(spec), trace) == [(6, 3, 3, 0.0)]
    spec["min_match"] = 2
    assert replay(lambda: CopyOracleReplayer(spec), trace) == [(6, 4, 2, 0.0)]


def test_replay_run_writes_its_table_into_a_run_folder(tmp_path, monkeypatch, capsys):
    import datetime

    from benchmarks import machine
    from benchmarks.replay import cli
    from benchmarks.replay.replayers import Replayer

    class NoDrafts(Replayer):
        def propose_row(self, row, sampled):
            return []

    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps([{"dataset": "a", "category": "c", "prompt": [1, 2],
                                  "output": [3, 4, 5]}]))
    monkeypatch.setitem(cli.REPLAYERS, "ngram", NoDrafts)
    monkeypatch.setattr(machine, "git_state", lambda: {"commit": "abc", "dirty": False})
    argv = ["run", str(trace), "--methods", "ngram", "--output-dir", str(tmp_path / "out"),
            "--name", "m-replay"]
    monkeypatch.setattr(sys, "argv", ["replay.py", *argv])
    cli.main()
    folder = tmp_path / "out" / f"{datetime.date.today().isoformat()}-m-replay"
    assert sorted(p.name for p in folder.iterdir()) == ["command.txt", "results.md"]
    command = (folder / "command.txt").read_text()
    assert command.endswith(" -m benchmarks.replay " + " ".join(argv) + "\n")
    text = (folder / "results.md").read_text()
    assert f"* Command: `{command.strip()}`" in text and "* Repository: commit abc" in text
    assert "| all | 1.000 (0.0) |" in text  # 3 tokens in 3 passes, nothing drafted
    assert f"results: {folder}/" in capsys.readouterr().out



def test_replay_batches_requests_on_one_clock():
    from benchmarks.replay.loop import Request, StepCost, replay
    from benchmarks.replay.replayers import NoDraftReplayer

    trace = [Request("a", "c", [i + 1], [7, 8, 9]) for i in range(3)]
    cost = StepCost(0.010, 0.001)
    results = replay(lambda: NoDraftReplayer(None, batch_size=2), trace, cost)
    # requests 0 and 1 share two passes of 2 tokens; request 2 then has two of its own
    assert [r[:3] for r in results] == [(3, 3, 0)] * 3
    assert [r[3] for r in results] == pytest.approx([0.012, 0.012, 0.022])


def test_replay_starts_a_conversations_next_turn_once_its_last_one_finished():
    from benchmarks.replay.loop import Request, replay
    from benchmarks.replay.replayers import NoDraftReplayer

    events = []

    class Recording(NoDraftReplayer):
        def start(self, row, request_id, prompt, output):
            events.append(("start", request_id))
            super().start(row, request_id, prompt, output)

        def finish(self, row):
            events.append(("finish", self.req_ids[row]))
            super().finish(row)

    first_turn = Request("a", "c", [1, 2], [5, 6, 7, 8])
    second_turn = Request("a", "c", [1, 2, 5, 6, 7, 8, 9], [3, 4])  # repeats the first
    other = Request("a", "c", [7], [1, 2])
    replay(lambda: Recording(None, batch_size=2), [first_turn, second_turn, other])
    # the second turn waits for the first although a row is free before it ends
    assert events.index(("start", "replay-2")) < events.index(("finish", "replay-0")) \
        < events.index(("start", "replay-1"))


@pytest.mark.parametrize("trees, measured", [("auto", True), ("off", False)])
def test_replay_tells_lookahead_the_step_cost_where_the_engine_measures_it(trees, measured):
    from benchmarks.replay.loop import SimulatedClock, StepCost
    from benchmarks.replay.replayers import LookaheadReplayer

    replayer = LookaheadReplayer({"method": "lookahead", "trees": trees}, batch_size=4)
    replayer.use_clock(SimulatedClock(), StepCost(0.060, 0.0032))
    # the worker measures the step at start-up for trees auto only
    assert replayer.proposer.cost_model.has_estimate == measured
    if measured:
        assert replayer.proposer.cost_model.free_tokens() == pytest.approx(60 / 3.2)


def test_replay_table_compares_each_method_with_no_speculation_at_its_batch_size():
    from benchmarks.replay.cli import replay_table
    from benchmarks.replay.loop import Request, StepCost

    trace = [Request("a", "c", [1, 2, 3, 1, 2], [3, 1, 2, 3, 1, 2, 3])]
    specs = {"none": None, "ngram": methods.DEFAULT_METHODS["ngram"].config}
    table = replay_table(trace, specs, StepCost(0.010, 0.001), 2, oracle_cut=True)
    assert table[0].endswith(", batch 2 | none | ngram | ngram (oracle cut) |")
    cells = dict(zip(["key", "none", "ngram", "cut"], table[2].strip("| ").split(" | ")))
    assert cells["none"] == "1.000 (0.0) 90.9/s 1.00x"  # a token each 11 ms pass
    speedup = float(cells["cut"].rsplit(" ", 1)[1].rstrip("x"))
    assert speedup > 1 and cells["cut"].startswith(cells["ngram"].split(" (")[0])
