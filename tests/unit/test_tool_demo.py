"""The tool demo (``demo-data --tools``): the calculator environment answers a hermes-format
call, says what is wrong with a malformed expression, grades a boxed answer with the math reward
and ends a turn with neither (a malformed call is neither); its parser evaluates integers with
+ - * and parentheses and nothing else; the chat template renders the calculator's schema and a
call as the model writes it; the task files are the demo format over disjoint pairs; a
warm-start example is the conversation's ids as the rollout makes them, learned on the model's
turns only."""

from __future__ import annotations

import json

import pytest

from orchestrator.agents import tool_parsers
from orchestrator.plugins import environments, rewards
from orchestrator.data.turns import observation_ids
from orchestrator.demo import TOOLS_MAX_TOKENS, calculator, chat_tokenizer, warm_start
from orchestrator.demo import tasks as demo_tasks
from orchestrator.demo.calculator import Calculator, evaluate
from orchestrator.environments import Step

TASK = {"id": "train-000000", "prompt": [{"role": "user", "content": demo_tasks.TOOL_QUESTION.format(a=123, b=45)}], "answer": "5535"}


def call(expression: str, name: str = "calc") -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {{"expression": {json.dumps(expression)}}}}}</tool_call>'


@pytest.fixture(scope="module")
def splits():
    return demo_tasks.make_tool_tasks(0)


@pytest.fixture(scope="module")
def tokenizer(splits):
    conversations = [warm_start.TOOLS.conversation(t) for t in splits["train"][:300]]
    return chat_tokenizer.fast(chat_tokenizer.conversations_corpus(conversations, warm_start.TOOLS.tools), tools=True)


def test_the_calculator_is_an_environment_users_name():
    assert environments.load("orchestrator.demo.calculator:Calculator") is Calculator
    assert Calculator(TASK).reset() == TASK["prompt"]
    assert environments.tools(Calculator(TASK)) == [calculator.CALC_TOOL]


def test_a_call_is_answered_by_the_tool():
    assert demo_tasks.tool_call(TASK) == call("123*45") == '<tool_call>{"name": "calc", "arguments": {"expression": "123*45"}}</tool_call>'
    assert Calculator(TASK).step(call("123*45")) == Step(observation=[{"role": "tool", "content": "5535"}])
    assert Calculator(TASK).step("let me see " + call(" (2+3)*-4 ")).observation == [{"role": "tool", "content": "-20"}]
    assert Calculator(TASK).step(call("1+1") + call("2*3")).observation == [{"role": "tool", "content": "2"}, {"role": "tool", "content": "6"}]


@pytest.mark.parametrize("turn,error", [
    (call("1+1", name="calculator"), "error: no tool named 'calculator'; there is calc"),
    ('<tool_call>{"name": "calc", "arguments": {"expr": "1+1"}}</tool_call>', "error: expression must be a string"),
    ('<tool_call>{"name": "calc", "arguments": {"expression": 7}}</tool_call>', "error: expression must be a string"),
])
def test_a_call_of_something_else_gets_an_error_message(turn, error):
    assert Calculator(TASK).step(turn) == Step(observation=[{"role": "tool", "content": error}])


@pytest.mark.parametrize("expression", ["123*", "12 34", "", "()"])
def test_a_malformed_expression_gets_an_error_message(expression):
    step = Calculator(TASK).step(call(expression))
    assert not step.done and step.reward == 0.0
    [message] = step.observation
    assert message["role"] == "tool" and message["content"].startswith("error: ")


@pytest.mark.parametrize("completion,reward", [("\\boxed{5535}", 1.0), (call("1+1") + " \\boxed{5535}", 1.0), ("\\boxed{5536}", 0.0)])
def test_a_boxed_answer_ends_the_sample_graded_by_the_math_reward(completion, reward):
    assert Calculator(TASK).step(completion) == Step(reward=reward, done=True)
    assert rewards.math(TASK, completion) == reward


def test_a_boxed_expression_scores_nothing_so_the_calculator_is_not_skipped():
    assert Calculator(TASK).step("\\boxed{123*45}") == Step(reward=0.0, done=True)


@pytest.mark.parametrize("completion", ["5535", "", "<calc>123*45</calc>", call("123*45")[:-12], "the answer is 5535",
                                        '<tool_call>{"name": "calc", "arguments": {"expression": "1+1"}</tool_call>',
                                        '<tool_call>{"arguments": {"expression": "1+1"}}</tool_call>'])
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
    assert Calculator(TASK).step(call(expression)).observation[0]["content"].startswith("error: ")


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
            [parsed] = tool_parsers.hermes(demo_tasks.tool_call(task))[1]
            a, b = map(int, json.loads(parsed["function"]["arguments"])["expression"].split("*"))
            assert task["id"] == f"{split}-{i:06d}" and message["role"] == "user"
            assert 100 <= a <= 999 and 10 <= b <= 99 and task["answer"] == str(a * b)
            assert "Use calc" in message["content"] and "\\boxed{}" in message["content"]
            pairs[split].add((a, b))
    assert len(pairs["train"]) == len(splits["train"]) and not pairs["train"] & pairs["test"]


def test_a_warm_start_example_is_the_rollouts_ids_learned_on_the_models_turns(tokenizer):
    examples = warm_start.TOOLS.examples(tokenizer, [TASK])
    [row], [labels] = examples.rows, examples.labels
    tools = [calculator.CALC_TOOL]
    prompt = tokenizer.apply_chat_template(TASK["prompt"], tools=tools, tokenize=True, add_generation_prompt=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    end = tokenizer.eos_token_id
    turn1 = tokenizer(call("123*45"), add_special_tokens=False)["input_ids"] + [end]
    observation = observation_ids(tokenizer, [{"role": "tool", "content": "5535"}], tools)
    turn2 = tokenizer("\\boxed{5535}", add_special_tokens=False)["input_ids"] + [end]
    assert row == prompt + turn1 + observation + turn2
    assert labels == [-100] * len(prompt) + turn1 + [-100] * len(observation) + turn2
    assert tokenizer.decode(prompt).startswith("<|im_start|>system\nTools: calc(expression)<|im_end|>\n<|im_start|>user\n")
    assert tokenizer.decode(observation) == "\n<|im_start|>tool\n5535<|im_end|>\n<|im_start|>assistant\n"
    pieces = [tokenizer.decode([i]) for i in turn1]
    assert pieces[0] == "<tool_call>" and pieces[-2:] == ["</tool_call>", "<|im_end|>"], "the call's tags are tokens of their own"
    assert tokenizer.decode(turn1, skip_special_tokens=True) == call("123*45"), "decoded text keeps them, as the engine's does"
    assert pieces[-9:-3] == list("123*45") and [tokenizer.decode([i]) for i in turn2[-6:-2]] == list("5535"), "digits one per token"


def test_the_template_renders_an_assistants_tool_calls_as_the_model_writes_them(tokenizer):
    """An agent that resends its history in another shape (a new segment) has the model's call
    rendered back in the hermes format: the same text the model sampled."""
    content, calls = tool_parsers.hermes(call("123*45"))
    messages = [*TASK["prompt"], {"role": "assistant", "content": content, "tool_calls": calls}, {"role": "tool", "content": "5535"}]
    text = tokenizer.apply_chat_template(messages, tools=[calculator.CALC_TOOL], tokenize=False)
    assert f"<|im_start|>assistant\n{call('123*45')}<|im_end|>\n<|im_start|>tool\n5535<|im_end|>\n" in text
    assert chat_tokenizer.chatml(TASK["prompt"], True, [calculator.CALC_TOOL]) == tokenizer.apply_chat_template(
        TASK["prompt"], tools=[calculator.CALC_TOOL], tokenize=False, add_generation_prompt=True), "the corpus renders as the template"


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
