"""`orchestrator demo-data`: make the demo tasks and base model (no download)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from orchestrator import terminal
from orchestrator.demo import (
    CHAT_ACCURACY_BAND,
    CHAT_MAX_WARM_STEPS,
    DEFAULT_ACCURACY_BAND,
    DEFAULT_MAX_WARM_STEPS,
    DEFAULT_SEED,
    TOOLS_ACCURACY_BAND,
    TOOLS_MAX_TOKENS,
    TOOLS_MAX_WARM_STEPS,
    defaults,
)
from orchestrator.errors import EXIT_BAD_INPUT, EXIT_ERROR
from orchestrator.node import identity


def _band(band: tuple[float, float]) -> str:
    return ",".join(map(str, band))


def _default(plain: str, chat: str, tools: str) -> str:
    """The default as click writes one, and the chat and tool demos' where they differ."""
    others = "".join(f"; with --{flag}, {value}" for flag, value in (("chat", chat), ("tools", tools)) if value != plain)
    return f"  [default: {plain}{others}]"


@click.command("demo-data")
@click.option("--data-path", required=True, type=click.Path(path_type=Path), help="Absolute directory to write the demo into.")
@click.option("--seed", type=int, default=DEFAULT_SEED, show_default=True,
              help="Seeds the tasks, the model and its warm start. `run` has its own seed (the `seed=N` override).")
@click.option("--accuracy-band", default=None, metavar="LOW,HIGH",
              help="The warm start stops once greedy accuracy on a validation split of train is in this band."
                   + _default(_band(DEFAULT_ACCURACY_BAND), _band(CHAT_ACCURACY_BAND), _band(TOOLS_ACCURACY_BAND)))
@click.option("--max-warm-steps", type=int, default=None, metavar="N",
              help="Give up (exit 1) if the band is not reached within N warm-start steps."
                   + _default(str(DEFAULT_MAX_WARM_STEPS), str(CHAT_MAX_WARM_STEPS), str(TOOLS_MAX_WARM_STEPS)))
@click.option("--warm-steps", type=int, default=None, metavar="N",
              help="Exactly N warm-start steps instead of stopping in the band.")
@click.option("--chat", is_flag=True, default=False,
              help="The chat demo: the same tasks as chat messages answered in \\boxed{}, a tiny Qwen2-style model with a "
                   "BPE tokenizer and a chat template, graded by the math reward (demo.json names it for its runs).")
@click.option("--tools", is_flag=True, default=False,
              help="The tool demo: products of three- and two-digit numbers, worked out over two turns with a calculator "
                   "(the environment orchestrator.demo.calculator:Calculator) and answered in \\boxed{}, by the chat demo's "
                   "kind of model. Not with --chat.")
@click.option("--judge", is_flag=True, default=False,
              help="The chat demo plus a judge model in D/judge (D: --data-path) for rl.reward=orchestrator.rewards:judge, "
                   "models.judge.path=judge: it answers yes or no, whether a completion's final answer is the task's. "
                   "Only with --chat.")
def demo_data(data_path: Path, seed: int, accuracy_band: str | None, max_warm_steps: int | None, warm_steps: int | None,
              chat: bool, tools: bool, judge: bool) -> None:
    """Write synthetic tasks and a tiny warm-started Llama-style model (with --chat, a
    Qwen2-style chat model) under --data-path."""
    if not data_path.is_absolute():
        terminal.abort(f"--data-path must be an absolute path, got {data_path}", EXIT_BAD_INPUT)
    if chat and tools:
        terminal.abort("--chat and --tools make two different demos: give one of them", EXIT_BAD_INPUT)
    if judge and not chat:
        terminal.abort("--judge is the chat demo's judge: give it with --chat", EXIT_BAD_INPUT)
    if warm_steps is not None and warm_steps < 0:
        terminal.abort(f"--warm-steps must be >= 0, got {warm_steps}", EXIT_BAD_INPUT)
    default_band, default_steps = defaults(chat=chat, tools=tools)
    accuracy_band = _band(default_band) if accuracy_band is None else accuracy_band
    max_warm_steps = default_steps if max_warm_steps is None else max_warm_steps
    if max_warm_steps < 1:
        terminal.abort(f"--max-warm-steps must be >= 1, got {max_warm_steps}", EXIT_BAD_INPUT)
    from orchestrator.demo import warm_start

    try:
        low, high = (float(x) for x in accuracy_band.split(","))
        band = warm_start.Band(low, high)
    except ValueError as e:
        terminal.abort(f"--accuracy-band {accuracy_band!r}: give LOW,HIGH with 0 <= LOW < HIGH <= 1 ({e})", EXIT_BAD_INPUT)
    terminal.setup_logging(None, identity.host())
    from orchestrator.demo.build import build

    with terminal.err.status(f"making the demo data (about {'a minute' if tools or judge else 'half a minute'} on a laptop CPU)"):
        try:
            manifest = build(data_path, seed=seed, band=band, max_warm_steps=max_warm_steps, warm_steps=warm_steps, chat=chat,
                             tools=tools, judge=judge)
        except warm_start.WarmStartError as e:
            terminal.abort(f"demo-data (seed {seed}): {e}", EXIT_ERROR)
    terminal.out.print(json.dumps(manifest, indent=2), markup=False)
    # stdout is the manifest alone (JSON); the hint goes with the logs
    if chat:
        terminal.err.print(f"the chat demo is graded by the math reward, which {data_path / 'demo.json'} names for its runs, e.g.\n"
                           f"  python3 -m orchestrator run --data-path {data_path} --log-path LOG_PATH --rl-phase both --eval-interval 3 "
                           "--max-iterations 10", markup=False)
    if judge:
        terminal.err.print(f"its judge is {data_path / 'judge'}: a run graded by it, with the math reward for eval, e.g.\n"
                           f"  python3 -m orchestrator run --data-path {data_path} --log-path LOG_PATH --rl-phase both --eval-interval 3 "
                           "--max-iterations 10 rl.reward=orchestrator.rewards:judge judge.model=judge models.judge.path=judge "
                           "rl.eval_reward=orchestrator.rewards:math", markup=False)
    if tools:
        terminal.err.print(f"the tool demo runs with the calculator as its environment, graded by the math reward (both named by "
                           f"{data_path / 'demo.json'} for its runs), in {TOOLS_MAX_TOKENS} tokens a sample (both turns and the "
                           f"calculator's answer), e.g.\n"
                           f"  python3 -m orchestrator run --data-path {data_path} --log-path LOG_PATH --rl-phase both --eval-interval 3 "
                           f"--max-iterations 10 rl.max_tokens={TOOLS_MAX_TOKENS} rl.max_turns=3", markup=False)
