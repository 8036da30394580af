"""`orchestrator demo-data`: make the demo tasks and base model (no download)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from orchestrator import identity, terminal
from orchestrator.demo import DEFAULT_SEED, DEFAULT_WARM_STEPS
from orchestrator.errors import EXIT_BAD_INPUT


@click.command("demo-data")
@click.option("--data-path", required=True, type=click.Path(path_type=Path), help="Absolute directory to write the demo into.")
@click.option("--seed", type=int, default=DEFAULT_SEED, show_default=True, help="Seeds the tasks, the model and its warm start.")
@click.option("--warm-steps", type=int, default=DEFAULT_WARM_STEPS, show_default=True, help="Supervised warm-start steps of the base model.")
def demo_data(data_path: Path, seed: int, warm_steps: int) -> None:
    """Write synthetic tasks and a tiny warm-started Llama-style model under --data-path."""
    if not data_path.is_absolute():
        terminal.abort(f"--data-path must be an absolute path, got {data_path}", EXIT_BAD_INPUT)
    if warm_steps < 0:
        terminal.abort(f"--warm-steps must be >= 0, got {warm_steps}", EXIT_BAD_INPUT)
    terminal.setup_logging(None, identity.host())
    from orchestrator.demo.build import build

    with terminal.err.status("making the demo data (about 15 s on a laptop CPU)"):
        manifest = build(data_path, seed=seed, warm_steps=warm_steps)
    terminal.out.print(json.dumps(manifest, indent=2), markup=False)
