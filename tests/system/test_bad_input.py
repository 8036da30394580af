"""Bad input exits 2 with a message naming what is wrong, and writes nothing (done-when 7)."""

import json
import subprocess
import sys

import pytest

from orchestrator.demo import tokenizer as demo_tokenizer

pytestmark = pytest.mark.timeout(60)


def _run(args, env=None):
    import os

    full_env = {k: v for k, v in os.environ.items() if k not in ("RANK", "NODE_RANK")}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "orchestrator", "run", *args], capture_output=True, text=True,
                          timeout=30, env=full_env)


def _base(tmp_path, **over):
    flags = {
        "--data-path": str(tmp_path / "data"),
        "--log-path": str(tmp_path / "run"),
        "--rl-phase": "both",
        "--eval-interval": "2",
        "--num-nodes": "3",
        "--rank-weights": "2,1,1",
    }
    flags.update(over)
    return [f"{k}={v}" for k, v in flags.items() if v is not None] + ["--rehearsal"]


CASES = {
    "weight count differs from num-nodes": ({"--rank-weights": "1,1"}, ["--master"], "--rank-weights has 2 value(s) but --num-nodes is 3"),
    "zero weight where every node has an engine": ({"--rank-weights": "1,0,1"}, ["--master"],
                                                   "gives node 1 weight 0, but it runs an engine and rolls out (every node does without rollout.nodes)"),
    "negative weight": ({"--rank-weights": "1,-1,1"}, ["--master"], "must be numbers >= 0"),
    "only zero weights": ({"--rank-weights": "0,0,0"}, ["--master"], "at least one positive"),
    "rank out of range": ({}, ["--worker=3"], "rank 3 is out of range"),
    "master and worker": ({}, ["--master", "--worker=1"], "--master and --worker are exclusive"),
    "both without eval interval": ({"--eval-interval": None}, ["--master"], "--rl-phase both needs --eval-interval"),
    "rollout without split": ({"--rl-phase": "rollout", "--eval-interval": None}, ["--master"], "--rl-phase rollout needs --rollout-split"),
    "relative log path": ({"--log-path": "relative/run"}, ["--master"], "--log-path must be an absolute path"),
    "relative data path": ({"--data-path": "data"}, ["--master"], "--data-path must be an absolute path"),
    "unknown override key": ({}, ["--master", "coordination.nope=1"], "unknown config key 'coordination.nope': did you mean coordination.min_nodes"),
    "override of the wrong type": ({}, ["--master", "coordination.node_timeout_s=soon"], "expected a value of type float"),
    "learning rate the trainer would refuse": ({}, ["--master", "rl.lr=-1"], "rl.lr must be > 0, got -1.0"),
    "no checkpoint kept": ({}, ["--master", "checkpoint.keep_last=0"], "checkpoint.keep_last must be at least 1"),
    "negative keep_every": ({}, ["--master", "checkpoint.keep_every=-1"], "checkpoint.keep_every must be >= 0"),
    "heartbeat too slow for the timeout": ({}, ["--master", "coordination.node_timeout_s=10", "coordination.heartbeat_interval_s=5"], "at most a quarter"),
    "bad rl-phase": ({"--rl-phase": "train"}, ["--master"], "'train' is not one of 'rollout', 'update', 'both'"),
    "no rank on a multi-node run": ({}, [], "no rank given"),
    "no nodes, without --master": ({"--num-nodes": "0", "--rank-weights": None}, [], "--num-nodes must be at least 1, got 0"),
    "negative nodes, with --master": ({"--num-nodes": "-1", "--rank-weights": None}, ["--master"], "--num-nodes must be at least 1, got -1"),
    "staleness on nodes that both train and roll out": ({}, ["--master", "rl.max_staleness=1"],
                                                        "node(s) 0,1,2 would do both: set train.nodes and rollout.nodes apart"),
    "staleness in update mode": ({"--rl-phase": "update", "--eval-interval": None, "--rank-weights": "0,1,1"},
                                 ["--master", "rl.max_staleness=1", "train.nodes=0", "rollout.nodes=1-2"], "it needs --rl-phase both"),
}


@pytest.mark.parametrize("over,extra,message", CASES.values(), ids=CASES.keys())
def test_bad_input_exits_2_and_writes_nothing(tmp_path, over, extra, message):
    result = _run(_base(tmp_path, **over) + extra)
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in " ".join((result.stdout + result.stderr).split())
    assert list(tmp_path.iterdir()) == [], "nothing may be created"


def test_rank_is_taken_from_the_environment(tmp_path):
    result = _run(_base(tmp_path), env={"RANK": "7"})
    assert result.returncode == 2 and "rank 7 is out of range" in result.stderr
    result = _run(_base(tmp_path), env={"NODE_RANK": "5"})
    assert result.returncode == 2 and "rank 5 is out of range" in result.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("over, message", [({"--rank-weights": "1,1"}, "--rank-weights has 2 value(s)"),
                                           ({"--num-nodes": "0", "--rank-weights": None}, "--num-nodes must be at least 1, got 0")])
def test_local_validates_before_starting_any_rank(tmp_path, over, message):
    result = subprocess.run([sys.executable, "-m", "orchestrator", "local", *_base(tmp_path, **over)],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []


def _vllm_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


ENVIRONMENT_CASES = {
    "no demo data": ([], "lacks", "make the demo data with `orchestrator demo-data --data-path"),
    "reward module does not import": (["rl.reward=no_such_module:score"], "rl.reward='no_such_module:score': cannot import no_such_module",
                                      None),
    "reward not module:function": (["rl.reward=score"], "is not of the form module:function", None),
    "reward misspelt": (["rl.reward=orchestrator.rewards:exact"], "orchestrator.rewards has no function exact: did you mean exact_match?",
                        None),
    "reward unlike any": (["rl.reward=orchestrator.rewards:nothing_like_it"], "(it has exact_match, final_answer, judge, math, reasoning_gym)", None),

    "vllm not installed": (["--engine=vllm"], "rollout.engine=vllm but vLLM is not installed in this Python", "scripts/setup-vllm.sh"),
}


@pytest.mark.parametrize("extra,message,hint", ENVIRONMENT_CASES.values(), ids=ENVIRONMENT_CASES.keys())
def test_what_this_node_lacks_for_the_real_loop_exits_2_and_writes_nothing(tmp_path, extra, message, hint):
    if "--engine=vllm" in extra and _vllm_installed():
        pytest.skip("vLLM is installed here")
    flags = [f for f in _base(tmp_path) if f != "--rehearsal"]
    result = _run(flags + ["--master", *extra])
    text = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 2 and message in text and (hint is None or hint in text), text
    assert list(tmp_path.iterdir()) == [], "nothing may be created"


@pytest.mark.parametrize("extra, says", [
    (["data.test_file=tasks/tst.jsonl"], "tasks/tst.jsonl (from data.test_file=tasks/tst.jsonl)"),
    ([], "model/config.json (from model.path (unset: <data-path>/model))"),
])
def test_the_users_own_data_folder_is_told_the_key_that_names_a_missing_file_never_to_make_demo_data(tmp_path, extra, says):
    """A folder of the user's own (it holds their tasks) lacking a file: the key that names the
    file, not `demo-data`, which would write demo tasks among theirs."""
    tasks = tmp_path / "data" / "tasks"
    tasks.mkdir(parents=True)
    for name in ("train.jsonl", "test.jsonl"):
        (tasks / name).write_text(json.dumps({"id": "t1", "prompt": "1+1=", "answer": "2"}) + "\n")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    result = _run([f for f in _base(tmp_path) if f != "--rehearsal"] + ["--master", *extra])
    text = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 2 and says in text and "demo-data" not in text, text
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before, "nothing may be created"


GOOD = {"id": "t1", "prompt": "1+1=", "answer": "2"}
ROW_CASES = {
    "missing key": ([GOOD, {"id": "t2", "answer": "3"}], [], "train.jsonl, row 2: no column 'prompt' (data.prompt_key)"),
    "prompt neither text nor messages": ([{**GOOD, "prompt": {"text": "1+1="}}], [],
                                         "row 1: column 'prompt' must be a string or a list of chat messages"),
    "duplicate id": ([GOOD, GOOD], [], "train.jsonl, row 2: duplicate id 't1' in column 'id' (first in row 1)"),
    "renamed key absent": ([GOOD], ["data.answer_key=solution"], "row 1: no column 'solution' (data.answer_key)"),
    "unreadable parquet": ([GOOD], ["data.train_file=tasks/train.parquet"], "train.parquet: not a readable Parquet file"),
    "chat messages without a chat template": ([{**GOOD, "prompt": [{"role": "user", "content": "1+1="}]}], [],
                                              "the prompts are chat messages, but the model"),
    "prompt limit past the context": ([GOOD], ["rl.max_prompt_tokens=60"],
                                      "rl.max_prompt_tokens=60 plus rl.max_tokens=8 is more than the model's context length of 64"),
    "every prompt too long": ([GOOD], ["rl.max_prompt_tokens=4"],
                              "train.jsonl is longer than 4 tokens (the longest rl.max_prompt_tokens allows); the shortest has 5"),
    "environment does not import": ([GOOD], ["rl.environment=no_such_envs:Env"],
                                    "rl.environment='no_such_envs:Env': cannot import no_such_envs"),
    "environment not module:Class": ([GOOD], ["rl.environment=Calculator"], "is not of the form module:Class"),
    "environment without a chat template": ([GOOD], ["rl.environment=orchestrator.environments:OneTurn"],
                                            "rl.environment=orchestrator.environments:OneTurn needs a chat model"),
    "environment timeout not positive": ([GOOD], ["rl.env_timeout_s=0"], "rl.env_timeout_s"),
    "environment argument the class does not take": ([GOOD], ["rl.environment=orchestrator.demo.calculator:Calculator",
                                                              'rl.environment_args={"db_path": "/data"}'],
                                                     "Calculator() takes no argument db_path (from rl.environment_args"),
    "reasoning-gym dataset unknown": ([GOOD], ["data.train_file=reasoning_gym:basic_arithmetik"],
                                      "data.train_file=reasoning_gym:basic_arithmetik: reasoning-gym has no dataset 'basic_arithmetik'; "
                                      "did you mean basic_arithmetic"),
    "skyrl-gym environment unknown": ([GOOD], ["rl.environment=skyrl_gym:gsm9k"], "skyrl-gym has no environment 'gsm9k'"),
    "environment arguments not an object": ([GOOD], ['rl.environment_args=["a"]'], "rl.environment_args='[\"a\"]': expected a JSON object"),
}


@pytest.mark.parametrize("rows,extra,message", ROW_CASES.values(), ids=ROW_CASES.keys())
def test_bad_task_rows_exit_2_naming_file_row_and_key(tmp_path, rows, extra, message):
    import json

    data = tmp_path / "data"
    (data / "model").mkdir(parents=True)
    (data / "model" / "config.json").write_text(json.dumps({"max_position_embeddings": 64}))
    demo_tokenizer.save(data / "model")  # "1+1=" is 5 tokens: <s> and one per character
    (data / "model" / "model.safetensors").write_bytes(b"")  # the rows are checked after the model has its files
    (data / "tasks").mkdir()
    (data / "tasks" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (data / "tasks" / "test.jsonl").write_text(json.dumps(GOOD) + "\n")
    (data / "tasks" / "train.parquet").write_bytes(b"PAR1 but not really")
    flags = [f for f in _base(tmp_path) if f != "--rehearsal"]
    result = _run(flags + ["--master", *extra])
    text = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 2 and message in text, text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"], "nothing may be written to the run"
