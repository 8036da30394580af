"""The chat demo's judge (demo/judge.py, ``demo-data --chat --judge``): its examples are labelled
as the chat demo's reward grades the completions, half right and half wrong, the same for a seed;
the question it learns is the one a run asks it, token for token; ``--judge`` comes only with
``--chat``. Training the judge takes most of a minute, so none is trained here (bench/judge.py
makes one and runs RL on its verdicts)."""

import collections

import pytest
from click.testing import CliRunner

from orchestrator import rewards
from orchestrator.cli import cli
from orchestrator.demo import VALIDATION_TASKS, chat_tokenizer
from orchestrator.demo import build as demo_build
from orchestrator.demo import judge
from orchestrator.demo import tasks as demo_tasks
from orchestrator.plugins import judge as judge_words

SPLITS = demo_tasks.make_tasks(0, chat=True)
TASKS = SPLITS["train"][:300]


def test_each_verdict_is_what_the_math_reward_gives_the_completion():
    by_id = {t["id"]: t for t in TASKS}
    made = judge.examples(TASKS, 0)
    assert len(made) == 4 * len(TASKS)
    for e in made:
        task = by_id[e["task"]]
        assert judge_words.score(e["verdict"]) == rewards.math(task, e["completion"]), e
        assert e["prompt"] == [{"role": "user", "content": judge_words.render(judge_words.DEFAULT_TEMPLATE, task, e["completion"])}]


def test_half_right_half_wrong_with_a_hard_negative_for_every_task():
    made = judge.examples(SPLITS["train"], 0)
    verdicts = collections.Counter(e["verdict"] for e in made)
    assert verdicts["yes"] == verdicts["no"] == len(made) // 2
    per_task = collections.defaultdict(list)
    for e in made:
        per_task[e["task"]].append((e["kind"], e["verdict"]))
    for kinds in per_task.values():
        assert kinds[0] == ("boxed", "yes") and kinds[2] == ("one_digit_changed", "no")
        assert sorted(v for _, v in kinds) == ["no", "no", "yes", "yes"]
    kinds = collections.Counter(e["kind"] for e in made)
    assert set(kinds) == {"boxed", "digits", "unclosed", "one_digit_changed", "swapped", "off_by_one", "off_by_ten", "random",
                          "truncated", "plain", "empty"}
    assert kinds["one_digit_changed"] == len(SPLITS["train"])


def test_the_examples_are_the_seeds_and_each_tasks_own():
    assert judge.examples(TASKS, 0) == judge.examples(TASKS, 0)
    assert judge.examples(TASKS, 0) != judge.examples(TASKS, 1)
    assert judge.examples(TASKS[::-1], 0) == [e for t in TASKS[::-1] for e in judge.examples([t], 0)]


def test_the_question_it_learns_is_the_one_a_run_sends_it():
    made = judge.examples(TASKS[:40], 0)
    tokenizer = chat_tokenizer.fast(chat_tokenizer.corpus(made, judge._target))
    for e in made:
        sent = tokenizer.apply_chat_template(e["prompt"], add_generation_prompt=True, tokenize=True)
        sent = sent["input_ids"] if hasattr(sent, "keys") else sent
        assert tokenizer(judge.FORMAT.prompt(e, tokenizer))["input_ids"] == list(sent)
        assert judge.FORMAT.correct(e, e["verdict"]) and not judge.FORMAT.correct(e, e["verdict"] + " ")
    assert [len(tokenizer(v, add_special_tokens=False)["input_ids"]) for v in ("yes", "no")] == [1, 1]


def test_a_judge_made_with_the_same_settings_is_reused(tmp_path):
    band = judge.warm_start.Band(*judge.ACCURACY_BAND)
    entry = {"settings": judge.settings_of(0, band, judge.MAX_STEPS, None), "template": judge.TEMPLATE, "steps": 7}
    (tmp_path / "judge").mkdir()
    (tmp_path / "judge" / "model.safetensors").write_bytes(b"")
    assert judge.build(tmp_path, SPLITS, seed=0, existing=entry) is entry


def test_judge_needs_chat(tmp_path):
    with pytest.raises(ValueError, match="chat"):
        demo_build.build(tmp_path, judge=True)
    result = CliRunner().invoke(cli, ["demo-data", "--data-path", str(tmp_path), "--judge"], prog_name="orchestrator")
    assert result.exit_code == 2 and "--chat" in result.output
    assert not any(tmp_path.iterdir())
