"""The note a run makes when its task file holds fewer tasks than an iteration asks for
(``RLWorkload.notes``): logged once by the master, shown by `status`."""

from pathlib import Path

from orchestrator.workloads.rl.workload import shortfall

TRAIN, TEST = Path("/data/tasks/train.jsonl"), Path("/data/tasks/test.jsonl")


def test_a_train_file_with_fewer_tasks_than_asked_is_sampled_whole():
    assert shortfall("train", 384, TRAIN, held=200, usable=200) == (
        "rl.train_tasks=384 but /data/tasks/train.jsonl holds 200 tasks: each iteration samples all 200")


def test_an_eval_file_with_fewer_tasks_than_asked_is_used_whole():
    assert shortfall("eval", 200, TEST, held=50, usable=50) == (
        "rl.eval_tasks=200 but /data/tasks/test.jsonl holds 50 tasks: each evaluation uses all 50")


def test_tasks_left_out_for_a_long_prompt_are_named_in_the_count():
    assert shortfall("train", 384, TRAIN, held=400, usable=350) == (
        "rl.train_tasks=384 but /data/tasks/train.jsonl holds 400 tasks, 350 of them with a prompt short enough: "
        "each iteration samples all 350")


def test_enough_tasks_make_no_note():
    assert shortfall("train", 200, TRAIN, held=200, usable=200) is None
    assert shortfall("eval", 8, TEST, held=500, usable=499) is None
