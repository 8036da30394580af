"""On-policy distillation's teacher (``rl.teacher``): the log-prob the teacher model gives each
token a train sample holds, recorded with the sample as ``teacher_logprobs`` (0.0 where the ids
are context, loss mask 0: an environment's observation, an agent's messages), for the update's
per-token reverse KL (train/grpo.py). An agent's earlier segments get theirs too.

The teacher is an auxiliary model (``models.<name>``) served by engines of its own on the
rank's node, asked through an in-flight budget of their own (:class:`Inflight`, requests with
``score_from``): the ids are sent as they are, never tokenized again (the preflight checked
that the teacher and the policy share one tokenizer), and the engine answers with each one's
log-prob under the teacher (prompt log-probs), nothing sampled. A group is scored once it is
complete, all its samples in one request: a carried group (``rollout.partial``) when its last
sample finishes, whole.
"""

from __future__ import annotations

import asyncio
import concurrent.futures

from orchestrator.workloads.rl.engine_requests import Inflight, Request


class TeacherFailed(Exception):
    """The teacher's engine answered another count of log-probs than the ids it was sent."""


class Teacher:
    """Scores complete train records on the teacher's engines (:meth:`submit`)."""

    def __init__(self, inflight: Inflight, name: str):
        self.inflight, self.name = inflight, name

    def submit(self, record: dict) -> concurrent.futures.Future:
        """``record`` with its samples' teacher log-probs, once the teacher has scored them."""
        return self.inflight.spawn(self.score(record))

    async def score(self, record: dict) -> dict:
        """``record`` with every sample scored; one scored already (a complete group carried
        past a rank's share, scored when it first completed) is kept as it is."""
        task_id, prompt, samples = str(record["task_id"]), record["prompt_token_ids"], record["samples"]
        todo = [s for s in samples if "teacher_logprobs" not in s]
        whole = await self._logprobs(task_id, [(prompt, s["token_ids"], s.get("loss_mask")) for s in todo])
        scored = {id(s): {**s, "teacher_logprobs": lps} for s, lps in zip(todo, whole)}
        for s in scored.values():
            if s.get("segments"):  # an agent's earlier segments: each its own prompt
                more = await self._logprobs(task_id, [(g["prompt_token_ids"], g["token_ids"], g.get("loss_mask")) for g in s["segments"]])
                s["segments"] = [{**g, "teacher_logprobs": lps} for g, lps in zip(s["segments"], more)]
        return {**record, "samples": [scored.get(id(s), s) for s in samples]}

    async def _logprobs(self, task_id: str, sequences: list[tuple[list[int], list[int], list[int] | None]]) -> list[list[float]]:
        """Each (prompt, ids, loss mask)'s teacher log-probs of its ids, 0.0 where the mask is 0;
        one request for each prompt length (a group's samples share theirs)."""
        out: list[list[float]] = [[] for _ in sequences]
        by_prompt: dict[int, list[int]] = {}
        for i, (prompt, ids, _mask) in enumerate(sequences):
            if ids:
                by_prompt.setdefault(len(prompt), []).append(i)
        answers = await asyncio.gather(*(self.inflight.complete(Request([task_id], [sequences[i][0] + sequences[i][1] for i in members],
                                                                        0, n=1, score_from=start))
                                         for start, members in by_prompt.items()))
        for members, answer in zip(by_prompt.values(), answers):
            for i, group in zip(members, answer.groups):
                _prompt, ids, mask = sequences[i]
                got = group[0]  # the client checked each log-prob is of the id sent there
                if len(got.token_logprobs or ()) != len(ids):
                    raise TeacherFailed(f"rl.teacher={self.name}: its engine scored {len(got.token_logprobs or ())} ids of task "
                                        f"{task_id}'s sample, not the {len(ids)} sent")
                out[i] = [lp if m else 0.0 for lp, m in zip(got.token_logprobs, mask or [1] * len(ids))]
        return out

    def close(self) -> None:
        self.inflight.close()
