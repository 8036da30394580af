"""Multi-turn rollouts (``rl.environment``): each sample a conversation with an environment of
its own, turn by turn, token-exact (``data/turns.py``).

A task's samples open with the environment's ``reset()`` messages, rendered by the chat
template; their first turn is one request of ``n`` samples, as a one-turn rollout's. Then each
sample goes on alone: the environment's ``step`` answers the model's turn (a
:class:`~orchestrator.plugins.environments.Turn`: its text, finish reason and stop string);
its observation's ids join the context, and the whole context is the next turn's token-id
prompt. A sample ends when the environment says done, at ``rl.max_turns``, or when its ids
after the prompt would pass ``rl.max_tokens`` (``finish_reason`` "length") or the model's
context. Its reward is its steps' rewards summed (``rl.step_rewards=sum``) or the last one's;
its metrics the last value of each name its steps gave. The environment's ``close()``, when
it has one, is called once as the sample ends, however it ends.

With ``rollout.partial`` a rollout that stops (:attr:`Episodes.stopping`) cuts each sample
where it is: a turn the engine was sampling keeps what it had (finish reason ``abort``), a
sample in an environment call finishes the call and stops before its next turn. The next
rollout continues it (:meth:`Episodes.resume`): a new environment, reset, is walked through
the sample's turns again (its ``step`` given each recorded turn, which must answer as it did),
then the stopped turn goes on from its ids, or the next turn starts.

The samples run as coroutines on the rollout's event loop (:class:`inflight.Inflight`), so a
sample waiting for its environment holds no request slot. The environments' code (the class,
``reset``, ``step``, ``close``) runs on threads of its own (:class:`EnvThreads`), never on the
loop: a slow one stalls only its sample. One that raises, or takes longer than
``rl.env_timeout_s``, ends its sample with reward 0 and the error in ``reward_error``, counted
against ``rl.max_reward_error_fraction`` as a failing reward is (``scoring.py``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import queue
import random
import threading
import time
import traceback
from dataclasses import dataclass, field

from orchestrator.data.carry import ABORTED
from orchestrator.plugins import environments
from orchestrator.plugins.environments import OneTurn, Turn
from orchestrator.workloads.rl.engine_requests import Inflight, Request, Stopped
from orchestrator.workloads.rl.scoring import ERROR_CHARS
from orchestrator.data.turns import Conversation, render

log = logging.getLogger(__name__)

ENV_THREADS = 32
"""Threads running environments' code at once on a rank (one more for each call that timed out)."""
_WAIT_S = 1.0
"""How often a call still waiting for a thread looks whether it has started."""


class CallTimedOut(Exception):
    """A call on :class:`EnvThreads` ran past its time and was abandoned."""


class EnvThreads:
    """Daemon threads that run environments' calls: a call that never returns keeps its thread
    (it cannot be stopped) but not its sample, which the caller abandons; :meth:`abandoned`
    starts a thread in its place, and daemon threads never hold the process at exit."""

    def __init__(self, threads: int = ENV_THREADS):
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = 0
        for _ in range(threads):
            self._start()

    def _start(self) -> None:
        self._threads += 1
        threading.Thread(target=self._work, name=f"rl-environment-{self._threads}", daemon=True).start()

    def _work(self) -> None:
        while (future := self._calls.get()) is not None:
            if future.set_running_or_notify_cancel():
                future.started = time.monotonic()
                try:
                    future.set_result(future.call())
                except BaseException as e:  # noqa: BLE001 - the user's code: handed to the sample
                    future.set_exception(e)

    def call(self, fn, *args, **kwargs) -> concurrent.futures.Future:
        """``fn(*args, **kwargs)`` on a thread; its future's ``started`` is when it began (None while queued)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.call, future.started = functools.partial(fn, *args, **kwargs), None
        self._calls.put(future)
        return future

    def abandoned(self) -> None:
        """A call was given up on: its thread may never come back."""
        self._start()

    async def run(self, fn, *args, timeout_s: float, **kwargs):
        """``fn(*args, **kwargs)`` on a thread, awaited within ``timeout_s`` of its start (a call
        waiting for a thread is not late: the threads may all be busy with other samples);
        :class:`CallTimedOut` past it (the call is abandoned to its thread), and what it raised."""
        future = self.call(fn, *args, **kwargs)
        result = asyncio.wrap_future(future)
        while not result.done():
            left = _WAIT_S if future.started is None else future.started + timeout_s - time.monotonic()
            if left <= 0:
                self.abandoned()
                raise CallTimedOut
            await asyncio.wait({result}, timeout=left)
        return result.result()

    def close(self) -> None:
        for _ in range(self._threads):
            self._calls.put(None)


@dataclass(slots=True)
class RoomWatch:
    """Counts the samples that ended and those cut for room while their environment wanted
    another turn; warns once (a run's whole life when the workload keeps one) when most were.

    ``rl.max_tokens`` bounds all of a sample's turns and the observations between them: an
    observation longer than what is left ends every sample at its first turn, which nothing
    else in the run would say."""

    ended: int = 0
    cut_for_room: int = 0
    warned: bool = False

    def count(self, episodes: list[Episode], *, spec: str, max_tokens: int, max_turns: int) -> None:
        self.ended += len(episodes)
        self.cut_for_room += sum(e.cut_for_room for e in episodes)
        message = room_warning(self.ended, self.cut_for_room, spec=spec, max_tokens=max_tokens, max_turns=max_turns)
        if message is not None and not self.warned:
            self.warned = True
            log.warning("%s", message)


ROOM_WARNING_MIN_SAMPLES = 16
"""Samples ended before :func:`room_warning` judges: a group or two, not one unlucky sample."""


def room_warning(ended: int, cut_for_room: int, *, spec: str, max_tokens: int, max_turns: int) -> str | None:
    """The warning when most of ``ended`` samples were cut for room with their environment
    wanting another turn; None otherwise."""
    if ended < ROOM_WARNING_MIN_SAMPLES or 2 * cut_for_room <= ended:
        return None
    return (f"{cut_for_room} of {ended} samples of rl.environment={spec} ended for want of room while the environment wanted "
            f"another turn: rl.max_tokens={max_tokens} bounds all of a sample's turns and the observations between them, "
            f"and rl.max_turns={max_turns} turns rarely fit; raise rl.max_tokens (or lower rl.max_turns) for the turns to happen")


class EnvironmentFailed(Exception):
    """An environment's call raised or timed out; the message says which and where."""


@dataclass(slots=True)
class Episode:
    """One sample's conversation with its environment."""

    env: object = None
    """The sample's environment; None before it is made and once it is closed."""
    conversation: Conversation | None = None
    reward: float = 0.0
    finish_reason: str = "stop"
    error: str | None = None
    cut_for_room: bool = False
    """Ended because the next turn had no room, the environment wanting one."""
    metrics: dict[str, float] = field(default_factory=dict)
    """The last value of each name the environment's steps gave (``Step.metrics``)."""
    tools: list[dict] | None = None
    """The environment's function schemas, rendered with its messages (``environments.tools``)."""

    def sample(self, decode) -> dict:
        c = self.conversation
        ids = c.token_ids if c else []
        sample = {"text": decode(ids) if ids else "", "token_ids": ids, "reward": self.reward, "finish_reason": self.finish_reason,
                  "logprobs": c.logprobs if c else [], "loss_mask": c.loss_mask if c else [], "turns": c.turns if c else []}
        if self.finish_reason == ABORTED:  # stopped (rollout.partial): scored once it is finished
            del sample["reward"]
        if self.metrics:
            sample["metrics"] = self.metrics
        if self.error is not None:
            sample["reward_error"] = self.error
        return sample


@dataclass
class Episodes:
    """Runs a task's samples as conversations with ``environment`` (a class, ``rl.environment``)."""

    environment: type
    spec: str
    """``rl.environment``, for messages."""
    tokenizer: object
    max_turns: int
    max_tokens: int
    """The ids a sample may add after its prompt, all turns together."""
    context: int | None
    """The model's context length (None: unknown)."""
    timeout_s: float
    args: dict = field(default_factory=dict)
    """``rl.environment_args``: keyword arguments of every instance (a task's own column updates them)."""
    step_rewards: str = "sum"
    """``rl.step_rewards``: a sample's reward is its steps' summed (sum) or its last step's (last)."""
    threads: EnvThreads = field(default_factory=EnvThreads)
    room: RoomWatch = field(default_factory=RoomWatch)
    """Samples cut for room: the workload keeps one across the run's rollouts, to warn once."""
    stopping: bool = False
    """The rollout stops (rollout.partial): a sample between turns goes no further."""

    async def run(self, inflight: Inflight, task: dict, *, n: int, seed: str) -> tuple[str, list[int], list[dict], float]:
        """``n`` samples of ``task``: (the prompt's text and ids, the samples as records hold
        them, when the first request was sent). ``seed`` names the task's random streams."""
        episodes = [Episode() for _ in range(n)]
        openings = await asyncio.gather(*(self._open(e, task) for e in episodes))
        prompt = next((o for o in openings if o is not None), None)
        if prompt is None:  # every environment failed to open: the task's own prompt stands for the record's
            prompt = render(self.tokenizer, OneTurn(task).reset(), generation_prompt=True)
        together = [i for i, o in enumerate(openings) if o == prompt]
        for i, o in enumerate(openings):
            if o is not None and o != prompt:
                self._fail(episodes[i], f"{self.spec}: reset() opened sample {i} with other messages than sample "
                                        f"{together[0]}: a group's samples share their prompt")
        sent_at = time.time()
        if together and not self._room(prompt, []):
            for i in together:
                self._fail(episodes[i], f"{self.spec}: reset()'s messages are {len(prompt)} tokens, which leave no room in "
                                        f"the model's context of {self.context}")
            together = []
        if together:
            request = Request([task["id"]], [prompt], request_seed(seed), n=len(together), max_tokens=self._room(prompt, []))
            for i in together:
                episodes[i].conversation = Conversation(list(prompt))
            try:
                first = (await inflight.complete(request)).groups[0]
            except Stopped:  # the rollout stopped before it was sent: carried unbegun
                for i in together:
                    episodes[i].finish_reason = ABORTED
                first = []
            await asyncio.gather(*(self._episode(inflight, task, episodes[i], completion, f"{seed}:{i}")
                                   for i, completion in zip(together, first)))
        await asyncio.gather(*(self._close(e) for e in episodes))  # those that opened apart, or not at all
        self.room.count(episodes, spec=self.spec, max_tokens=self.max_tokens, max_turns=self.max_turns)
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
        return decode(prompt), prompt, [e.sample(decode) for e in episodes], sent_at

    async def _open(self, episode: Episode, task: dict) -> list[int] | None:
        """The sample's environment made and reset: the ids of its opening, or None (failed)."""
        try:
            kwargs = environments.arguments(self.environment, task, args=self.args, max_turns=self.max_turns)
        except ValueError as e:
            self._fail(episode, f"{self.spec}: {e}")
            return None
        try:
            episode.env = await self._call(self.environment, task, **kwargs)
            messages = await self._call(episode.env.reset)
        except EnvironmentFailed as e:
            self._fail(episode, str(e))
            return None
        try:
            episode.tools = environments.tools(episode.env)
        except ValueError as e:  # tools that are not schemas
            self._fail(episode, f"{self.spec}: {e}")
            return None
        try:
            return render(self.tokenizer, messages, generation_prompt=True, tools=episode.tools)
        except Exception as e:  # noqa: BLE001 - messages the template cannot render
            self._fail(episode, f"{self.spec}: reset() gave messages the chat template cannot render: {e!r}")
        return None

    async def resume(self, inflight: Inflight, task: dict, record: dict, *, seed: str) -> tuple[str, list[int], list[dict], float]:
        """``record``'s group (carried by a rollout that stopped) continued: its finished samples
        as they are, each stopped one walked to where it was and on (:meth:`_resume`); as
        :meth:`run` returns them."""
        prompt = record["prompt_token_ids"]
        sent_at = time.time()
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
        samples = await asyncio.gather(*(self._resume(inflight, task, prompt, s, f"{seed}:{i}", decode)
                                         if s.get("finish_reason") == ABORTED else _same(s) for i, s in enumerate(record["samples"])))
        return decode(prompt), prompt, list(samples), sent_at

    async def _resume(self, inflight: Inflight, task: dict, prompt: list[int], sample: dict, seed: str, decode) -> dict:
        """A stopped sample continued: a new environment, reset (to the same prompt), given the
        sample's turns again (each answered as it was, or the sample fails), then the stopped
        turn goes on from its ids, or the next one starts."""
        episode = Episode()
        opening = await self._open(episode, task)
        if opening is not None and opening != prompt:
            self._fail(episode, f"{self.spec}: reset() opened a carried sample with other messages than when it was sampled")
        turns = [dict(t) for t in sample["turns"]]
        c = episode.conversation = Conversation(list(prompt), list(sample["token_ids"]), list(sample["loss_mask"]),
                                                list(sample["logprobs"]), turns)
        partial = bool(turns) and turns[-1].get("finish_reason") == ABORTED
        if episode.error is None:
            await self._replay(episode, turns[:-1] if partial else turns)
        first = len(turns) if partial else len(turns) + 1
        room = self._room(c.context, c.token_ids)
        if episode.error is not None or room <= 0 or first > self.max_turns:
            episode.finish_reason = "length" if episode.error is None else episode.finish_reason
            await self._close(episode)
            return episode.sample(decode)
        request = Request([task["id"]], [c.context], request_seed(f"{seed}:{first}:continued"), n=1, max_tokens=room)
        try:
            completion = (await inflight.complete(request)).groups[0][0]
        except Stopped:
            episode.finish_reason = ABORTED
            await self._close(episode)
            return episode.sample(decode)
        if partial:  # the stopped turn goes on: its ids, log-probs and text, one turn
            _extend(c, completion)
        await self._episode(inflight, task, episode, completion, seed, first=first, merged=partial)
        return episode.sample(decode)

    async def _replay(self, episode: Episode, turns: list[dict]) -> None:
        """The environment given ``turns`` (a carried sample's, each with its observation) as
        they were sampled: its rewards and metrics summed up again. One that answers a turn
        otherwise than it did fails the sample."""
        for k, t in enumerate(turns, 1):
            try:
                step = await self._step(episode, Turn(t["text"], t.get("finish_reason") or "stop", t.get("stop")))
                if step.done or step.observation != t.get("observation"):
                    raise EnvironmentFailed(
                        f"{self.spec}: step() answered turn {k} of a carried sample otherwise than when it was sampled; a "
                        f"sample stopped by rollout.partial is continued by giving a new environment its turns again, "
                        f"which needs an environment that answers the same turns the same way")
            except EnvironmentFailed as e:
                self._fail(episode, str(e))
                return

    async def _step(self, episode: Episode, turn: Turn):
        """The environment's answer to ``turn``, its reward and metrics taken in."""
        answer = await self._call(episode.env.step, turn)
        try:
            step = environments.as_step(answer)
        except ValueError as e:
            raise EnvironmentFailed(f"{self.spec}: {e}") from None
        episode.reward = episode.reward + step.reward if self.step_rewards == "sum" else step.reward
        episode.metrics.update(step.metrics)
        return step

    async def _episode(self, inflight: Inflight, task: dict, episode: Episode, completion, seed: str, *, first: int = 1,
                       merged: bool = False) -> None:
        """The sample's turns, then its environment closed, however they ended (cancelled: the
        close is sent to a thread and not waited for)."""
        try:
            await self._turns(inflight, task, episode, completion, seed, first=first, merged=merged)
        except asyncio.CancelledError:
            if episode.env is not None and callable(close := getattr(episode.env, "close", None)):
                self.threads.call(close)
            episode.env = None
            raise
        await self._close(episode)

    async def _turns(self, inflight: Inflight, task: dict, episode: Episode, completion, seed: str, *, first: int = 1,
                     merged: bool = False) -> None:
        """Turns ``first`` on, ``completion`` the first's (``merged``: already in the
        conversation, a stopped turn's continuation)."""
        c = episode.conversation
        for turn in range(first, self.max_turns + 1):
            stop = completion.stop_string
            if not merged:
                c.sampled(completion.token_ids, completion.token_logprobs, completion.text, completion.finish_reason, stop)
            merged = False
            completion = await self._through(inflight, task, c, completion, f"{seed}:{turn}")
            text = c.turns[-1]["text"]
            episode.finish_reason = completion.finish_reason
            if completion.finish_reason == ABORTED:  # stopped in its turn (rollout.partial): carried as it stands
                return
            try:
                step = await self._step(episode, Turn(text, completion.finish_reason, stop))
            except EnvironmentFailed as e:
                self._fail(episode, str(e))
                return
            if step.done or turn == self.max_turns:
                return
            try:
                ids = c.observation(self.tokenizer, step.observation, episode.tools)
            except Exception as e:  # noqa: BLE001 - a role or content the template refuses
                self._fail(episode, f"{self.spec}: step()'s observation cannot be rendered by the chat template: {e!r}")
                return
            room = self._room(c.context + ids, c.token_ids + ids)
            if room <= 0:  # the next turn would have no room: the sample ends here, cut
                episode.finish_reason, episode.cut_for_room = "length", True
                return
            c.observed(step.observation, ids)
            if self.stopping:  # stopped between its turns: carried, its next turn to sample
                episode.finish_reason = ABORTED
                return
            request = Request([task["id"]], [c.context], request_seed(f"{seed}:{turn + 1}"), n=1, max_tokens=room)
            try:
                completion = (await inflight.complete(request)).groups[0][0]
            except Stopped:
                episode.finish_reason = ABORTED
                return

    async def _through(self, inflight: Inflight, task: dict, c: Conversation, completion, seed: str):
        """The turn's last completion: one stopped by another rank's stop of an engine they share
        (not this rollout's: :attr:`stopping`) goes on now, appended to the turn."""
        while completion.finish_reason == ABORTED and not self.stopping and (room := self._room(c.context, c.token_ids)) > 0:
            request = Request([task["id"]], [c.context], request_seed(f"{seed}:{len(c.token_ids)}"), n=1, max_tokens=room)
            try:
                completion = (await inflight.complete(request)).groups[0][0]
            except Stopped:
                break
            _extend(c, completion)
        return completion

    def _room(self, context: list[int], after_prompt: list[int]) -> int:
        """Tokens the next turn may sample: what rl.max_tokens and the context leave."""
        room = self.max_tokens - len(after_prompt)
        return room if self.context is None else min(room, self.context - len(context))

    async def _close(self, episode: Episode) -> None:
        """The sample's environment closed (its ``close()``, when it has one), once: a close that
        fails is the sample's error, as a failing step is."""
        env, episode.env = episode.env, None
        if env is None or not callable(close := getattr(env, "close", None)):
            return
        try:
            await self._call(close)
        except EnvironmentFailed as e:
            if episode.error is None:
                self._fail(episode, str(e))

    async def _call(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` on an environment thread, within ``rl.env_timeout_s`` of its
        start (:meth:`EnvThreads.run`); EnvironmentFailed says which call failed and how."""
        name = getattr(fn, "__qualname__", repr(fn))
        try:
            return await self.threads.run(fn, *args, timeout_s=self.timeout_s, **kwargs)
        except CallTimedOut:
            raise EnvironmentFailed(f"{self.spec}: {name}() took longer than rl.env_timeout_s={self.timeout_s:g}") from None
        except Exception as e:  # noqa: BLE001 - the user's code
            raise EnvironmentFailed(failure(f"{self.spec}: {name}()", e)) from None

    @staticmethod
    def _fail(episode: Episode, error: str) -> None:
        episode.reward, episode.error = 0.0, error

    def close(self) -> None:
        self.threads.close()


def _extend(c: Conversation, completion) -> None:
    """The conversation's last turn, stopped part-way, with ``completion`` (what followed) appended."""
    c.token_ids += completion.token_ids
    c.loss_mask += [1] * len(completion.token_ids)
    c.logprobs += completion.token_logprobs
    c.turns[-1] |= {"text": c.turns[-1]["text"] + completion.text, "tokens": c.turns[-1]["tokens"] + len(completion.token_ids),
                    "finish_reason": completion.finish_reason} | (
        {"stop": completion.stop_string} if completion.stop_string is not None else {})


async def _same(sample: dict) -> dict:
    return sample


def failure(what: str, e: BaseException) -> str:
    """``what`` raised ``e``: the message a sample's ``reward_error`` keeps (the traceback's end)."""
    text = "".join(traceback.format_exception(e))
    return f"{what} raised:\n{text}"[-ERROR_CHARS:]


def request_seed(name: str) -> int:
    """A request's seed, named by what it samples: the same whatever else is in flight."""
    return random.Random(name).randrange(2**31)

