"""A verifiers taskset (verifiers.v1) of the chat demo's sums, written as any verifiers
environment is: tasks, a stop condition and a reward. It knows nothing of the orchestrator.

    PYTHONPATH=examples/verifiers ./run.sh --data-path demo-chat \\
        rl.agent=verifiers:demo_sums data.train_file=verifiers:demo_sums data.test_file=verifiers:demo_sums

The model sees "What is 12+34? Put the answer in \\boxed{}."; the reward is 1 when the last
\\boxed{...} of its reply holds the sum.
"""

import random
import re

import verifiers.v1 as vf

QUESTION = "What is {a}+{b}? Put the answer in \\boxed{{}}."
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


class SumData(vf.TaskData):
    answer: str
    """The sum, as text."""


class SumTask(vf.Task[SumData]):
    @vf.stop
    async def one_reply(self, trace: vf.Trace) -> bool:
        return trace.num_turns >= 1

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        reply = trace.assistant_messages[-1].content if trace.assistant_messages else ""
        boxed = _BOXED.findall(reply or "")
        return float(bool(boxed) and boxed[-1].strip() == self.data.answer)


class SumConfig(vf.TasksetConfig):
    seed: int = 0
    max_operand: int = 49


class SumTaskset(vf.Taskset[SumTask, SumConfig]):
    def load(self) -> list[SumTask]:
        n = self.config.max_operand + 1
        pairs = [(a, b) for a in range(n) for b in range(n)]
        random.Random(self.config.seed).shuffle(pairs)
        return [SumTask(SumData(prompt=QUESTION.format(a=a, b=b), answer=str(a + b)), self.config.task) for a, b in pairs]


__all__ = ["SumTaskset"]
