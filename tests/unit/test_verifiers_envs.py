"""verifiers' tasksets by name (plugins/verifiers_envs.py, data/verifiers_tasks.py), with the
guide's example taskset (examples/verifiers/demo_sums.py): its tasks split without overlap,
seeded, configured by rl.environment_args; what cannot load is named before a run starts.
The episodes themselves run through the agent endpoint in tests/system/test_ecosystem_envs.py."""

import sys
from pathlib import Path

import pytest

from orchestrator import config
from orchestrator.errors import ConfigError

pytest.importorskip("verifiers")

from orchestrator.data import verifiers_tasks  # noqa: E402
from orchestrator.plugins import agents  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "verifiers"
SPEC = "verifiers:demo_sums"


@pytest.fixture(autouse=True)
def example_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    yield
    sys.modules.pop("demo_sums", None)


def _rows(split, seed=0, args=None, train_size=40, test_size=10):
    return verifiers_tasks.rows(SPEC, split, seed=seed, train_size=train_size, test_size=test_size, args=args)


def test_the_taskset_splits_into_disjoint_seeded_train_and_eval_tasks():
    train, test = _rows("train"), _rows("eval")
    assert (len(train), len(test)) == (40, 10)
    assert not {r["id"] for r in train} & {r["id"] for r in test}
    assert _rows("eval") == test, "every rank loads the same tasks"
    assert _rows("eval", seed=1) != test, "shuffled with the run's seed"
    row = test[0]
    assert row["prompt"] == [{"role": "user", "content": row["verifiers_task"]["prompt"]}]
    assert row["answer"] == row["verifiers_task"]["answer"] and row["data_source"] == "demo_sums"
    assert row["id"] == f"demo_sums-{row['verifiers_task']['idx']}"


def test_environment_args_are_the_tasksets_config():
    assert _rows("eval", args={"seed": 3}) != _rows("eval")
    small = _rows("eval", args={"max_operand": 1}, test_size=2)
    assert {r["answer"] for r in small} <= {"0", "1", "2"}
    with pytest.raises(ValueError, match="none left for the train split"):
        _rows("train", args={"max_operand": 1}, test_size=4)


def test_what_cannot_load_is_named():
    with pytest.raises(ValueError, match=r"rl.agent=verifiers:no_such_taskset: verifiers cannot load the taskset 'no_such_taskset'"):
        agents.load("verifiers:no_such_taskset")
    with pytest.raises(ValueError, match="max_operand"):
        agents.load(SPEC, {"max_operand": "many"})
    assert callable(agents.load(SPEC))


def test_a_verifiers_environment_is_named_as_an_agent():
    with pytest.raises(ConfigError, match=r"set rl.agent=verifiers:demo_sums instead"):
        config.build_sections(config.parse_overrides([f"rl.environment={SPEC}"]))


def test_an_episode_that_ends_with_errors_raises_them_for_the_sample():
    """verifiers records a failure in the episode instead of raising: the agent raises it, so
    the sample scores 0 with it in reward_error (agents/runner.py). Here its chat program
    finds no endpoint at the base URL."""
    import asyncio
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    solve = agents.load(SPEC)
    task = _rows("eval", test_size=1)[0]

    async def episode():
        try:
            await asyncio.wait_for(solve(task, f"http://127.0.0.1:{port}/v1"), 120)
        finally:
            await solve.aclose()

    with pytest.raises(RuntimeError, match="the verifiers episode failed: .*All connection attempts failed"):
        asyncio.run(episode())
