"""The tool demo (``demo-data --tools``): the calculator environment answers a call, says what
is wrong with a malformed one, grades a boxed answer with the math reward and ends a turn with
neither; its parser evaluates integers with + - * and parentheses and nothing else; the task
files are the demo format over disjoint pairs; a warm-start example is the conversation's ids as
the rollout makes them, learned on the model's turns only."""

from __future__ import annotations

import pytest

from orchestrator.plugins import environments, rewards
from orchestrator.data.turns import observation_ids
from orchestrator.demo import TOOLS_MAX_TOKENS, calculator, chat_tokenizer, warm_start
from orchestrator.demo import tasks as demo_tasks
from orchestrator.demo.calculator import Calculator, evaluate
from orchestrator.environments import Step

TASK = {"id": "train-000000", "prompt": [{"role": "user", "content": demo_tasks.TOOL_QUESTION.format(a=123, b=45)}], "answer": "5535"}


@pytest.fixture(scope="module")
def splits():
    return demo_tasks.make_tool_tasks(0)


@pytest.fixture(scope="module")
def tokenizer(splits):
    return chat_tokenizer.fast(chat_tokenizer.conversations_corpus([warm_start.TOOLS.conversation(t) for t in splits["train"][:300]]))


def test_the_calculator_is_an_environment_users_name():
    assert environments.load("orchestrator.demo.calculator:Calculator") is Calculator
    assert Calculator(TASK).reset() == TASK["prompt"]


def test_a_call_is_answered_by_the_tool():
    assert Calculator(TASK).step("<calc>123*45</calc>") == Step(observation=[{"role": "tool", "content": "5535"}])
    assert Calculator(TASK).step("let me see <calc> (2+3)*-4 </calc>").observation == [{"role": "tool", "content": "-20"}]


@pytest.mark.parametrize("expression", ["123*", "12 34", "", "()"])
def test_a_malformed_expression_gets_an_error_message(expression):
    step = Calculator(TASK).step(f"<calc>{expression}</calc>")
    assert not step.done and step.reward == 0.0
    [message] = step.observation
    assert message["role"] == "tool" and message["content"].startswith("error: ")


@pytest.mark.parametrize("completion,reward", [("\\boxed{5535}", 1.0), ("<calc>1+1</calc> \\boxed{5535}", 1.0), ("\\boxed{5536}", 0.0)])
def test_a_boxed_answer_ends_the_sample_graded_by_the_math_reward(completion, reward):
    assert Calculator(TASK).step(completion) == Step(reward=reward, done=True)
    assert rewards.math(TASK, completion) == reward


def test_a_boxed_expression_scores_nothing_so_the_calculator_is_not_skipped():
    assert Calculator(TASK).step("\\boxed{123*45}") == Step(reward=0.0, done=True)


@pytest.mark.parametrize("completion", ["5535", "", "<calc>123*45", "the answer is 5535"])
def test_neither_a_call_nor_an_answer_ends_the_sample_with_nothing(completion):
    assert Calculator(TASK).step(completion) == Step(reward=0.0, done=True)


@pytest.mark.parametrize("expression,value", [("123*45", 5535), ("1+2*3", 7), ("(1+2)*3", 9), ("-4-(-5)", 1), (" 7 ", 7)])
def test_the_parser_evaluates_integer_arithmetic(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize("expression", ["x", "a*2", "abs(-1)", "__import__('os')", "2**3", "9**9**9**9", "7/2", "7//2", "7%2",
                                        "1.5*2", "0x10", "1_000", "1e9", "[1]", "1,2", "True+1", "1;2",
                                        "(" * 40 + "1" + ")" * 40])
def test_the_parser_refuses_anything_else(expression):
    with pytest.raises(ValueError):
        evaluate(expression)
    assert Calculator(TASK).step(f"<calc>{expression}</calc>").observation[0]["content"].startswith("error: ")


def test_a_long_expression_is_refused_before_it_is_parsed():
    with pytest.raises(ValueError, match="longer than"):
        evaluate("9*" * calculator.MAX_EXPRESSION + "9")


def test_the_task_files_are_products_over_disjoint_pairs(splits, tmp_path):
    assert {split: len(tasks) for split, tasks in splits.items()} == {"test": demo_tasks.TOOL_TEST, "train": demo_tasks.TOOL_TRAIN}
    assert splits == demo_tasks.make_tool_tasks(0), "deterministic for a seed"
    for split, tasks in splits.items():
        demo_tasks.write_tasks(tmp_path / f"{split}.jsonl", tasks)
        assert demo_tasks.read_tasks(tmp_path / f"{split}.jsonl") == tasks
    pairs = {}
    for split, tasks in splits.items():
        pairs[split] = set()
        for i, task in enumerate(tasks):
            [message] = task["prompt"]
            a, b = map(int, demo_tasks.tool_call(task).removeprefix("<calc>").removesuffix("</calc>").split("*"))
            assert task["id"] == f"{split}-{i:06d}" and message["role"] == "user"
            assert 100 <= a <= 999 and 10 <= b <= 99 and task["answer"] == str(a * b)
            assert "<calc></calc>" in message["content"] and "\\boxed{}" in message["content"]
            pairs[split].add((a, b))
    assert len(pairs["train"]) == len(splits["train"]) and not pairs["train"] & pairs["test"]


def test_a_warm_start_example_is_the_rollouts_ids_learned_on_the_models_turns(tokenizer):
    examples = warm_start.TOOLS.examples(tokenizer, [TASK])
    [row], [labels] = examples.rows, examples.labels
    prompt = tokenizer.apply_chat_template(TASK["prompt"], tokenize=True, add_generation_prompt=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    end = tokenizer.eos_token_id
    turn1 = tokenizer("<calc>123*45</calc>", add_special_tokens=False)["input_ids"] + [end]
    observation = observation_ids(tokenizer, [{"role": "tool", "content": "5535"}])
    turn2 = tokenizer("\\boxed{5535}", add_special_tokens=False)["input_ids"] + [end]
    assert row == prompt + turn1 + observation + turn2
    assert labels == [-100] * len(prompt) + turn1 + [-100] * len(observation) + turn2
    assert tokenizer.decode(observation) == "\n<|im_start|>tool\n5535<|im_end|>\n<|im_start|>assistant\n"
    assert [tokenizer.decode([i]) for i in turn1[2:5] + turn2[-6:-2]] == list("123") + list("5535"), "digits one per token"


def test_the_longest_conversation_fits_the_suggested_max_tokens_and_the_models_positions(tokenizer, splits):
    from orchestrator.demo import model as demo_model

    examples = warm_start.TOOLS.examples(tokenizer, splits["train"] + splits["test"])
    prompts = [next(i for i, label in enumerate(labels) if label != -100) for labels in examples.labels]
    after_prompt = max(len(row) - prompt for row, prompt in zip(examples.rows, prompts))
    assert after_prompt + 8 <= TOOLS_MAX_TOKENS
    assert max(map(len, examples.rows)) + 16 <= demo_model.CHAT_MAX_POSITIONS


def test_the_tool_and_chat_demos_are_not_made_together(tmp_path):
    from click.testing import CliRunner

    from orchestrator.cli.demo_data import demo_data

    result = CliRunner().invoke(demo_data, ["--tools", "--chat", f"--data-path={tmp_path}"])
    assert result.exit_code == 2 and "--chat and --tools" in result.output and not list(tmp_path.iterdir())
