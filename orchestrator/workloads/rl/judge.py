"""The LLM judge (``rl.reward=orchestrator.rewards:judge``): each sample's reward is a judge
model's verdict on its completion, asked once the sample's group is complete and recorded with
it (``reward``; the judge's words as ``judge_reply``).

The judge is a model beside the policy (``judge.model``, a ``models.<name>``) served by engines
of its own on the rank's node, asked through an in-flight budget of their own
(:class:`Inflight`): a group's questions in one request. Each question is ``judge.template``
filled in for the task and the completion (plugins/judge.py), rendered as one user message by
the judge's chat template, sent as token ids; the reply (at most ``judge.max_tokens``, and what
the judge's context leaves, at ``judge.temperature``) is read by ``judge.parse``. A question the
judge cannot be asked (a ``{task[column]}`` the task lacks, a prompt that leaves no room for a
reply in the judge's context) or a reply with no verdict
scores the sample 0 with the error recorded (``reward_error``), counted against
``rl.max_reward_error_fraction`` as a failing reward is. A judge engine that fails, fails the
rank, as the policy's engines do.
"""

from __future__ import annotations

import concurrent.futures
import random
import traceback

from orchestrator.config import JudgeConfig
from orchestrator.plugins import judge as words
from orchestrator.workloads.rl.engine_requests import Inflight, Request
from orchestrator.workloads.rl.scoring import ERROR_CHARS


MIN_REPLY = 8
"""The fewest tokens a judge's reply may have: a question that leaves less room in its context
is a reward error. A reply is at most judge.max_tokens, and no longer than the context leaves."""


class Judge:
    """Scores complete records' unscored samples with the judge's verdicts (:meth:`submit`)."""

    def __init__(self, inflight: Inflight, config: JudgeConfig, template: str, tokenizer, context: int | None, tasks: dict[str, dict],
                 seed: str):
        """``tokenizer``: the judge model's; ``context``: its longest sequence (None: unknown); ``tasks``: the
        rollout's, by id; ``seed``: the rollout's (run seed, split, iteration), which with the
        task and the sample seeds each question's draws."""
        self.inflight, self.config, self.template = inflight, config, template
        self.tokenizer, self.context, self.tasks, self.seed = tokenizer, context, tasks, seed

    def submit(self, record: dict) -> concurrent.futures.Future:
        """``record`` with each of its samples without a reward judged."""
        return self.inflight.spawn(self.score(record))

    async def score(self, record: dict) -> dict:
        task = self.tasks[str(record["task_id"])]
        samples = list(record["samples"])
        asked: list[tuple[int, list[int]]] = []
        for j, s in enumerate(samples):
            if "reward" in s:
                continue
            try:
                asked.append((j, self._question(task, s["text"])))
            except Exception:  # noqa: BLE001 - a question that cannot be asked: the sample's reward error
                samples[j] = _failed(s, traceback.format_exc())
        if asked:
            seed = random.Random(f"{self.seed}:{task['id']}").randrange(2**31)
            room = min(self.config.max_tokens, *(self.context - len(ids) for _, ids in asked)) if self.context else self.config.max_tokens
            answer = await self.inflight.complete(Request([str(task["id"])], [ids for _, ids in asked], seed, n=1, max_tokens=room))
            for (j, _ids), group in zip(asked, answer.groups):
                reply = group[0].text
                try:
                    reward = words.score(reply, self.config.parse, self.config.max_score)
                except words.Unjudged as e:
                    samples[j] = _failed(samples[j], f"judge.model={self.config.model}: {e}", reply)
                    continue
                samples[j] = {**samples[j], "reward": reward, "judge_reply": reply}
        return {**record, "samples": samples}

    def _question(self, task: dict, completion: str) -> list[int]:
        """The judge's prompt ids for ``completion``; ValueError when it leaves no room for a
        reply in the judge's context."""
        text = words.render(self.template, task, completion)
        if getattr(self.tokenizer, "chat_template", None):
            ids = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        else:
            ids = self.tokenizer(text)["input_ids"]
        if self.context and len(ids) + MIN_REPLY > self.context:
            raise ValueError(f"the judge's prompt is {len(ids)} tokens: it leaves no room for a reply of {MIN_REPLY} in the judge "
                             f"model's context of {self.context} (a shorter judge.template, or a judge with a longer context)")
        return ids

    def close(self) -> None:
        self.inflight.close()


def _failed(sample: dict, error: str, reply: str | None = None) -> dict:
    return {**sample, "reward": 0.0, "reward_error": error[-ERROR_CHARS:]} | ({"judge_reply": reply} if reply is not None else {})
