"""bench/rollout_throughput.py reads a rollout the way the run wrote it: tokens from every
sample of the shard, the phase's wall time split around the requests' span; the figure of a
mode is the median (or best) round, set against each rollout; "today" sends 16 prompts a
request."""

from __future__ import annotations

import json

import pytest

from bench import rollout_throughput as bench
from orchestrator.protocol.layout import RunLayout


def _write_lines(path, rows) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_read_rollout_counts_every_samples_token_ids_and_places_the_requests_in_phase_1(tmp_path):
    layout = RunLayout(tmp_path / "run")
    events = [{"event": "phase", "rank": 0, "t": 100.0, "mono": 10.0, "iteration": 1, "phase": 0},
              {"event": "phase", "rank": 0, "t": 100.5, "mono": 10.5, "iteration": 1, "phase": 1},
              {"event": "phase", "rank": 0, "t": 104.0, "mono": 14.0, "iteration": 1, "phase": 2}]
    _write_lines(layout.attempt("a000001-abcdef").events(0), events)
    records = [{"task_id": "train-000002", "prompt": "2+2=", "sent_at": 100.75, "seconds": 2.0,
                "samples": [{"token_ids": [1, 2, 3]}, {"token_ids": [4]}]},
               {"task_id": "train-000001", "prompt": "1+1=", "sent_at": 100.5 + 0.5, "seconds": 2.5,
                "samples": [{"token_ids": [5, 6]}, {"token_ids": [7, 8, 9, 10]}]}]
    _write_lines(layout.iteration(1).shard("train", 0), records)

    got = bench.read_rollout(layout.root)

    assert (got["tasks"], got["samples"], got["completion_tokens"]) == (2, 4, 10)
    assert sorted(got["lengths"]) == [1, 2, 3, 4]
    assert got["prompts"] == {"train-000001": "1+1=", "train-000002": "2+2="}
    assert got["before_first_request_s"] == 0.25  # phase 1 began at 100.5, the first request left at 100.75
    assert got["requests_span_s"] == 2.75  # to the last answer at 103.5
    assert got["after_last_answer_s"] == 0.5  # phase 2 began at 104.0


def test_read_rollout_of_an_empty_shard_is_a_bench_error(tmp_path):
    layout = RunLayout(tmp_path / "run")
    _write_lines(layout.iteration(1).shard("train", 0), [])
    with pytest.raises(bench.BenchError, match="holds no records"):
        bench.read_rollout(layout.root)


def test_a_modes_figure_is_its_median_round_or_its_best():
    runs = [{"tokens_per_s": x} for x in (30.0, 10.0, 20.0, 40.0)]
    assert bench.pick(runs, "median")["tokens_per_s"] == 20.0  # the lower middle of an even count
    assert bench.pick(runs[:3], "median")["tokens_per_s"] == 20.0
    assert bench.pick(runs, "best")["tokens_per_s"] == 40.0


def test_the_summary_sets_each_rollout_against_every_mode_that_is_not_a_rollout():
    rounds = {"saturated": [{"tokens_per_s": 1000.0}], "rollout": [{"tokens_per_s": 900.0}],
              "rollout_exact_match": [{"tokens_per_s": 980.0}], "requests": [{"tokens_per_s": 950.0}],
              "today": [{"tokens_per_s": 450.0}], "one": []}
    got = bench.summary(rounds, "median")
    assert got["tokens_per_s"] == {"saturated": 1000.0, "rollout": 900.0, "rollout_exact_match": 980.0, "requests": 950.0,
                                   "today": 450.0}
    assert got["ratios"] == {"rollout/saturated": 0.9, "rollout/requests": 0.947, "rollout/today": 2.0,
                             "rollout_exact_match/saturated": 0.98, "rollout_exact_match/requests": 1.032,
                             "rollout_exact_match/today": 2.178}


def test_todays_requests_carry_16_prompts_in_order_each_with_its_own_seed():
    ids = [f"train-{i:06d}" for i in range(40)]
    requests = bench.plan_requests(ids, [f"{i}+{i}=" for i in range(40)], bench.TODAY_PROMPTS_PER_REQUEST, seed=0)
    assert [r.size for r in requests] == [16, 16, 8]
    assert [t for r in requests for t in r.task_ids] == ids
    assert requests[2].prompts[0] == "32+32="
    assert len({r.seed for r in requests}) == 3
    assert [r.seed for r in bench.plan_requests(ids, ids, 16, seed=0)] == [r.seed for r in requests]

