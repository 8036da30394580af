"""``rl.agent=module:function``: the user's agent, called once per sample as
``function(task, base_url)`` against the agent endpoint (``endpoint.py``), the model named
``policy``. A coroutine function is awaited on the rollout's event loop; a plain one runs on a
worker thread (the environments' threads). Either has ``rl.env_timeout_s`` of its own time:
from its start, less the time its calls spend in the endpoint (waiting for the engines is not
the agent's doing; a rank's samples share them). As many coroutine agents run at once as the
rank's engines hold sequences in flight (``Inflight.capacity``: ``rollout.max_inflight`` an
engine); the others wait to start, their time not running, since more would only wait for the
engines, each holding a connection meanwhile (an eval of 3,200 samples through an OpenAI
client's pool of 1,000 connections had most agents' time pass in that pool).

It returns the sample's reward: a number, or a dict with ``reward`` and optional ``metrics``
(numbers, averaged in eval as ``env/<name>``), or text, its final answer, which ``rl.reward``
scores. An agent that raises, runs past its time, or returns something else scores 0 with
the error in ``reward_error``, counted against ``rl.max_reward_error_fraction``; its session
is closed either way, so a call it makes later is refused.

The sample's record is what the model sampled through its calls, token-exact: the ids, the
engine's log-probs, the loss mask (1 sampled, 0 the messages the agent added), and ``turns``,
one per call. The record's ``prompt_token_ids`` are what the task's samples' first prompts have in
common (the task's prompt rendered when no agent called the model); the rest of each
sample's prompt opens its ``token_ids``, as context.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import time
import weakref
from dataclasses import dataclass, field

from orchestrator.agents import replay
from orchestrator.agents.endpoint import AgentEndpoint
from orchestrator.agents.sessions import Session
from orchestrator.data.carry import ABORTED, unfinished
from orchestrator.data.turns import render
from orchestrator.plugins.environments import OneTurn, finite_number
from orchestrator.workloads.rl.engine_requests import Inflight
from orchestrator.workloads.rl.episodes import CallTimedOut, EnvThreads, failure

_WAIT_S = 1.0
"""How often a running agent's own time is looked at against rl.env_timeout_s."""


class Halted(Exception):
    """The endpoint ended the sample before its agent returned (``Session.halted``)."""


@dataclass
class Agents:
    """Runs a task's samples, each by one call of the agent."""

    agent: object
    spec: str
    """``rl.agent``, for messages."""
    endpoint: AgentEndpoint
    reward: object
    """``rl.reward``: scores an agent's text answer."""
    timeout_s: float
    threads: EnvThreads = field(default_factory=EnvThreads)
    _slots: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)
    """Event loop -> the semaphore of the agents running on it at once."""

    @property
    def stopping(self) -> bool:
        """The rollout stops (rollout.partial): each sample is ended at its call (endpoint.py)."""
        return self.endpoint.stopping

    @stopping.setter
    def stopping(self, value: bool) -> None:
        self.endpoint.stopping = value

    async def run(self, inflight: Inflight, task: dict, *, n: int, seed: str) -> tuple[str, list[int], list[dict], float]:
        await self.endpoint.start(inflight)
        sent_at = time.time()
        slots = self._slots_of(inflight)
        sessions = await asyncio.gather(*(self._sample(task, f"{seed}:{i}", slots, key=f"{task['id']}:{i}") for i in range(n)))
        if self.endpoint.engine_failure is not None:
            raise self.endpoint.engine_failure
        tokenizer = self.endpoint.tokenizer
        called = [s.conversation.prompt_ids for s, _ in sessions if s.conversation is not None]
        if not called:  # no agent called the model: the task's own prompt stands for the record's
            common = render(tokenizer, OneTurn(task).reset(), generation_prompt=True)
        else:
            for session, outcome in sessions:  # a sample that shares not one token with the first is not of the group
                if session.conversation is not None and session.conversation.prompt_ids[:1] != called[0][:1]:
                    session.segments, session.conversation = [], None
                    outcome.update(reward=0.0, error=f"{self.spec}: its first call's prompt shares no token with the first sample's")
            common = list(os.path.commonprefix([s.conversation.prompt_ids for s, _ in sessions if s.conversation is not None]))
        samples = [_sample(session, outcome, len(common), tokenizer) for session, outcome in sessions]
        return tokenizer.decode(common, skip_special_tokens=False), common, samples, sent_at

    async def resume(self, inflight: Inflight, task: dict, record: dict, *, seed: str) -> tuple[str, list[int], list[dict], float]:
        """``record``'s group (carried by a rollout that stopped) continued: its finished samples
        as they are, each stopped one's agent run again, its calls before the stop answered
        from the record (replay.py); as :meth:`run` returns them."""
        await self.endpoint.start(inflight)
        sent_at = time.time()
        slots, common, tokenizer = self._slots_of(inflight), record["prompt_token_ids"], self.endpoint.tokenizer

        async def sample(i: int, carried: dict) -> dict:
            if not unfinished(carried):
                return carried
            session, outcome = await self._sample(task, f"{seed}:{i}", slots, key=f"{task['id']}:{i}", script=replay.calls(carried, common))
            if session.conversation is not None and session.conversation.prompt_ids[: len(common)] != common:
                session.segments, session.conversation = [], None
                outcome = {"reward": 0.0, "error": f"{self.spec}: a carried sample's first call's prompt is not its group's"}
            return _sample(session, outcome, len(common), tokenizer)

        samples = await asyncio.gather(*(sample(i, s) for i, s in enumerate(record["samples"])))
        if self.endpoint.engine_failure is not None:
            raise self.endpoint.engine_failure
        return tokenizer.decode(common, skip_special_tokens=False), common, list(samples), sent_at

    def _slots_of(self, inflight: Inflight) -> asyncio.Semaphore:
        """The running loop's semaphore of the agents running at once."""
        loop = asyncio.get_running_loop()
        if loop not in self._slots:
            self._slots[loop] = asyncio.Semaphore(inflight.capacity)
        return self._slots[loop]

    async def _sample(self, task: dict, seed: str, slots: asyncio.Semaphore, *, key: str,
                      script: list[replay.Recorded] = ()) -> tuple[Session, dict]:
        async with slots:
            session, base_url = self.endpoint.open(task, seed, key=key, script=script)
            try:
                if self.endpoint.stopping:  # the rollout stopped before this agent began: carried unbegun
                    session.halt()
                    raise Halted
                outcome = self._outcome(task, await self._call(dict(task), base_url, session))
            except Halted:
                error = session.halted.result()
                outcome = {"stopped": True} if error is None else {"reward": 0.0, "error": f"{self.spec}: {error}"}
            except CallTimedOut:
                outcome = {"reward": 0.0, "error": f"{self.spec}: the agent took longer than rl.env_timeout_s={self.timeout_s:g}"}
            except Exception as e:  # noqa: BLE001 - the user's code
                outcome = {"reward": 0.0, "error": failure(f"{self.spec}: the agent", e)}
            finally:
                self.endpoint.close(session)
        self.endpoint.forget(session)
        return session, outcome

    async def _call(self, task: dict, base_url: str, session: Session):
        """The agent's answer; CallTimedOut once its own time (its calls' time left out) passes
        rl.env_timeout_s: a coroutine is cancelled, a thread abandoned (it cannot be stopped)."""
        if inspect.iscoroutinefunction(self.agent):
            running = asyncio.ensure_future(self.agent(task, base_url))
            started = time.monotonic()
            began = lambda: started  # noqa: E731
        else:
            future = self.threads.call(self.agent, task, base_url)
            running = asyncio.wrap_future(future)
            began = lambda: future.started  # noqa: E731 - None while it waits for a thread
        try:
            while not running.done() and not session.halted.done():
                start = began()
                now = time.monotonic()
                left = _WAIT_S if start is None else start + self.timeout_s + session.busy_s(now) - now
                if left <= 0:
                    if not isinstance(running, asyncio.Task):
                        self.threads.abandoned()
                    raise CallTimedOut
                await asyncio.wait({running, session.halted}, timeout=min(left, _WAIT_S), return_when=asyncio.FIRST_COMPLETED)
            if session.halted.done():  # whatever the agent made of its refused call
                if not running.done() and not isinstance(running, asyncio.Task):
                    self.threads.abandoned()
                raise Halted
        finally:
            if isinstance(running, asyncio.Task) and not running.done():  # timed out, halted, or the rollout cancelled
                running.cancel()
        return running.result()

    def _outcome(self, task: dict, result: object) -> dict:
        """The sample's reward (and metrics, or error) out of what the agent returned."""
        if isinstance(result, str):
            try:
                value = float(self.reward(task, result))
            except Exception as e:  # noqa: BLE001 - the user's reward
                return {"reward": 0.0, "error": failure("rl.reward on the agent's answer", e)}
            result = value
        metrics = {}
        if isinstance(result, dict):
            metrics = result.get("metrics") or {}
            if not isinstance(metrics, dict) or not all(isinstance(k, str) and finite_number(v) for k, v in metrics.items()):
                return {"reward": 0.0, "error": f"{self.spec}: the agent's metrics must map names to finite numbers, got {metrics!r:.200}"}
            result = result.get("reward")
        if not finite_number(result):
            return {"reward": 0.0, "error": f"{self.spec}: the agent returned {result!r:.200}: a reward (a finite number), a dict "
                                            f"with reward and metrics, or its answer as text for rl.reward"}
        return {"reward": float(result), "metrics": {k: float(v) for k, v in metrics.items()}}

    def close(self) -> None:
        """Stop the endpoint, and what the agent holds open on the loop (its ``aclose``, where it
        has one), on the rollout's loop, still running: the pipe closes this first."""
        inflight = self.endpoint.inflight
        if inflight is not None:
            for closing in filter(None, (getattr(self.agent, "aclose", None), self.endpoint.stop)):
                try:
                    inflight.spawn(closing()).result(timeout=15)
                except Exception:  # noqa: BLE001 - a loop already stopped: nothing serves; or the agent's own failure
                    pass
        self.threads.close()




def _sample(session: Session, outcome: dict, common: int, tokenizer) -> dict:
    """The sample as records hold it: its last segment (earlier ones under ``segments``, each
    trained as a sequence of its own with the sample's advantage: train/grpo.py), the part of
    its prompt past the group's common prefix opening its ids, as context."""
    c = session.conversation
    if c is None:  # the agent never called the model
        sample = {"text": "", "token_ids": [], "logprobs": [], "loss_mask": [], "turns": [], "reward": outcome.get("reward", 0.0),
                  "finish_reason": "stop"}
    else:
        own = c.prompt_ids[common:]
        ids = own + c.token_ids
        last = c.turns[-1] if c.turns else {}
        sample = {"text": tokenizer.decode(ids, skip_special_tokens=False) if ids else "", "token_ids": ids,
                  "logprobs": [0.0] * len(own) + c.logprobs, "loss_mask": [0] * len(own) + c.loss_mask, "turns": c.turns,
                  "reward": outcome.get("reward", 0.0), "finish_reason": last.get("finish_reason", "stop")}
        if session.segments:
            sample["segments"] = [{"prompt_token_ids": s.prompt_ids, "token_ids": s.token_ids, "logprobs": s.logprobs,
                                   "loss_mask": s.loss_mask, "turns": s.turns} for s in session.segments]
    if outcome.get("stopped"):  # the rollout's stop (rollout.partial): carried, scored once it is finished
        sample["finish_reason"] = ABORTED
        del sample["reward"]
    if outcome.get("metrics"):
        sample["metrics"] = outcome["metrics"]
    if outcome.get("error"):
        sample["reward"], sample["reward_error"] = 0.0, outcome["error"]
    return sample
