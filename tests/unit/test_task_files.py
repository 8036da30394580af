"""Task files: JSON lines or Parquet, the columns the config names, and bad rows named exactly."""

import json

import pytest

from orchestrator.data import tasks
from orchestrator.errors import ConfigError


def jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_named_columns_row_numbers_and_every_other_column_travel(tmp_path):
    f = jsonl(tmp_path / "gsm.jsonl", [{"question": "2+2?", "answer": "#### 4", "level": 1}, "", {"question": "3+3?", "answer": 6}])
    got = tasks.read(tasks.TaskSource(f, prompt_key="question"))
    assert got == [
        {"id": "1", "prompt": "2+2?", "question": "2+2?", "answer": "#### 4", "level": 1},
        {"id": "3", "prompt": "3+3?", "question": "3+3?", "answer": "6"},  # row = line; a number answer becomes text
    ]


def test_chat_messages_are_prompts_and_render_through_the_template(tmp_path):
    messages = [{"role": "user", "content": "17+25="}]
    f = jsonl(tmp_path / "chat.jsonl", [{"id": "a", "messages": messages, "answer": "42"}])
    [task] = tasks.read(tasks.TaskSource(f, prompt_key="messages"))
    assert task["prompt"] == messages

    class Template:
        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            assert tokenize is False and add_generation_prompt is True
            return "|".join(f"{m['role']}:{m['content']}" for m in messages) + "|assistant:"

    assert tasks.render(task["prompt"], Template()) == "user:17+25=|assistant:"
    assert tasks.render("17+25=", Template(), system_prompt="Add.") == "system:Add.|user:17+25=|assistant:"
    assert tasks.render("17+25=", None) == "17+25="


def test_parquet(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"question": ["1+1=", "2+2="], "answer": ["2", "4"]}), path)
    got = tasks.read(tasks.TaskSource(path, prompt_key="question"))
    assert [(t["id"], t["prompt"], t["answer"]) for t in got] == [("1", "1+1=", "2"), ("2", "2+2=", "4")]


@pytest.mark.parametrize("rows,message", [
    ([{"id": "a", "answer": "1"}], r"t.jsonl, row 1: no column 'prompt' \(data.prompt_key\)"),
    ([{"id": "a", "prompt": "x"}], r"row 1: no column 'answer'"),
    ([{"id": "a", "prompt": 7, "answer": "1"}], r"row 1: column 'prompt' must be a string or a list of chat messages"),
    ([{"id": "a", "prompt": [{"role": "user"}], "answer": "1"}], r"row 1: column 'prompt' must be a string or a list of chat messages"),
    ([{"id": "a", "prompt": "x", "answer": "1"}, {"id": "a", "prompt": "y", "answer": "2"}], r"row 2: duplicate id 'a' in column 'id' \(first in row 1\)"),
    ([{"id": None, "prompt": "x", "answer": "1"}], r"row 1: column 'id' must be a non-empty string or an integer"),
    (['{"id": "a",'], r"row 1: not JSON"),
    (["[1, 2]"], r"row 1: not an object"),
    ([], r"holds no tasks"),
])
def test_bad_rows_name_file_row_and_key(tmp_path, rows, message):
    with pytest.raises(ConfigError, match=message):
        tasks.read(tasks.TaskSource(jsonl(tmp_path / "t.jsonl", rows)))


def test_unreadable_or_missing_files(tmp_path):
    (tmp_path / "t.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(ConfigError, match=r"t.parquet: not a readable Parquet file"):
        tasks.read(tasks.TaskSource(tmp_path / "t.parquet"))
    with pytest.raises(ConfigError, match=r"task file .*none.jsonl does not exist"):
        tasks.read(tasks.TaskSource(tmp_path / "none.jsonl"))


def test_a_file_is_read_once_until_it_changes(tmp_path):
    f = jsonl(tmp_path / "t.jsonl", [{"id": "a", "prompt": "x", "answer": "1"}])
    first = tasks.read(tasks.TaskSource(f))
    assert tasks.read(tasks.TaskSource(f)) is first
    jsonl(f, [{"id": "a", "prompt": "x", "answer": "1"}, {"id": "b", "prompt": "y", "answer": "2"}])
    assert [t["id"] for t in tasks.read(tasks.TaskSource(f))] == ["a", "b"]


# --- prompt lengths ------------------------------------------------------------------------


def test_prompt_lengths_count_what_the_engines_tokenizer_makes_special_tokens_included(tmp_path):
    from transformers import AutoTokenizer

    from orchestrator.data import prompts
    from orchestrator.demo import tokenizer as demo_tokenizer

    demo_tokenizer.save(tmp_path)
    texts = ["1+1=", "17+25=", ""]
    expected = [len(ids) for ids in AutoTokenizer.from_pretrained(tmp_path)(texts)["input_ids"]]
    assert prompts.count_tokens(texts, tmp_path) == expected == [5, 7, 1]


@pytest.mark.parametrize("config, max_tokens, max_prompt_tokens, expected", [
    ({"max_position_embeddings": 64}, 8, 0, 56),  # unset: what the context leaves beside the completion
    ({"n_positions": 32}, 8, 0, 24),
    ({}, 8, 0, None),  # no context length known: no limit
    ({"max_position_embeddings": 64}, 8, 20, 20),
    ({"max_position_embeddings": 64}, 8, 57, "plus rl.max_tokens=8 is more than the model's context length of 64"),
    ({"max_position_embeddings": 8}, 8, 0, "rl.max_tokens=8 leaves no room for a prompt"),
])
def test_the_prompt_limit_defaults_to_the_context_left_beside_the_completion(tmp_path, config, max_tokens, max_prompt_tokens, expected):
    from orchestrator.config import RLConfig, RLPhase, RunConfig
    from orchestrator.data import prompts

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(config))
    run = RunConfig(data_path=tmp_path, log_path=tmp_path / "run", rl_phase=RLPhase.BOTH, rank=0, eval_interval=1,
                    rl=RLConfig(max_tokens=max_tokens, max_prompt_tokens=max_prompt_tokens))
    if isinstance(expected, str):
        with pytest.raises(ConfigError, match=expected):
            prompts.limit(run)
    else:
        assert prompts.limit(run) == expected
