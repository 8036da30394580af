"""`orchestrator demo-data`: make the demo tasks and base model (no download)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from orchestrator import terminal
from orchestrator.demo import DEFAULT_ACCURACY_BAND, DEFAULT_MAX_WARM_STEPS, DEFAULT_SEED
from orchestrator.errors import EXIT_BAD_INPUT, EXIT_ERROR
from orchestrator.node import identity


@click.command("demo-data")
@click.option("--data-path", required=True, type=click.Path(path_type=Path), help="Absolute directory to write the demo into.")
@click.option("--seed", type=int, default=DEFAULT_SEED, show_default=True,
              help="Seeds the tasks, the model and its warm start. `run` has its own seed (the `seed=N` override).")
@click.option("--accuracy-band", default=",".join(map(str, DEFAULT_ACCURACY_BAND)), show_default=True, metavar="LOW,HIGH",
              help="The warm start stops once greedy accuracy on a validation split of train is in this band.")
@click.option("--max-warm-steps", type=int, default=DEFAULT_MAX_WARM_STEPS, show_default=True,
              help="Give up (exit 1) if the band is not reached within this many warm-start steps.")
@click.option("--warm-steps", type=int, default=None, help="Exactly this many warm-start steps instead of stopping in the band.")
def demo_data(data_path: Path, seed: int, accuracy_band: str, max_warm_steps: int, warm_steps: int | None) -> None:
    """Write synthetic tasks and a tiny warm-started Llama-style model under --data-path."""
    if not data_path.is_absolute():
        terminal.abort(f"--data-path must be an absolute path, got {data_path}", EXIT_BAD_INPUT)
    if warm_steps is not None and warm_steps < 0:
        terminal.abort(f"--warm-steps must be >= 0, got {warm_steps}", EXIT_BAD_INPUT)
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

    with terminal.err.status("making the demo data (about half a minute on a laptop CPU)"):
        try:
            manifest = build(data_path, seed=seed, band=band, max_warm_steps=max_warm_steps, warm_steps=warm_steps)
        except warm_start.WarmStartError as e:
            terminal.abort(f"demo-data (seed {seed}): {e}", EXIT_ERROR)
    terminal.out.print(json.dumps(manifest, indent=2), markup=False)
