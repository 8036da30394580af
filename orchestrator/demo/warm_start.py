"""A supervised warm start of the demo model that stops when the model lands in an accuracy
band, so RL starts from a policy that is clearly better than chance and clearly short of
perfect on whatever CPU the demo is made on.

Why a band rather than a step count: accuracy on these tasks rises along a cliff (a few
dozen steps take it from 10% to 80%), so a fixed step count amplifies any floating-point
difference between CPUs' kernels into anywhere from 7% to 90%. Checking greedy accuracy on
a validation split (carved from train, never test) every few steps and stopping inside the
band lands in the band everywhere. A check that finds the model already past the band goes
back to the previous check and walks on with half the learning rate, one step at a time.

Deterministic for a seed on one machine: the batches come from a seeded generator and
rollbacks restore the model, the optimizer and that generator exactly.

A :class:`Format` says what the model is taught and how its answer is graded: :data:`PLAIN`
for the default demo (``17+25=`` -> ``42``, exact match), :data:`CHAT` for the chat demo
(the chat-rendered question -> ``\\boxed{42}``, graded as ``orchestrator.rewards:math`` does).
:class:`Turns` is a multi-turn one, :data:`TOOLS` the tool demo's: the model's turns and the
environment's answers as the rollout makes them, token for token.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import random
from dataclasses import dataclass, field
from typing import Callable

from orchestrator.plugins import environments, rewards
from orchestrator.data import tasks as data_tasks
from orchestrator.data.turns import Conversation, observation_ids, render
from orchestrator.demo import calculator
from orchestrator.demo import tasks as demo_tasks

log = logging.getLogger(__name__)

BATCH_SIZE = 128
CHAT_BATCH_SIZE = 64
"""The chat demo's: its answers need attention over a 24-token prompt, which batches of 64
learn in about half the steps of batches of 128 (batches of 32 had not reached 0.15 after 1200
steps; docs/demo.md)."""
TOOLS_BATCH_SIZE = 64
"""The tool demo's, as the chat demo's: its turns copy digits from a 32-token prompt."""
LR = 3e-3
CHECK_EVERY = 5
MAX_ROLLBACKS = 4


class WarmStartError(RuntimeError):
    """The warm start could not land in the band; the message says what to try."""


@dataclass(frozen=True, slots=True)
class Band:
    """Greedy validation accuracy the base model must land in, both ends included."""

    low: float
    high: float

    def __post_init__(self) -> None:
        if not 0 <= self.low < self.high <= 1:
            raise ValueError(f"the accuracy band must satisfy 0 <= low < high <= 1, got {self.low},{self.high}")

    def __str__(self) -> str:
        return f"[{self.low:.2f}, {self.high:.2f}]"


@dataclass(slots=True)
class WarmStart:
    """What a warm start did."""

    steps: int
    validation_accuracy: float
    losses: list[float] = field(default_factory=list)
    rollbacks: int = 0
    lr: float = LR
    """The learning rate of the last step (halved at each rollback)."""


@dataclass(frozen=True, slots=True)
class Format:
    """What the warm start teaches for a task, and how a greedy completion is graded."""

    prompt: Callable[[dict, object], str]
    """The text the model continues, from the task and the tokenizer."""
    target: Callable[[dict], str]
    """The completion it learns; the tokenizer's EOS follows it."""
    correct: Callable[[dict, str], bool]
    """Whether a greedy completion (decoded up to EOS, special tokens skipped) is right."""
    max_new_tokens: int
    """Tokens the greedy check generates."""
    kv_cache: bool = False
    """Whether the greedy check decodes with the model's KV cache (``model.generate``): seven
    times faster on the chat demo's 24-token prompts. The default demo recomputes the whole
    sequence at every token, as when its figures in docs/rl.md were measured."""

    def examples(self, tokenizer, tasks: list[dict]) -> "_Examples":
        return _Examples(tokenizer, tasks, self)

    def accuracy(self, model, tokenizer, tasks: list[dict]) -> float:
        return greedy_accuracy(model, tokenizer, tasks, self)


@dataclass(frozen=True, slots=True)
class Turns:
    """A multi-turn format: the model's turns (``targets``) and an environment's answers to
    them, in the ids a multi-turn rollout makes (orchestrator/data/turns.py): the
    prompt's, each turn's with its EOS, and the observation's after it. The check runs the
    same loop, the environment's reward deciding, greedily or at ``temperature``."""

    environment: type
    """The environment class (orchestrator/plugins/environments.py), made anew per task."""
    targets: Callable[[dict], list[str]]
    """The model's turns it learns, each followed by the tokenizer's EOS."""
    max_new_tokens: int
    """Tokens the check generates a turn."""
    max_turns: int = 2
    temperature: float = 0.0
    """The check's sampling temperature; 0: greedy."""

    @property
    def tools(self) -> list[dict] | None:
        """The environment's function schemas, which the chat template renders with its messages."""
        return environments.tools(self.environment)

    def conversation(self, task: dict) -> list[dict]:
        """The whole target conversation as chat messages (what the tokenizer learns from,
        with :attr:`tools`)."""
        env = self.environment(task)
        messages = list(env.reset())
        for turn in self.targets(task):
            messages += [{"role": "assistant", "content": turn}, *env.step(turn).observation]
        return messages

    def examples(self, tokenizer, tasks: list[dict]) -> "_Examples":
        return _TurnExamples(tokenizer, tasks, self)

    def accuracy(self, model, tokenizer, tasks: list[dict]) -> float:
        return turns_accuracy(model, tokenizer, tasks, self)


def _task_prompt(task: dict, tokenizer) -> str:
    return task["prompt"]


def _answer(task: dict) -> str:
    return task["answer"]


def _is_answer(task: dict, completion: str) -> bool:
    return completion == task["answer"]


def _chat_prompt(task: dict, tokenizer) -> str:
    return data_tasks.render(task["prompt"], tokenizer)  # as the rollout renders it


def _boxed_answer(task: dict) -> str:
    return demo_tasks.boxed(task["answer"])


def _boxed_correct(task: dict, completion: str) -> bool:
    """The math reward's final answer (``rewards.final_answer``: the last ``\\boxed{}``, else the
    last number), compared exactly: math-verify's equivalences never apply to the digits these
    tasks want, and it would take most of the warm start's time (3 ms a call)."""
    return rewards.final_answer(completion) == task["answer"]


PLAIN = Format(_task_prompt, _answer, _is_answer, max_new_tokens=4)
"""The default demo: ``17+25=`` -> ``42``, exact match."""
CHAT = Format(_chat_prompt, _boxed_answer, _boxed_correct, max_new_tokens=8, kv_cache=True)
"""The chat demo: the chat-rendered question -> ``\\boxed{42}``, graded as the math reward
grades it, within rl.max_tokens' default of 8 tokens."""


class _Calculator(calculator.Calculator):
    """The check's calculator: an answer graded as the chat demo's check grades it
    (:func:`_boxed_correct`), since math-verify takes 50-400 ms on what a model early in its warm
    start boxes (``\\boxed{calc>1}``), most of the warm start's time."""

    reward = staticmethod(lambda task, completion: float(_boxed_correct(task, completion)))


TOOLS = Turns(_Calculator, lambda task: [demo_tasks.tool_call(task), demo_tasks.boxed(task["answer"])],
              max_new_tokens=32, temperature=0.5)
"""The tool demo: ``<tool_call>{"name": "calc", "arguments": {"expression": "123*45"}}</tool_call>``,
the calculator's ``5535``, then ``\\boxed{5535}``, graded by the calculator (the math reward's
final answer, compared exactly); 32 tokens a turn, room for the longest. Checked at the run's eval temperature (rl.eval_temperature,
0.5), not greedily: copying the digits is learned along a cliff, and where greedy accuracy is
0.35 each digit is still nearly a coin toss, so that the run's eval (and its rollouts, at 1.0)
would find almost nothing right (docs/demo.md)."""
CHECK_SEED = 0
"""Seeds a sampled check's draws, the same at every check: the check is a function of the weights."""


class _Examples:
    """Every task tokenized once as ``prompt target EOS`` (``17+25=`` ``42`` ``</s>`` by
    default) with labels on the target and EOS only; ``batch`` pads a selection."""

    def __init__(self, tokenizer, tasks: list[dict], fmt: Format = PLAIN):
        self.pad = tokenizer.pad_token_id
        self.rows, self.labels = [], []
        prompts = tokenizer([fmt.prompt(t, tokenizer) for t in tasks])["input_ids"]
        answers = tokenizer([fmt.target(t) for t in tasks], add_special_tokens=False)["input_ids"]
        for prompt, answer in zip(prompts, answers):
            answer = answer + [tokenizer.eos_token_id]
            self.rows.append(prompt + answer)
            self.labels.append([-100] * len(prompt) + answer)

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, row: list[int], labels: list[int]) -> None:
        self.rows.append(row)
        self.labels.append(labels)

    def batch(self, indices: list[int]):
        import torch

        rows = [self.rows[i] for i in indices]
        width = max(map(len, rows))
        ids = torch.tensor([r + [self.pad] * (width - len(r)) for r in rows])
        labels = torch.tensor([self.labels[i] + [-100] * (width - len(self.labels[i])) for i in indices])
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
        return ids, labels, mask


class _TurnExamples(_Examples):
    """Every task's whole conversation as one row: the prompt's ids (the chat template's,
    with the generation prompt), then per turn its ids and EOS, labelled, and the ids of the
    environment's answer, as :func:`observation_ids` renders them for the rollout, not."""

    def __init__(self, tokenizer, tasks: list[dict], fmt: Turns):
        self.pad, self.rows, self.labels = tokenizer.pad_token_id, [], []
        for task in tasks:
            env = fmt.environment(task)
            row = render(tokenizer, env.reset(), generation_prompt=True, tools=fmt.tools)
            labels = [-100] * len(row)
            for turn in fmt.targets(task):
                ids = tokenizer(turn, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                observation = env.step(turn).observation
                context = observation_ids(tokenizer, observation, fmt.tools) if observation else []
                row, labels = row + ids + context, labels + ids + [-100] * len(context)
            self.add(row, labels)


class Trainer:
    """The model, its optimizer and the batch generator: what the band walk steps, checks,
    snapshots and rolls back."""

    def __init__(self, model, tokenizer, tasks: list[dict], validation: list[dict], *, seed: int, batch_size: int = BATCH_SIZE,
                 lr: float = LR, fmt: Format = PLAIN):
        import torch

        torch.manual_seed(seed)
        self.model, self.tokenizer, self.validation, self.fmt = model, tokenizer, validation, fmt
        self.examples = fmt.examples(tokenizer, tasks)
        self.rng = random.Random(seed)
        self.batch_size = batch_size
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    @lr.setter
    def lr(self, value: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = value

    def train(self, steps: int) -> list[float]:
        """``steps`` supervised steps on batches drawn from the seeded generator; their losses."""
        self.model.train()
        losses = []
        for _ in range(steps):
            ids, labels, mask = self.examples.batch(self.rng.sample(range(len(self.examples)), min(self.batch_size, len(self.examples))))
            loss = self.model(input_ids=ids, attention_mask=mask, labels=labels).loss
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()
            losses.append(loss.item())
        self.model.eval()
        return losses

    def accuracy(self) -> float:
        return self.fmt.accuracy(self.model, self.tokenizer, self.validation)

    def snapshot(self):
        return copy.deepcopy(self.model.state_dict()), copy.deepcopy(self.optimizer.state_dict()), self.rng.getstate()

    def restore(self, snapshot) -> None:
        weights, optimizer_state, rng_state = snapshot
        self.model.load_state_dict(weights)
        self.optimizer.load_state_dict(optimizer_state)
        self.rng.setstate(rng_state)


def to_band(trainer: Trainer, *, band: Band, max_steps: int, check_every: int = CHECK_EVERY) -> WarmStart:
    """Train until the validation accuracy is in ``band``; the model is left there.

    Checks every ``check_every`` steps. A check above the band restores the previous check
    and walks on one step at a time at half the learning rate. Raises WarmStartError when
    ``max_steps`` pass first, or when the model still jumps over the band after
    ``MAX_ROLLBACKS`` halvings.
    """
    result = WarmStart(steps=0, validation_accuracy=trainer.accuracy(), lr=trainer.lr)
    if result.validation_accuracy > band.high:
        raise WarmStartError(f"the untrained model already scores {result.validation_accuracy:.3f}, above the band {band}")
    every = check_every
    last_check = (trainer.snapshot(), copy.deepcopy(result))
    while result.validation_accuracy < band.low:
        if result.steps >= max_steps:
            raise WarmStartError(
                f"validation accuracy is {result.validation_accuracy:.3f} after {result.steps} warm-start steps, still below the "
                f"band {band}: raise --max-warm-steps, or lower the band with --accuracy-band"
            )
        n = min(every, max_steps - result.steps)
        result.losses += trainer.train(n)
        result.steps += n
        result.validation_accuracy = trainer.accuracy()
        if result.validation_accuracy > band.high:
            if result.rollbacks == MAX_ROLLBACKS:
                raise WarmStartError(
                    f"validation accuracy jumped over the band {band} to {result.validation_accuracy:.3f} at step "
                    f"{result.steps}, even at learning rate {trainer.lr:g}: widen the band with --accuracy-band"
                )
            snapshot, before = last_check
            lr = trainer.lr / 2  # restoring the optimizer also restores the learning rate of the snapshot
            log.info("step %d: validation accuracy %.3f is past the band %s; back to step %d at half the learning rate",
                     result.steps, result.validation_accuracy, band, before.steps)
            trainer.restore(snapshot)
            trainer.lr = lr
            result = dataclasses.replace(before, losses=list(before.losses), rollbacks=result.rollbacks + 1, lr=lr)
            every = 1
            continue
        log.info("warm start step %d: loss %.3f, validation accuracy %.3f", result.steps, result.losses[-1], result.validation_accuracy)
        last_check = (trainer.snapshot(), copy.deepcopy(result))
    return result


def greedy_accuracy(model, tokenizer, tasks: list[dict], fmt: Format = PLAIN) -> float:
    """Share of tasks whose greedy completion (up to the first EOS: the tokenizer's or one
    of the generation config's, as the engine stops) ``fmt`` grades correct."""
    import torch

    eos = model.generation_config.eos_token_id
    stop = {tokenizer.eos_token_id} | set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    correct = 0
    with torch.inference_mode():
        for start in range(0, len(tasks), 256):
            chunk = tasks[start : start + 256]
            enc = [tokenizer(fmt.prompt(t, tokenizer))["input_ids"] for t in chunk]
            width = max(map(len, enc))
            pad = tokenizer.pad_token_id
            ids = torch.tensor([[pad] * (width - len(e)) + e for e in enc])
            mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in enc])
            if fmt.kv_cache:
                gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=fmt.max_new_tokens, do_sample=False,
                                     pad_token_id=pad)[:, width:].tolist()
            else:
                out = []
                for _ in range(fmt.max_new_tokens):
                    pos = (mask.cumsum(-1) - 1).clamp(min=0)
                    nxt = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1].argmax(-1)
                    out.append(nxt)
                    ids = torch.cat([ids, nxt[:, None]], 1)
                    mask = torch.cat([mask, torch.ones_like(nxt)[:, None]], 1)
                gen = torch.stack(out, 1).tolist()
            for t, g in zip(chunk, gen):
                ends = [i for i, token in enumerate(g) if token in stop]
                if ends:
                    g = g[: ends[0]]
                correct += fmt.correct(t, tokenizer.decode(g, skip_special_tokens=True))
    return correct / len(tasks)


def turns_accuracy(model, tokenizer, tasks: list[dict], fmt: Turns) -> float:
    """Mean reward of the multi-turn loop as the rollout runs it, greedy or sampled at
    ``fmt.temperature``: each turn generated up to the first EOS (or ``fmt.max_new_tokens``),
    its text given to the environment, and, if it is not done, the turn closed with the
    tokenizer's EOS and the observation's ids appended before the next. A sample not done
    after ``fmt.max_turns`` scores 0."""
    import torch

    with torch.random.fork_rng(devices=[]):  # the draws are the check's own; the caller's generator is untouched
        torch.manual_seed(CHECK_SEED)
        return _turns_reward(model, tokenizer, tasks, fmt) / len(tasks)


def _turns_reward(model, tokenizer, tasks: list[dict], fmt: Turns) -> float:
    envs = [fmt.environment(t) for t in tasks]
    conversations = [Conversation(render(tokenizer, env.reset(), generation_prompt=True, tools=fmt.tools)) for env in envs]
    reward = [0.0] * len(tasks)
    active = list(range(len(tasks)))
    for _ in range(fmt.max_turns):
        turns = _turns(model, tokenizer, [conversations[i].context for i in active], fmt.max_new_tokens, fmt.temperature)
        going = []
        for i, ids in zip(active, turns):
            text = tokenizer.decode(ids, skip_special_tokens=True)
            step = envs[i].step(text)
            if step.done:
                reward[i] = step.reward
                continue
            c = conversations[i]  # the turn closed and the observation appended as the rollout does
            c.sampled(ids, [0.0] * len(ids), text)
            c.observed(step.observation, c.observation(tokenizer, step.observation, fmt.tools))
            going.append(i)
        active = going
    return sum(reward)


def _turns(model, tokenizer, contexts: list[list[int]], max_new_tokens: int, temperature: float) -> list[list[int]]:
    """Each context's turn, greedy or sampled at ``temperature`` (KV cache, left padding), up to
    and including its first end token: the tokenizer's EOS or one of the generation config's,
    as the engine stops."""
    import torch

    eos = model.generation_config.eos_token_id
    stop = {tokenizer.eos_token_id} | set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    pad, turns = tokenizer.pad_token_id, []
    with torch.inference_mode():
        for start in range(0, len(contexts), 256):
            chunk = contexts[start : start + 256]
            width = max(map(len, chunk))
            ids = torch.tensor([[pad] * (width - len(c)) + c for c in chunk])
            mask = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in chunk])
            sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature else dict(do_sample=False)
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, pad_token_id=pad,
                                 **sampling)[:, width:].tolist()
            for g in out:
                ends = [i for i, token in enumerate(g) if token in stop]
                turns.append(g[: ends[0] + 1] if ends else g)
    return turns
