"""An agent's sample carried by a rollout that stopped (``rollout.partial``), continued.

A rollout's stop cuts an agent's sample at its call: a call the engine was sampling keeps what
it had (its turn's finish reason ``abort``); a call made once the stop began (the agent was in
its own code, a tool's say, which it finishes) has its messages recorded and is not sampled;
the agent is then cancelled (a coroutine) or told 409 (a thread). Its code cannot be kept
across iterations, nor across a crash, so the next rollout runs the agent again from the start,
and the endpoint answers each call it made before from the record (:func:`calls`), token for
token, without the engine; the call the stop cut goes on from its ids, and the calls after it
are sampled as any. That needs an agent that, given the same replies, makes the same calls:
each call's prompt ids are checked against the recorded ones, and one that differs fails the
sample, naming the call (reward 0, ``reward_error``, counted as an agent error).
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.data.carry import ABORTED
from orchestrator.engine.client import Completion


@dataclass(frozen=True, slots=True)
class Recorded:
    """One call of a carried sample as it was made."""

    context: list[int]
    """The call's prompt ids."""
    reply: Completion | None
    """What the model answered (finish reason ``abort``: cut by the stop, to go on); None: the
    call the stop came at, never sampled."""


def calls(sample: dict, common: list[int]) -> list[Recorded]:
    """The calls ``sample`` (a carried agent sample, its group's prompt ids ``common``) made, in
    order, the one the stop came at last."""
    last = {"token_ids": sample.get("token_ids") or [], "logprobs": sample.get("logprobs") or [], "turns": sample.get("turns") or []}
    after_prompt = sum(t.get("tokens", 0) + t.get("observation_tokens", 0) for t in last["turns"])
    own = len(last["token_ids"]) - after_prompt  # the segment's prompt past the group's: opens its token_ids
    last = {"prompt_token_ids": list(common) + last["token_ids"][:own], "token_ids": last["token_ids"][own:],
            "logprobs": last["logprobs"][own:], "turns": last["turns"]}
    out: list[Recorded] = []
    for segment in [*sample.get("segments", ()), last]:
        prompt, ids, logprobs, pos = segment["prompt_token_ids"], segment["token_ids"], segment["logprobs"], 0
        for turn in segment["turns"]:
            n = turn.get("tokens", 0)
            context = prompt + ids[:pos]
            out.append(Recorded(context, Completion(turn.get("text", ""), turn.get("finish_reason") or "stop", logprobs[pos:pos + n],
                                                    None, ids[pos:pos + n], context, stop_reason=turn.get("stop"))))
            pos += n + turn.get("observation_tokens", 0)
    if not out and not sample.get("token_ids"):  # stopped before its first call was sampled: nothing to walk through
        return []
    if not out or out[-1].reply.finish_reason != ABORTED:  # stopped between calls: the next one is recorded, not sampled
        out.append(Recorded(last["prompt_token_ids"] + last["token_ids"], None))
    return out


def joined(before: Completion | None, after: Completion) -> Completion:
    """A call's reply cut by a stop (``before``) and what followed it (``after``), as one."""
    if before is None:
        return after
    return Completion(before.text + after.text, after.finish_reason, (before.token_logprobs or []) + (after.token_logprobs or []),
                      None, (before.token_ids or []) + (after.token_ids or []), before.prompt_token_ids, stop_reason=after.stop_reason)
