"""The ecosystem's environments by name, unchanged: skyrl-gym's ``gsm8k_multi_turn`` and
``text2sql`` from a task file in skyrl's own format (``prompt``, ``env_class``,
``reward_spec``, ``extra_info``, and text2sql's ``db_id``/``data`` over a real SQLite
database), two iterations on two ranks with the chat demo's model. skyrl-gym's own classes are
watched, not changed (a ``sitecustomize`` on the ranks' PYTHONPATH wraps their methods to log
each call): every instance made is closed exactly once, is given ``rl.max_turns``, and each
turn reaches ``step`` as the model wrote it, a stop string that ended it included."""

import collections
import json
import os
import re
import sqlite3

import pytest

from orchestrator.protocol.layout import RunLayout
from tests.harness import aggregate_records, rl_flags, run_local, status_json

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

pytest.importorskip("skyrl_gym")

WATCH = '''
import json
import os
import uuid

import skyrl_gym.envs.gsm8k.multi_turn_env as gsm8k
import skyrl_gym.envs.sql.env as sql

LOG = os.environ["SKYRL_WATCH_LOG"]


def _log(**event):
    with open(os.path.join(LOG, f"{os.getpid()}.jsonl"), "a") as f:
        f.write(json.dumps(event) + "\\n")


def _watch(cls):
    init, step, close = cls.__init__, cls.step, cls.close

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self._watch_id = uuid.uuid4().hex
        _log(event="made", env=cls.__name__, id=self._watch_id, max_turns=self.max_turns)

    def step_(self, action):
        _log(event="step", env=cls.__name__, id=self._watch_id, action=action)
        return step(self, action)

    def close_(self):
        _log(event="close", env=cls.__name__, id=self._watch_id)
        return close(self)

    cls.__init__, cls.step, cls.close = __init__, step_, close_


_watch(gsm8k.GSM8kMultiTurnEnv)
_watch(sql.SQLEnv)
'''


def _skyrl_rows(chat_rows: list[dict]) -> list[dict]:
    """The chat demo's tasks in skyrl's dataset format: even rows gsm8k_multi_turn (by their
    env_class), odd rows text2sql (no env_class: the run's skyrl_gym:<id>), over the database ``shop``."""
    rows = []
    for i, row in enumerate(chat_rows):
        if i % 2 == 0:
            rows.append({"data_source": "chat-demo", "prompt": row["prompt"], "env_class": "gsm8k_multi_turn",
                         "reward_spec": {"method": "rule", "ground_truth": row["answer"]}, "extra_info": {"index": i}})
        else:
            question = f"Count items over {i} in <sql>."  # short: the demo model's context is 128 tokens
            rows.append({"data_source": "synthetic", "prompt": [{"role": "user", "content": question}], "db_id": "shop",
                         "data": "spider", "reward_spec": {"method": "rule", "ground_truth": f"SELECT count(*) FROM items WHERE price > {i}"},
                         "extra_info": {"index": i}})
    return rows


@pytest.fixture
def skyrl_data(chat_demo_data, tmp_path):
    data = tmp_path / "data"
    (data / "tasks").mkdir(parents=True)
    (data / "model").symlink_to(chat_demo_data / "model")
    for split in ("train", "test"):
        chat = [json.loads(line) for line in (chat_demo_data / "tasks" / f"{split}.jsonl").read_text().splitlines()[:64]]
        (data / "tasks" / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _skyrl_rows(chat)))
    db = tmp_path / "sql" / "spider" / "database" / "shop" / "shop.sqlite"
    db.parent.mkdir(parents=True)
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE items (name TEXT, price INTEGER)")
        conn.executemany("INSERT INTO items VALUES (?, ?)", [(f"item{k}", k) for k in range(100)])
    return data, tmp_path / "sql"


def test_skyrl_gym_environments_run_unchanged_by_id_on_two_ranks(skyrl_data, tmp_path):
    data, db_path = skyrl_data
    watch, log_path = tmp_path / "watch", tmp_path / "run"
    watch.mkdir()
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(WATCH)
    env = {**os.environ, "SKYRL_WATCH_LOG": str(watch),
           "PYTHONPATH": f"{tmp_path / 'site'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    result = run_local(rl_flags(data, log_path, num_nodes=2, weights="1,1", max_iterations=2, extra=[
        "rl.environment=skyrl_gym:text2sql", f'rl.environment_args={{"db_path": "{db_path}"}}',
        "data.answer_key=reward_spec.ground_truth", "rl.reward=orchestrator.rewards:math",
        "rl.max_turns=2", "rl.max_tokens=48", 'rl.stop=["</sql>", "</solution>", "}"]', "rl.eval_tasks=8"]), env=env)
    assert result.returncode == 0, result.stdout[-6000:]

    events = [json.loads(line) for f in sorted(watch.iterdir()) for line in f.read_text().splitlines()]
    made = {e["id"]: e for e in events if e["event"] == "made"}
    closed = collections.Counter(e["id"] for e in events if e["event"] == "close")
    assert made and set(closed) == set(made) and set(closed.values()) == {1}, "every instance closed, once"
    assert {e["max_turns"] for e in made.values()} == {2}, "rl.max_turns reaches the environment"
    assert {e["env"] for e in made.values()} == {"GSM8kMultiTurnEnv", "SQLEnv"}

    layout = RunLayout(log_path)
    records = [r for i in (1, 2) for split in ("train", "eval") for r in aggregate_records(layout, i, split)]
    samples = [s for r in records for s in r["samples"]]
    assert len(made) == len(samples) == 2 * (8 * 4 + 8 * 2), "one instance a sample: 8 train tasks x 4, 8 eval tasks x 2"
    assert not [s for s in samples if "reward_error" in s], [s["reward_error"] for s in samples if "reward_error" in s][:2]
    # Each turn reached step() as the model wrote it: the text with the stop string that ended it.
    written = collections.Counter(t["text"] + t.get("stop", "") for s in samples for t in s["turns"])
    stepped = collections.Counter(e["action"] for e in events if e["event"] == "step")
    assert stepped == written
    assert sum(1 for s in samples for t in s["turns"] if t.get("stop")) >= 8, "turns ended by a stop string"
    assert layout.checkpoint(2).is_dir()
    shown = status_json(log_path)["iterations"]
    assert all("turns" in it["metrics"] and "env/steps" in it["metrics"] for it in shown), "gsm8k_multi_turn's get_metrics, averaged"


def test_reasoning_gym_tasks_by_name_on_two_ranks_with_eval_by_source(chat_demo_data, tmp_path):
    pytest.importorskip("reasoning_gym")
    data, log_path = tmp_path / "data", tmp_path / "run"
    data.mkdir()
    (data / "model").symlink_to(chat_demo_data / "model")
    spec = "reasoning_gym:basic_arithmetic+lcm"
    result = run_local(rl_flags(data, log_path, num_nodes=2, weights="1,1", max_iterations=2, extra=[
        f"data.train_file={spec}", f"data.test_file={spec}", "data.train_size=64", "data.test_size=16",
        "rl.reward=orchestrator.rewards:reasoning_gym", "rl.max_tokens=24"]))
    assert result.returncode == 0, result.stdout[-6000:]
    layout = RunLayout(log_path)
    for i in (1, 2):
        train, evals = aggregate_records(layout, i), aggregate_records(layout, i, "eval")
        assert len(train) == 8 and len({r["task_id"] for r in train}) == 8
        assert len(evals) == 16 and {r["data_source"] for r in evals} == {"basic_arithmetic", "lcm"}
        assert all(r["columns"]["metadata"]["source_dataset"] == r["data_source"] for r in train + evals), "records keep the columns"
        assert not {r["columns"]["question"] for r in train} & {r["columns"]["question"] for r in evals}
    shown = status_json(log_path)["iterations"]
    assert len(shown) == 2
    for it in shown:
        m = it["metrics"]
        assert {"accuracy/basic_arithmetic", "accuracy/lcm", "mean_reward/basic_arithmetic", "mean_reward/lcm"} <= set(m), m
        assert m["mean_reward"] == pytest.approx((m["mean_reward/basic_arithmetic"] + m["mean_reward/lcm"]) / 2)
    assert layout.checkpoint(2).is_dir()


def test_a_verifiers_taskset_runs_unchanged_as_an_agent_through_the_endpoint(chat_demo_data, tmp_path):
    """examples/verifiers/demo_sums.py, a verifiers.v1 taskset, by name: its tasks
    (data.*_file=verifiers:demo_sums, its config from rl.environment_args) and its episodes
    (rl.agent=verifiers:demo_sums: verifiers' own chat program calls the sample's base URL),
    one iteration on two ranks; the records are what the engine sampled, the reward the taskset's."""
    pytest.importorskip("verifiers")
    from transformers import AutoTokenizer

    from orchestrator.data import verifiers_tasks

    examples = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "verifiers")
    env = {**os.environ, "PYTHONPATH": f"{os.path.abspath(examples)}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    data, log_path = tmp_path / "data", tmp_path / "run"
    data.mkdir()
    (data / "model").symlink_to(chat_demo_data / "model")
    spec = "verifiers:demo_sums"
    result = run_local(rl_flags(data, log_path, num_nodes=2, weights="1,1", max_iterations=1, extra=[
        f"rl.agent={spec}", f"data.train_file={spec}", f"data.test_file={spec}", "data.test_size=4", "data.train_size=64",
        "rl.environment_args={\"seed\": 3}", "rl.train_tasks=4", "rl.samples_per_prompt=2", "rl.eval_tasks=4",
        "rl.eval_samples=1", "rl.max_tokens=24",
        "rl.env_timeout_s=120"]), timeout=280, env=env)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    layout = RunLayout(log_path)
    tokenizer = AutoTokenizer.from_pretrained(chat_demo_data / "model")
    train, evals = aggregate_records(layout, 1), aggregate_records(layout, 1, "eval")
    import sys
    sys.path.insert(0, examples)
    try:
        expected = {r["id"]: r for r in verifiers_tasks.rows(spec, "eval", seed=0, train_size=64, test_size=4, args={"seed": 3})}
    finally:
        sys.path.remove(examples)
    assert {r["task_id"] for r in evals} == set(expected), "the taskset's tasks, with rl.environment_args as its config"
    assert len(train) == 4 and not {r["task_id"] for r in train} & set(expected)
    samples = [(r, s) for r in train + evals for s in r["samples"]]
    for record, s in samples:
        assert "reward_error" not in s, s["reward_error"]
        assert record["columns"]["verifiers_task"]["answer"] == record["answer"] and record["data_source"] == "demo_sums"
        (turn,) = s["turns"]
        assert len(s["token_ids"]) == turn["tokens"] == len(s["logprobs"]) and all(s["loss_mask"]), "one call: what it sampled"
        assert tokenizer.decode(s["token_ids"], skip_special_tokens=True) == turn["text"]
        boxed = re.findall(r"\\boxed\{([^{}]*)\}", turn["text"])
        assert s["reward"] == float(bool(boxed) and boxed[-1].strip() == record["answer"]), (turn["text"], s["reward"])
    (shown,) = status_json(log_path)["iterations"]
    assert "accuracy/demo_sums" in shown["metrics"]
    assert layout.checkpoint(1).is_dir()
