"""verifiers' environments (its current API, ``verifiers.v1``) by taskset id or module, run
unchanged as agents: ``rl.agent=verifiers:<id>``. A verifiers environment drives the model
itself, through an OpenAI-compatible chat endpoint, so it is an agent here: each sample is one
``env.run_episode(task, ...)`` against the sample's base URL of the agent endpoint, and its
reward is the episode's (its trace's ``reward``: the sum of the taskset's weighted rewards),
its numeric ``metrics`` averaged in eval as ``env/<name>``. An episode that ends with errors
(verifiers records them instead of raising) is a reward error, counted against
``rl.max_reward_error_fraction``.

The environment is ``{"taskset": {"id": <id>, **rl.environment_args}}`` with the ``null``
harness (verifiers' own chat program: one chat conversation, tools served to it by MCP where the
taskset has any) in the ``subprocess`` runtime: a program on this node per episode, which
verifiers prepares with ``uv`` (installed with this package's ``envs`` extra; the program's own
packages come from the package index on first use, then from uv's cache). What needs a
sandbox (docker, apptainer, modal, e2b, prime) or another harness (bash, claude_code, ...) is
out of reach here. One environment serves per event loop (each split's rollout has its own),
opened on its first sample and closed with the rollout (the agent's ``aclose``).

A task is the taskset's: its row (``data.train_file=verifiers:<id>``, data/verifiers_tasks.py,
keeps the task's data under ``verifiers_task``; a file of the task data's own columns works too)
validated into the taskset's task type.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import weakref

PREFIX = "verifiers:"
KEY_VAR = "ORCHESTRATOR_AGENT_API_KEY"
"""The environment variable verifiers reads the endpoint's API key from (the endpoint checks none)."""
TASK_COLUMN = "verifiers_task"


def names(spec: str) -> bool:
    """Whether ``spec`` (``rl.agent`` or a task file) names a verifiers taskset."""
    return spec.startswith(PREFIX)


def env_config(spec: str, args: dict | None = None):
    """verifiers' validated config of ``verifiers:<id>``: the taskset with ``args``, the null
    harness in the subprocess runtime; ValueError when verifiers is missing or the taskset
    does not load."""
    taskset_id = spec[len(PREFIX):]
    if not taskset_id:
        raise ValueError(f"{spec!r} names no taskset: verifiers:<id or module>")
    try:
        from verifiers.v1.utils.loaders import resolve_env_config
    except ImportError as e:
        raise ValueError(f"{spec} needs verifiers, which this Python cannot import ({e}): "
                         f"pip install 'orchestrator[envs]' (or verifiers) on every node") from None
    try:
        return resolve_env_config({"taskset": {**(args or {}), "id": taskset_id},
                                   "agent": {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}}})
    except Exception as e:  # noqa: BLE001 - an import error, a missing __all__, a bad argument
        raise ValueError(f"{spec}: verifiers cannot load the taskset {taskset_id!r}: {type(e).__name__}: {e}") from None


def agent(spec: str, args: dict | None = None):
    """The agent (a coroutine function of ``(task, base_url)``) that runs ``verifiers:<id>``'s
    episode for a sample; ValueError as :func:`env_config`."""
    config = env_config(spec, args)
    serving: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> its open environment

    async def solve(task: dict, base_url: str) -> dict:
        import verifiers.v1 as vf

        env = await _environment(serving, config)
        task_type = type(env.taskset).task_type()
        data = task_type.data_type().model_validate(task.get(TASK_COLUMN) or task)
        client = vf.EvalClientConfig(base_url=base_url, api_key_var=KEY_VAR)
        episode = await env.run_episode(task_type(data, env.taskset.config.task), vf.ModelContext(model="policy", client=client))
        errors = [*episode.errors, *(e for t in episode.traces for e in t.errors)]
        if errors or not episode.traces:
            raise RuntimeError(f"the verifiers episode failed: {'; '.join(str(e) for e in errors) or 'it ran no agent'}"[:2000])
        trace = episode.traces[0]
        metrics = {k: float(v) for k, v in trace.metrics.items() if isinstance(v, (int, float))}
        return {"reward": float(trace.reward), "metrics": metrics}

    solve.aclose = lambda: _close(serving)  # the runner's, on the rollout's loop when it closes (agents/runner.py)
    return solve


async def _environment(serving: weakref.WeakKeyDictionary, config):
    """This event loop's environment, serving (made and opened on its first call)."""
    loop = asyncio.get_running_loop()
    opened = serving.get(loop)
    if opened is None:
        opened = serving[loop] = asyncio.ensure_future(_open(config))
    env, _ = await asyncio.shield(opened)
    return env


async def _open(config):
    from verifiers.v1.utils.loaders import load_environment

    os.environ.setdefault(KEY_VAR, "policy")
    # verifiers prepares its chat program with uv: the one installed beside this Python first.
    here, path = os.path.dirname(sys.executable), os.environ.get("PATH", "")
    if path.split(os.pathsep)[:1] != [here]:
        os.environ["PATH"] = os.pathsep.join([here, path])
    env = load_environment(config)
    stack = contextlib.AsyncExitStack()
    await stack.enter_async_context(env.serving())
    return env, stack


async def _close(serving: weakref.WeakKeyDictionary) -> None:
    """Stop this event loop's environment serving, if it opened."""
    opened = serving.pop(asyncio.get_running_loop(), None)
    if opened is not None and opened.done() and opened.exception() is None:
        _, stack = opened.result()
        await stack.aclose()
