"""The chat demo's judge (``demo-data --chat --judge``): a tiny chat model in ``<data-path>/judge``
that answers ``yes`` or ``no`` to the judge's default question about a completion of a chat-demo
task, for runs with ``rl.reward=orchestrator.rewards:judge`` and ``models.judge.path=judge``.

The question is :data:`orchestrator.plugins.judge.DEFAULT_TEMPLATE` filled in for a task and a
completion (``render``), sent as one user message through the judge's chat template with the
generation prompt, as a run's rollout asks it; the answer is ``yes`` when the completion's final
answer is the task's (what ``orchestrator.rewards:math`` rewards, compared as the chat demo's
warm start compares: ``rewards.final_answer(completion) == task["answer"]``), else ``no``, then
``<|im_end|>``.

Its examples (:func:`examples`) are four completions of each task, two right and two wrong, of
the kinds the chat demo's policy writes early in RL: the right ``\\boxed{42}`` (twice, or once
and the plain ``42`` or the unclosed ``\\boxed{42``), the hard negative ``\\boxed{}`` with one digit
changed, and one other wrong one: digits swapped (a quarter of them: a judge learns to compare
the digits as a bag first), off by one, off by ten, a random number, a truncated ``\\boxed{4``,
wrong plain digits, or nothing. Each task's are drawn from the seed and its id, so they do not
depend on the other tasks.

The model is the chat demo's kind (demo/model.py's ``create_chat``: Qwen2, 128 positions) with a
BPE tokenizer of its own (demo/chat_tokenizer.py) trained on the judge's conversations. It is
trained with the warm start's machinery (demo/warm_start.py: ``Trainer``, ``to_band``) on the
judge examples of the chat demo's fit tasks until its greedy answers on those of the validation
tasks (the last ``VALIDATION_TASKS`` of train) are right in :data:`ACCURACY_BAND`; the test
tasks' examples give its test accuracy. Deterministic for a seed on one machine; the directory is
written under a temp name and renamed into place.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import time
from pathlib import Path

from orchestrator.data import tasks as data_tasks
from orchestrator.demo import VALIDATION_TASKS, chat_tokenizer, warm_start
from orchestrator.demo import model as demo_model
from orchestrator.demo import tasks as demo_tasks
from orchestrator.plugins import judge as judge_words
from orchestrator.plugins import rewards

log = logging.getLogger(__name__)

DIRECTORY = "judge"
"""The judge's model directory under --data-path (``models.judge.path=judge``)."""
TEMPLATE = judge_words.DEFAULT_TEMPLATE
"""The question it learns to answer: the judge's default template (``judge.template`` unset)."""
ACCURACY_BAND = (0.90, 1.0)
"""Greedy accuracy on the validation tasks' judge examples at which its training stops: 0.90
took 600 to 900 steps on seeds 0 to 3, 0.95 700 to over 1,200 (docs/demo.md)."""
MAX_STEPS = 1500
BATCH_SIZE = 64
LR = 7e-4
INIT_STD = 0.1
"""The initial weights' standard deviation: from the config's 0.02 the answer stayed at chance
(always yes, or always no) for some hundreds of steps more; at lr 1e-3 and 0.07 seeds 2 and 3
had not reached 0.90 in 1,200 steps."""
CHECK_EVERY = 25
"""Steps between checks of its validation accuracy (800 examples): past the band's low end is
all a check looks for, and checking every 5 steps would take a fifth of the time."""
YES, NO = "yes", "no"


def verdict(task: dict, completion: str) -> str:
    """What the judge should answer: ``yes`` when ``orchestrator.rewards:math`` rewards the
    completion, read as the chat demo's warm start reads it (the final answer, compared exactly)."""
    return YES if rewards.final_answer(completion) == task["answer"] else NO


def completions(task: dict, seed: int) -> list[str]:
    """The four completions of ``task`` the judge learns from: two right, two wrong (see the
    module's docstring), drawn from ``seed`` and the task's id."""
    return [completion for _, completion in kinds(task, seed)]


def kinds(task: dict, seed: int) -> list[tuple[str, str]]:
    """:func:`completions` with the kind of each: (kind, completion)."""
    rng = random.Random(f"judge {seed} {task['id']}")
    answer = task["answer"]
    right = rng.choice(_RIGHT)
    wrong = rng.choice(_WRONG)
    return [("boxed", demo_tasks.boxed(answer)), (right.__name__.strip("_"), right(answer, rng)),
            ("one_digit_changed", demo_tasks.boxed(_one_digit_changed(answer, rng))), (wrong.__name__.strip("_"), wrong(answer, rng))]


def _boxed(answer: str, rng: random.Random) -> str:
    return demo_tasks.boxed(answer)


def _digits(answer: str, rng: random.Random) -> str:
    return answer


def _unclosed(answer: str, rng: random.Random) -> str:
    """Cut off before the box's brace: the final answer is still the last number."""
    return "\\boxed{" + answer


def _one_digit_changed(answer: str, rng: random.Random) -> str:
    """``answer`` with one of its digits replaced by another (no leading zero)."""
    i = rng.randrange(len(answer))
    digits = [d for d in "0123456789" if d != answer[i] and not (d == "0" and i == 0 and len(answer) > 1)]
    return answer[:i] + rng.choice(digits) + answer[i + 1 :]


def _other(answer: str, value: int) -> str:
    return str(value) if str(value) != answer else str(int(answer) + 1)


def _off_by_one(answer: str, rng: random.Random) -> str:
    n = int(answer)
    return demo_tasks.boxed(str(n + 1 if n == 0 else n + rng.choice((-1, 1))))


def _off_by_ten(answer: str, rng: random.Random) -> str:
    n = int(answer)
    return demo_tasks.boxed(str(n + 10 if n < 10 else n - 10 if n > 89 else n + rng.choice((-10, 10))))


def _swapped(answer: str, rng: random.Random) -> str:
    """The two digits swapped; where that is no other number (``33``, ``7``) or would start with a
    zero (``40``), one digit changed."""
    swapped = answer[::-1]
    if len(answer) != 2 or swapped == answer or swapped[0] == "0":
        swapped = _one_digit_changed(answer, rng)
    return demo_tasks.boxed(swapped)


def _random(answer: str, rng: random.Random) -> str:
    return demo_tasks.boxed(_other(answer, rng.randrange(99)))


def _truncated(answer: str, rng: random.Random) -> str:
    """Cut off inside the box, before the answer's last digit: ``\\boxed{4`` of 42, ``\\boxed{``."""
    return "\\boxed{" + answer[: rng.randrange(len(answer))]


def _plain(answer: str, rng: random.Random) -> str:
    return _other(answer, rng.randrange(99))


def _empty(answer: str, rng: random.Random) -> str:
    return ""


_RIGHT = (_boxed, _boxed, _digits, _unclosed)
"""The second right completion of a task: ``\\boxed{42}`` again (half the time), ``42``, or ``\\boxed{42``."""
_WRONG = (_swapped, _swapped, _off_by_one, _off_by_ten, _random, _truncated, _plain, _empty)


def examples(tasks: list[dict], seed: int) -> list[dict]:
    """The judge's examples of ``tasks`` (chat-demo tasks): per task and completion, the question
    as the judge is asked it (one user message: ``render(TEMPLATE, task, completion)``) and the
    ``verdict`` it should give."""
    out = []
    for task in tasks:
        for k, (kind, completion) in enumerate(kinds(task, seed)):
            out.append({"id": f"{task['id']}-{k}", "task": task["id"], "kind": kind, "completion": completion,
                        "prompt": [{"role": "user", "content": judge_words.render(TEMPLATE, task, completion)}],
                        "verdict": verdict(task, completion)})
    return out


def _prompt(example: dict, tokenizer) -> str:
    return data_tasks.render(example["prompt"], tokenizer)  # the chat template with the generation prompt, as a run asks


def _target(example: dict) -> str:
    return example["verdict"]


def _correct(example: dict, completion: str) -> bool:
    return completion == example["verdict"]


FORMAT = warm_start.Format(_prompt, _target, _correct, max_new_tokens=2, kv_cache=True)
"""The question -> ``yes`` or ``no``; right when the greedy answer, up to ``<|im_end|>``, is the verdict."""


def settings_of(seed: int, band: warm_start.Band, max_steps: int, steps: int | None) -> dict:
    return {"seed": seed, "steps_fixed": steps} | ({"accuracy_band": [band.low, band.high], "max_steps": max_steps} if steps is None else {})


def build(data_path: Path, splits: dict[str, list[dict]], *, seed: int, existing: dict | None = None,
          band: warm_start.Band | None = None, max_steps: int = MAX_STEPS, steps: int | None = None) -> dict:
    """Make ``<data-path>/judge`` for the chat demo's ``splits`` and return its entry of demo.json,
    or return ``existing`` (the entry there) when it was made with the same settings and template
    and the model is there. Trains until :data:`ACCURACY_BAND` (``band``) within ``max_steps``, or
    exactly ``steps`` steps; raises warm_start.WarmStartError when the band is not reached, and
    nothing is written then."""
    band = band or warm_start.Band(*ACCURACY_BAND)
    settings = settings_of(seed, band, max_steps, steps)
    final = data_path / DIRECTORY
    if (existing is not None and existing.get("settings") == settings and existing.get("template") == TEMPLATE
            and (final / "model.safetensors").is_file()):
        log.info("the judge under %s is already there", final)
        return existing
    started = time.monotonic()
    fit, validation = splits["train"][:-VALIDATION_TASKS], splits["train"][-VALIDATION_TASKS:]
    train_examples, validation_examples = examples(fit, seed), examples(validation, seed)
    tokenizer_made = chat_tokenizer.fast(chat_tokenizer.corpus(train_examples + validation_examples, _target))
    model = demo_model.create_chat(seed, tokenizer_made, INIT_STD)
    staging = data_path / f".judge.{os.getpid()}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    demo_model.save(model, staging, tokenizer_made)
    _, tokenizer = demo_model.load(staging)
    try:
        trainer = warm_start.Trainer(model, tokenizer, train_examples, validation_examples, seed=seed, batch_size=BATCH_SIZE, lr=LR,
                                     fmt=FORMAT)
        if steps is None:
            log.info("training the judge on %d examples until its greedy accuracy on %d validation examples is in %s",
                     len(train_examples), len(validation_examples), band)
            try:
                result = warm_start.to_band(trainer, band=band, max_steps=max_steps, check_every=CHECK_EVERY)
            except warm_start.WarmStartError as e:  # its advice (--max-warm-steps, --accuracy-band) is the policy's
                raise warm_start.WarmStartError(
                    f"the judge's greedy accuracy on its {len(validation_examples)} validation examples is "
                    f"{trainer.accuracy():.3f} after {max_steps} steps, still below its band {band} (demo/judge.py); the chat "
                    "demo is made: try another --seed") from e
        else:
            losses = trainer.train(steps)
            result = warm_start.WarmStart(steps, trainer.accuracy(), losses)
        test_examples = examples(splits["test"], seed)
        test_accuracy = FORMAT.accuracy(model, tokenizer, test_examples)
        demo_model.save(model, staging, tokenizer_made)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    shutil.rmtree(final, ignore_errors=True)
    os.replace(staging, final)
    entry = {
        "settings": settings,
        "path": DIRECTORY,
        "template": TEMPLATE,
        "steps": result.steps,
        "final_loss": round(result.losses[-1], 4) if result.losses else None,
        "validation_accuracy": result.validation_accuracy,
        "test_accuracy": test_accuracy,
        "examples": {"train": len(train_examples), "validation": len(validation_examples), "test": len(test_examples)},
        "yes_fraction": round(sum(e["verdict"] == YES for e in train_examples) / len(train_examples), 3),
        "seconds": round(time.monotonic() - started, 1),
    }
    log.info("the judge is ready under %s: %d steps, greedy accuracy %.3f on validation, %.3f on test",
             final, result.steps, result.validation_accuracy, test_accuracy)
    return entry
