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


def _verl_rows(n):
    """Rows as verl's GSM8K preprocessing writes them."""
    return [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"{i}+1? Let's think step by step"}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
             "extra_info": {"split": "train", "index": i, "answer": f"{i} plus 1 #### {i + 1}", "question": f"{i}+1?"}}
            for i in range(n)]


def test_dotted_keys_reach_into_the_struct_columns_of_verls_parquet(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(_verl_rows(3)), path)
    got = tasks.read(tasks.TaskSource(path, answer_key="reward_model.ground_truth", id_key="extra_info.index"))
    assert [(t["id"], t["answer"]) for t in got] == [("0", "1"), ("1", "2"), ("2", "3")]
    assert got[1]["prompt"] == [{"role": "user", "content": "1+1? Let's think step by step"}]
    assert got[1]["reward_model"] == {"style": "rule", "ground_truth": "2"} and got[1]["data_source"] == "openai/gsm8k"


def test_dotted_keys_reach_into_json_objects_and_strings_of_json(tmp_path):
    rows = [{"q": "1+1=", "meta": {"gold": {"value": 2}}, "info": json.dumps({"uid": "a"})},
            {"q": "2+2=", "meta": {"gold": {"value": "4"}}, "info": json.dumps({"uid": "b"})}]
    got = tasks.read(tasks.TaskSource(jsonl(tmp_path / "t.jsonl", rows), prompt_key="q", answer_key="meta.gold.value", id_key="info.uid"))
    assert [(t["id"], t["prompt"], t["answer"]) for t in got] == [("a", "1+1=", "2"), ("b", "2+2=", "4")]


def test_a_column_named_with_the_dots_wins_over_reaching_into_one(tmp_path):
    rows = [{"prompt": "x", "reward_model.ground_truth": "literal", "reward_model": {"ground_truth": "nested"},
             "a.b": {"c": "under a dotted column"}}]
    f = jsonl(tmp_path / "t.jsonl", rows)
    assert tasks.read(tasks.TaskSource(f, answer_key="reward_model.ground_truth"))[0]["answer"] == "literal"
    assert tasks.read(tasks.TaskSource(f, answer_key="a.b.c"))[0]["answer"] == "under a dotted column"


def test_a_dotted_id_key_a_row_lacks_numbers_the_rows(tmp_path):
    f = jsonl(tmp_path / "t.jsonl", [{"prompt": "x", "answer": "1", "extra_info": {"split": "train"}}, {"prompt": "y", "answer": "2"}])
    assert [t["id"] for t in tasks.read(tasks.TaskSource(f, id_key="extra_info.index"))] == ["1", "2"]


@pytest.mark.parametrize("row,message", [
    ({"prompt": "x"}, r"t.jsonl, row 1: no column 'reward_model.ground_truth', nor a column 'reward_model' to look into "
                      r"\(data.answer_key\); the row has 'prompt'"),
    ({"prompt": "x", "reward_model": {"style": "rule"}},
     r"t.jsonl, row 1: 'reward_model' has no field 'ground_truth' \(data.answer_key='reward_model.ground_truth'\); it has 'style'"),
    ({"prompt": "x", "reward_model": "rule"},
     r"row 1: 'reward_model' is 'rule', not an object with a field 'ground_truth' \(data.answer_key='reward_model.ground_truth'\)"),
    ({"prompt": "x", "reward_model": "{not json"}, r"row 1: 'reward_model' is '{not json', not an object"),
    ({"prompt": "x", "reward_model": {"ground_truth": {"a": 1}}},
     r"row 1: column 'reward_model.ground_truth' must be a string or a number"),
])
def test_a_bad_nested_path_names_file_row_key_and_where_it_stopped(tmp_path, row, message):
    with pytest.raises(ConfigError, match=message):
        tasks.read(tasks.TaskSource(jsonl(tmp_path / "t.jsonl", [row]), answer_key="reward_model.ground_truth"))


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
