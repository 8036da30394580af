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
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import random
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

BATCH_SIZE = 128
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


class _Examples:
    """Every task tokenized once as ``prompt answer </s>`` with labels on the answer and
    ``</s>`` only; ``batch`` pads a selection."""

    def __init__(self, tokenizer, tasks: list[dict]):
        self.pad = tokenizer.pad_token_id
        self.rows, self.labels = [], []
        prompts = tokenizer([t["prompt"] for t in tasks])["input_ids"]
        answers = tokenizer([t["answer"] for t in tasks], add_special_tokens=False)["input_ids"]
        for prompt, answer in zip(prompts, answers):
            answer = answer + [tokenizer.eos_token_id]
            self.rows.append(prompt + answer)
            self.labels.append([-100] * len(prompt) + answer)

    def __len__(self) -> int:
        return len(self.rows)

    def batch(self, indices: list[int]):
        import torch

        rows = [self.rows[i] for i in indices]
        width = max(map(len, rows))
        ids = torch.tensor([r + [self.pad] * (width - len(r)) for r in rows])
        labels = torch.tensor([self.labels[i] + [-100] * (width - len(self.labels[i])) for i in indices])
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
        return ids, labels, mask


class Trainer:
    """The model, its optimizer and the batch generator: what the band walk steps, checks,
    snapshots and rolls back."""

    def __init__(self, model, tokenizer, tasks: list[dict], validation: list[dict], *, seed: int, batch_size: int = BATCH_SIZE, lr: float = LR):
        import torch

        torch.manual_seed(seed)
        self.model, self.tokenizer, self.validation = model, tokenizer, validation
        self.examples = _Examples(tokenizer, tasks)
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
        return greedy_accuracy(self.model, self.tokenizer, self.validation)

    def snapshot(self):
        return copy.deepcopy(self.model.state_dict()), copy.deepcopy(self.optimizer.state_dict()), self.rng.getstate()

    def restore(self, snapshot) -> None:
        weights, optimizer_state, rng_state = snapshot
        self.model.load_state_dict(weights)
        self.optimizer.load_state_dict(optimizer_state)
        self.rng.setstate(rng_state)


def to_band(trainer: Trainer, *, band: Band, max_steps: int) -> WarmStart:
    """Train until the validation accuracy is in ``band``; the model is left there.

    Checks every ``CHECK_EVERY`` steps. A check above the band restores the previous check
    and walks on one step at a time at half the learning rate. Raises WarmStartError when
    ``max_steps`` pass first, or when the model still jumps over the band after
    ``MAX_ROLLBACKS`` halvings.
    """
    result = WarmStart(steps=0, validation_accuracy=trainer.accuracy(), lr=trainer.lr)
    if result.validation_accuracy > band.high:
        raise WarmStartError(f"the untrained model already scores {result.validation_accuracy:.3f}, above the band {band}")
    every = CHECK_EVERY
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


def greedy_accuracy(model, tokenizer, tasks: list[dict], max_new_tokens: int = 4) -> float:
    """Share of tasks whose greedy completion (up to ``</s>``) equals the answer."""
    import torch

    correct = 0
    with torch.inference_mode():
        for start in range(0, len(tasks), 256):
            chunk = tasks[start : start + 256]
            enc = [tokenizer(t["prompt"])["input_ids"] for t in chunk]
            width = max(map(len, enc))
            pad = tokenizer.pad_token_id
            ids = torch.tensor([[pad] * (width - len(e)) + e for e in enc])
            mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in enc])
            out = []
            for _ in range(max_new_tokens):
                pos = (mask.cumsum(-1) - 1).clamp(min=0)
                nxt = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1].argmax(-1)
                out.append(nxt)
                ids = torch.cat([ids, nxt[:, None]], 1)
                mask = torch.cat([mask, torch.ones_like(nxt)[:, None]], 1)
            gen = torch.stack(out, 1).tolist()
            for t, g in zip(chunk, gen):
                if tokenizer.eos_token_id in g:
                    g = g[: g.index(tokenizer.eos_token_id)]
                correct += tokenizer.decode(g, skip_special_tokens=True) == t["answer"]
    return correct / len(tasks)
