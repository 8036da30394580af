"""Multi-turn episodes (workloads/rl/episodes.py) against a scripted engine: when a sample
ends (done, rl.max_turns, out of room), what its record holds, and environments that raise,
hang or open differently; what an environment is given (its arguments, max_turns, each turn's
stop reason), what it may answer (a Step or skyrl-gym's dict, rewards per step, metrics), and
its close() called once however the sample ends; with the chat demo's ChatML tokenizer."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from orchestrator.engine.client import Completion
from orchestrator.environments import Step
from orchestrator.data import turns
from orchestrator.workloads.rl.episodes import ROOM_WARNING_MIN_SAMPLES, Episodes, EnvThreads, RoomWatch
from orchestrator.workloads.rl.engine_requests import Answer, Stopped


@pytest.fixture(scope="module")
def tokenizer():
    from orchestrator.demo import chat_tokenizer, tasks, warm_start

    return chat_tokenizer.fast(chat_tokenizer.corpus(tasks.make_tasks(0, chat=True)["train"][:200], warm_start.CHAT.target))


class Engine:
    """Answers each request with ``reply`` (its text's ids, then EOS), and keeps the requests."""

    def __init__(self, tokenizer, reply: str = "<calc>1</calc>", cut: bool = False, stop: str | None = None):
        self.tokenizer, self.reply, self.cut, self.stop, self.requests = tokenizer, reply, cut, stop, []

    async def complete(self, request):
        self.requests.append(request)
        ids = self.tokenizer(self.reply + (self.stop or ""), add_special_tokens=False)["input_ids"]
        ids = ids[: request.max_tokens] if self.cut else ids if self.stop else ids + [self.tokenizer.eos_token_id]
        group = [Completion(self.reply, "length" if self.cut else "stop", [-0.5] * len(ids), None, ids, request.prompts[0],
                            stop_reason=self.stop) for _ in range(request.n)]
        return Answer(request, [group], 0.0, 0.0)


class Tool:
    """A tool message after every turn; done at ``done_at`` with reward 1."""

    done_at = 99

    def __init__(self, task):
        self.task, self.turn = task, 0

    def reset(self):
        return [{"role": "user", "content": self.task["prompt"]}]

    def step(self, completion):
        self.turn += 1
        if self.turn >= self.done_at:
            return Step(reward=1.0, done=True)
        return Step(observation=[{"role": "tool", "content": "42"}], reward=0.25)


def run(tokenizer, env, engine=None, *, n=2, max_turns=3, max_tokens=200, context=None, timeout_s=5.0, task_id="t1", threads=4,
        room=None, task=None, **settings):
    engine = engine or Engine(tokenizer)
    episodes = Episodes(env, "my:Env", tokenizer, max_turns=max_turns, max_tokens=max_tokens, context=context, timeout_s=timeout_s,
                        threads=EnvThreads(threads), room=room or RoomWatch(), **settings)
    try:
        task = {"id": task_id, "prompt": "1+1?", **(task or {})}
        prompt, prompt_ids, samples, _ = asyncio.run(episodes.run(engine, task, n=n, seed="s"))
    finally:
        episodes.close()
    return prompt_ids, samples, engine


def test_each_sample_takes_turns_until_max_turns_with_observations_masked_and_its_steps_rewards_summed(tokenizer):
    prompt_ids, samples, engine = run(tokenizer, Tool, max_turns=3)
    assert prompt_ids == turns.render(tokenizer, [{"role": "user", "content": "1+1?"}], generation_prompt=True)
    first, *later = engine.requests
    assert first.n == 2 and len(later) == 4 and all(r.n == 1 for r in later), "one request of n for the first turn, then one a sample"
    assert len({r.seed for r in later}) == 4, "each sample's turns have seeds of their own"
    reply = tokenizer("<calc>1</calc>", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    obs = turns.observation_ids(tokenizer, [{"role": "tool", "content": "42"}])
    for s in samples:
        assert s["token_ids"] == reply + obs + reply + obs + reply
        assert s["loss_mask"] == [1] * len(reply) + [0] * len(obs) + [1] * len(reply) + [0] * len(obs) + [1] * len(reply)
        assert s["logprobs"] == [-0.5] * len(reply) + [0.0] * len(obs) + [-0.5] * len(reply) + [0.0] * len(obs) + [-0.5] * len(reply)
        assert [t["tokens"] for t in s["turns"]] == [len(reply)] * 3 and s["turns"][0]["observation"] == [{"role": "tool", "content": "42"}]
        assert s["reward"] == 0.75 and s["finish_reason"] == "stop" and "reward_error" not in s
        assert s["text"] == tokenizer.decode(s["token_ids"])
    # the next turn's prompt is everything so far, as ids
    assert later[-1].prompts[0] == prompt_ids + reply + obs + reply + obs
    # rl.step_rewards=last: the last step's reward alone
    _, samples, _ = run(tokenizer, Tool, max_turns=3, step_rewards="last")
    assert [s["reward"] for s in samples] == [0.25, 0.25]


def test_a_sample_ends_when_the_environment_says_done(tokenizer):
    class Done(Tool):
        done_at = 2

    _, samples, engine = run(tokenizer, Done)
    assert all(len(s["turns"]) == 2 and s["reward"] == 1.25 for s in samples) and len(engine.requests) == 3  # 0.25, then 1


def test_a_sample_out_of_room_ends_cut_and_the_observation_that_would_not_fit_is_left_out(tokenizer):
    reply = len(tokenizer("<calc>1</calc>", add_special_tokens=False)["input_ids"]) + 1
    _, samples, engine = run(tokenizer, Tool, n=1, max_tokens=reply + 5)  # the tool's answer takes more than 5
    (s,) = samples
    assert len(s["token_ids"]) == reply and s["finish_reason"] == "length" and "observation" not in s["turns"][0]
    assert engine.requests[0].max_tokens == reply + 5
    # the model's context bounds a turn too
    _, _, engine = run(tokenizer, Tool, n=1, context=40)
    assert all(len(r.prompts[0]) + r.max_tokens == 40 for r in engine.requests)


def test_most_samples_cut_for_room_while_the_environment_wanted_a_turn_warn_once_naming_the_two_keys(tokenizer, caplog):
    reply = len(tokenizer("<calc>1</calc>", add_special_tokens=False)["input_ids"]) + 1
    room = RoomWatch()  # the workload's, kept across the run's rollouts
    with caplog.at_level("WARNING", logger="orchestrator.workloads.rl.episodes"):
        for task_id in ("t1", "t2"):  # the observation never fits: every sample ends after its first turn
            _, samples, _ = run(tokenizer, Tool, n=ROOM_WARNING_MIN_SAMPLES, max_tokens=reply + 5, room=room, task_id=task_id)
            assert all(len(s["turns"]) == 1 and s["finish_reason"] == "length" for s in samples)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1, warnings
    assert "rl.max_tokens=" + str(reply + 5) in warnings[0] and "rl.max_turns=3" in warnings[0]
    assert f"{ROOM_WARNING_MIN_SAMPLES} of {ROOM_WARNING_MIN_SAMPLES} samples" in warnings[0]


def test_samples_that_end_done_at_max_turns_or_cut_in_few_cases_warn_of_nothing(tokenizer, caplog):
    class Done(Tool):
        done_at = 1

    reply = len(tokenizer("<calc>1</calc>", add_special_tokens=False)["input_ids"]) + 1
    room = RoomWatch()
    with caplog.at_level("WARNING", logger="orchestrator.workloads.rl.episodes"):
        run(tokenizer, Done, n=ROOM_WARNING_MIN_SAMPLES, max_tokens=reply + 5, room=room)  # done before room matters
        run(tokenizer, Tool, n=ROOM_WARNING_MIN_SAMPLES, max_turns=3, room=room)  # all three turns fit
        run(tokenizer, Tool, n=ROOM_WARNING_MIN_SAMPLES, max_tokens=reply + 5, room=room)  # cut, but a third of all
    assert (room.ended, room.cut_for_room) == (3 * ROOM_WARNING_MIN_SAMPLES, ROOM_WARNING_MIN_SAMPLES)
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_an_environment_that_raises_or_hangs_ends_its_sample_with_reward_0_and_the_error(tokenizer):
    release = threading.Event()

    class Faulty(Tool):
        calls = 0

        def step(self, completion):
            Faulty.calls += 1
            if Faulty.calls == 1:
                raise ZeroDivisionError("boom")
            if Faulty.calls == 2:
                release.wait(30)  # hangs past the timeout
            return super().step(completion)

    began = time.monotonic()
    _, samples, _ = run(tokenizer, Faulty, n=3, timeout_s=0.5)
    release.set()
    assert time.monotonic() - began < 10
    errors = sorted(s.get("reward_error", "") for s in samples)
    assert errors[0] == "" and samples[[s.get("reward_error", "") for s in samples].index("")]["reward"] == 0.75
    assert "ZeroDivisionError: boom" in errors[1] + errors[2] and "took longer than rl.env_timeout_s=0.5" in errors[1] + errors[2]
    assert all(s["reward"] == 0.0 for s in samples if "reward_error" in s)


def test_the_timeout_counts_from_a_calls_start_not_while_it_waits_for_a_thread(tokenizer):
    class Slow(Tool):
        done_at = 1

        def step(self, completion):
            time.sleep(0.3)
            return super().step(completion)

    began = time.monotonic()
    _, samples, _ = run(tokenizer, Slow, n=3, timeout_s=0.5, threads=1)  # the third waits 0.6 s for the one thread
    assert time.monotonic() - began >= 0.9
    assert all("reward_error" not in s and s["reward"] == 1.0 for s in samples)


def test_an_environment_that_fails_to_open_gives_an_empty_sample_and_the_tasks_prompt_stands_in(tokenizer):
    class NoReset(Tool):
        def reset(self):
            raise RuntimeError("no sandbox")

    prompt_ids, samples, engine = run(tokenizer, NoReset)
    assert not engine.requests and prompt_ids == turns.render(tokenizer, [{"role": "user", "content": "1+1?"}], generation_prompt=True)
    assert all(s["token_ids"] == [] and s["reward"] == 0.0 and "RuntimeError: no sandbox" in s["reward_error"] for s in samples)

    class Different(Tool):
        opened = 0

        def reset(self):
            Different.opened += 1
            return [{"role": "user", "content": f"variant {Different.opened}"}]

    _, samples, engine = run(tokenizer, Different, n=2)
    assert engine.requests[0].n == 1 and "a group's samples share their prompt" in samples[1]["reward_error"]


def test_a_step_that_returns_something_else_than_a_step_is_an_error(tokenizer):
    class Wrong(Tool):
        def step(self, completion):
            return {"reward": 1.0}

    _, samples, _ = run(tokenizer, Wrong, n=1)
    assert "returned a dict with keys ['reward']: skyrl-gym's BaseTextEnvStepOutput" in samples[0]["reward_error"]

    class Other(Tool):
        def step(self, completion):
            return 1.0

    _, samples, _ = run(tokenizer, Other, n=1)
    assert "returned float, not an orchestrator.environments.Step" in samples[0]["reward_error"]


def test_a_dict_in_skyrl_gyms_shape_is_a_step_and_metrics_keep_each_names_last_value(tokenizer):
    class Skyrl(Tool):
        def step(self, completion):
            self.turn += 1
            if self.turn == 3:
                return {"observations": [], "reward": 1.0, "done": True, "metadata": {"calls": 3, "note": "text is left out"}}
            return {"observations": [{"role": "user", "content": "again"}], "reward": None, "done": False,
                    "metadata": {"calls": self.turn, "first": 1.0}, "postprocessed_action": "ignored"}

    _, samples, _ = run(tokenizer, Skyrl, n=2, max_turns=5)
    for s in samples:
        assert "reward_error" not in s and s["reward"] == 1.0 and len(s["turns"]) == 3
        assert s["turns"][0]["observation"] == [{"role": "user", "content": "again"}]
        assert s["metrics"] == {"calls": 3.0, "first": 1.0}

    class Metrics(Tool):
        done_at = 2

        def step(self, completion):
            step = super().step(completion)
            return Step(step.observation, step.reward, step.done, metrics={"turn": float(self.turn)})

    _, samples, _ = run(tokenizer, Metrics, n=1)
    assert samples[0]["metrics"] == {"turn": 2.0}
    with pytest.raises(ValueError, match="Step.metrics must map names to finite numbers"):
        Step(metrics={"x": float("nan")})


def test_the_environment_gets_its_arguments_and_max_turns_when_it_takes_them(tokenizer):
    made = []

    class Args(Tool):
        def __init__(self, task, *, max_turns, level=1, seed=0):
            super().__init__(task)
            made.append((max_turns, level, seed))

    run(tokenizer, Args, n=1, max_turns=3, args={"level": 4})
    run(tokenizer, Args, n=1, max_turns=2, args={"level": 4, "seed": 7}, task={"environment_args": {"level": 9}})
    assert made == [(3, 4, 0), (2, 9, 7)], "rl.environment_args, updated by the task's environment_args column; max_turns"

    class Kwargs(Tool):
        def __init__(self, task, **extras):
            super().__init__(task)
            made.append(extras)

    made.clear()
    run(tokenizer, Kwargs, n=1, max_turns=3, args={"level": 4})
    run(tokenizer, Kwargs, n=1, max_turns=3, args={"max_turns": 9})
    assert made == [{"level": 4, "max_turns": 3}, {"max_turns": 9}]
    run(tokenizer, Tool, n=1, max_turns=3)  # one that takes the task alone is made with it alone
    _, samples, engine = run(tokenizer, Tool, n=2, args={"level": 4})
    assert not engine.requests
    assert all("Tool() takes no argument level (from rl.environment_args or the task's environment_args column)"
               in s["reward_error"] for s in samples)


def test_each_turn_reaches_the_environment_with_its_finish_reason_and_stop_string(tokenizer):
    seen = []

    class Watch(Tool):
        done_at = 2

        def step(self, completion):
            seen.append((str(completion), completion.finish_reason, completion.stop, isinstance(completion, str)))
            return super().step(completion)

    _, samples, _ = run(tokenizer, Watch, Engine(tokenizer, reply="<sql>x", stop="</sql>"), n=1)
    assert seen == [("<sql>x", "stop", "</sql>", True)] * 2
    assert samples[0]["turns"][0]["finish_reason"] == "stop" and samples[0]["turns"][0]["stop"] == "</sql>"
    seen.clear()
    _, samples, _ = run(tokenizer, Watch, Engine(tokenizer, cut=True), n=1, max_tokens=4, max_turns=1)
    assert seen == [(samples[0]["turns"][0]["text"], "length", None, True)] and "stop" not in samples[0]["turns"][0]


def test_close_is_called_once_per_sample_however_it_ends_and_a_failing_close_is_the_samples_error(tokenizer):
    closed = []

    def closing(base):
        class Closing(base):
            def close(self):
                closed.append(self.task["id"])
        return Closing

    class Raises(Tool):
        def step(self, completion):
            raise RuntimeError("step fails")

    class NoReset(Tool):
        def reset(self):
            raise RuntimeError("no sandbox")

    class Done(Tool):
        done_at = 1

    for i, base in enumerate((Tool, Done, Raises, NoReset)):  # max turns, done, a step that raises, a reset that raises
        run(tokenizer, closing(base), n=3, task_id=f"t{i}")
    assert sorted(closed) == [f"t{i}" for i in range(4) for _ in range(3)]

    class Different(Tool):
        opened = 0

        def reset(self):
            Different.opened += 1
            return [{"role": "user", "content": f"variant {Different.opened}"}]

    closed.clear()
    run(tokenizer, closing(Different), n=3, task_id="d")  # two samples never take a turn
    assert closed == ["d"] * 3

    class BadClose(Done):
        def close(self):
            raise OSError("sandbox gone")

    _, samples, _ = run(tokenizer, BadClose, n=2)
    assert all(s["reward"] == 0.0 and "close() raised" in s["reward_error"] and "OSError: sandbox gone" in s["reward_error"]
               for s in samples)


def test_an_environments_tools_are_rendered_with_its_prompt_and_observations(tokenizer):
    schema = {"type": "function", "function": {"name": "calc", "parameters": {"type": "object", "properties": {"expression": {}}}}}

    class WithTools(Tool):
        tools = [schema]

    prompt_ids, samples, engine = run(tokenizer, WithTools, max_turns=2)
    opening = [{"role": "user", "content": "1+1?"}]
    assert prompt_ids == turns.render(tokenizer, opening, generation_prompt=True, tools=[schema])
    assert tokenizer.decode(prompt_ids).startswith("<|im_start|>system\nTools: calc(expression)<|im_end|>\n<|im_start|>user")
    observation = turns.observation_ids(tokenizer, [{"role": "tool", "content": "42"}], [schema])
    sampled = samples[0]["token_ids"][: samples[0]["loss_mask"].index(0)]
    assert engine.requests[-1].prompts[0] == prompt_ids + sampled + observation, "observations rendered with the tools too"

    class BadTools(Tool):
        tools = "calc"

    _, samples, _ = run(tokenizer, BadTools)
    assert all(s["reward"] == 0.0 and "WithTools" not in s["reward_error"] and "BadTools.tools must be a list of function schemas"
               in s["reward_error"] for s in samples), samples[0].get("reward_error")


class Stopping(Engine):
    """The first turn as :class:`Engine` answers it; the later ones as the rollout's stop of
    ``episodes`` leaves them: stopped part-way (``<calc>``, finish reason abort), or never sent
    (Stopped)."""

    def __init__(self, tokenizer, how: str):
        super().__init__(tokenizer)
        self.how, self.episodes = how, None

    async def complete(self, request):
        if not self.requests:
            return await super().complete(request)
        self.requests.append(request)
        self.episodes.stopping = True
        if self.how == "unsent":
            raise Stopped()
        ids = self.tokenizer("<calc>", add_special_tokens=False)["input_ids"]
        return Answer(request, [[Completion("<calc>", "abort", [-0.25] * len(ids), None, ids, request.prompts[0])]], 0.0, 0.0)


def _stopped(tokenizer, env, how: str) -> tuple[list[int], list[dict]]:
    """One sample of ``env`` through :class:`Stopping`: (the prompt's ids, the samples)."""
    engine = Stopping(tokenizer, how)
    episodes = engine.episodes = Episodes(env, "my:Env", tokenizer, max_turns=3, max_tokens=200, context=None, timeout_s=5.0,
                                          threads=EnvThreads(2))
    try:
        _text, prompt_ids, samples, _ = asyncio.run(episodes.run(engine, {"id": "t1", "prompt": "1+1?"}, n=1, seed="s"))
    finally:
        episodes.close()
    return prompt_ids, samples


def test_a_turn_stopped_by_another_ranks_stop_of_a_shared_engine_goes_on_at_once(tokenizer):
    """An abort this rollout did not ask for (another rank paused the engine they share) is
    not a cut: the turn is asked to go on, and the sample ends as if never stopped."""
    engine = Stopping(tokenizer, "in-its-turn")
    engine.episodes = type("Other", (), {"stopping": False})()  # the stop is another's
    answered = []

    async def complete(request):
        if len(engine.requests) < 2:
            return await Stopping.complete(engine, request)
        engine.episodes.stopping = False
        answered.append(request)
        return await Engine.complete(engine, request)

    engine.complete = complete
    _ids, [done], _ = run(tokenizer, Tool, engine, n=1, max_turns=2)
    assert done["finish_reason"] == "stop" and done["turns"][1]["text"] == "<calc><calc>1</calc>" and len(done["turns"]) == 2
    assert answered[0].prompts[0][-len(_calc_ids(tokenizer)):] == _calc_ids(tokenizer), "from the ids it had"


def _calc_ids(tokenizer):
    return tokenizer("<calc>", add_special_tokens=False)["input_ids"]


class Counted(Tool):
    steps: list[str] = []

    def step(self, completion):
        Counted.steps.append(str(completion))
        return super().step(completion)


@pytest.mark.parametrize("how", ["in-its-turn", "unsent"])
def test_a_stopped_sample_is_continued_where_it_was_its_environment_given_its_turns_again(tokenizer, how):
    """rollout.partial: a sample stopped in its second turn (or before it was sent) ends with
    finish reason abort and no reward; continued, a new environment is reset and given the first
    turn again, and the sample goes on from its ids: the second turn's text is what it had and
    what followed, its reward the steps' summed as if never stopped."""
    Counted.steps = []
    prompt_ids, [cut] = _stopped(tokenizer, Counted, how)
    assert cut["finish_reason"] == "abort" and "reward" not in cut and Counted.steps == ["<calc>1</calc>"]
    assert len(cut["turns"]) == (2 if how == "in-its-turn" else 1)
    Counted.steps = []
    engine = Engine(tokenizer)
    episodes = Episodes(Counted, "my:Env", tokenizer, max_turns=3, max_tokens=200, context=None, timeout_s=5.0, threads=EnvThreads(2))
    try:
        _text, ids, [done], _ = asyncio.run(episodes.resume(engine, {"id": "t1", "prompt": "1+1?"},
                                                            {"prompt_token_ids": prompt_ids, "samples": [cut]}, seed="s2"))
    finally:
        episodes.close()
    assert ids == prompt_ids and done["finish_reason"] == "stop" and len(done["turns"]) == 3
    assert done["token_ids"][: len(cut["token_ids"])] == cut["token_ids"] and done["logprobs"][: len(cut["logprobs"])] == cut["logprobs"]
    second = "<calc><calc>1</calc>" if how == "in-its-turn" else "<calc>1</calc>"
    assert Counted.steps == ["<calc>1</calc>", second, "<calc>1</calc>"], "turn 1 again, then the rest"
    assert done["turns"][1]["text"] == second and done["reward"] == pytest.approx(0.75)
    assert engine.requests[0].prompts[0] == prompt_ids + cut["token_ids"], "it goes on from the ids it had"


class Replies(Tool):
    """Answers turn 1 otherwise each time it is made: a carried sample cannot be walked back."""

    made = 0

    def __init__(self, task):
        super().__init__(task)
        Replies.made += 1

    def step(self, completion):
        step = super().step(completion)
        return Step(observation=[{"role": "tool", "content": str(Replies.made)}]) if self.turn == 1 else step


def test_an_environment_that_answers_a_replayed_turn_otherwise_fails_the_carried_sample(tokenizer):
    prompt_ids, [cut] = _stopped(tokenizer, Replies, "unsent")
    episodes = Episodes(Replies, "my:Env", tokenizer, max_turns=3, max_tokens=200, context=None, timeout_s=5.0, threads=EnvThreads(2))
    try:
        _t, _ids, [done], _ = asyncio.run(episodes.resume(Engine(tokenizer), {"id": "t1", "prompt": "1+1?"},
                                                          {"prompt_token_ids": prompt_ids, "samples": [cut]}, seed="s2"))
    finally:
        episodes.close()
    assert done["reward"] == 0.0 and "answered turn 1 of a carried sample otherwise" in done["reward_error"]
