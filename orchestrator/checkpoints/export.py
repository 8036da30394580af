"""`orchestrator export`: a run's policy at one iteration as a plain Hugging Face model
directory, which ``AutoModelForCausalLM.from_pretrained`` and vLLM load as they are.

A LoRA checkpoint (``train.lora_rank``) is merged into its base with peft
(``merge_and_unload``): W = W_base + (lora_alpha / r) B A, saved as safetensors. A whole
checkpoint is copied without what only the run needs (the optimizer state, the training
stats, the manifest), in full precision: a checkpoint that publishes 16-bit weights
(``publish.dtype``) gives its fp32 master weights (``master/``) in their place. Either way the checkpoint is first checked against its manifest, and
the directory appears whole or not at all (written beside ``--out``, then renamed). Read-only
over the run.
"""

from __future__ import annotations

import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

from orchestrator import checkpoints
from orchestrator.checkpoints import deltas, node_copy, store
from orchestrator.errors import BadInput
from orchestrator.protocol import fsio
from orchestrator.protocol.layout import RunLayout, checkpoint_iteration

_RUN_ONLY = {checkpoints.MANIFEST, "train_stats.json", deltas.INDEX}


@dataclass(frozen=True, slots=True)
class Exported:
    iteration: int
    source: Path
    out: Path
    merged_from: Path | None
    """The base the adapter was merged into (LoRA), else None."""
    master: bool
    """The fp32 master weights were written in place of the published 16-bit ones."""
    rebuilt: bool
    """Only the published weights exist (a delta, without the training state): they were
    rebuilt from their chain, in the published dtype."""
    bytes: int


def find(log_path: Path, iteration: int | None) -> tuple[int, Path]:
    """The checkpoint of ``iteration`` (None: the current policy). Raises BadInput naming the
    iterations that do have one."""
    layout = RunLayout(log_path)
    if iteration is None:
        current = fsio.read_record(layout.current_checkpoint)
        if current is None:
            raise BadInput(f"{log_path} has no published checkpoint yet ({layout.current_checkpoint} is missing): "
                           f"nothing was trained to export")
        return current["iteration"], layout.root / current["path"]
    path = layout.checkpoint(iteration)
    if not path.is_dir():
        kept = sorted(i for p in (layout.checkpoints.iterdir() if layout.checkpoints.is_dir() else ())
                      if (i := checkpoint_iteration(p.name)) is not None)
        raise BadInput(f"{log_path} has no checkpoint of iteration {iteration} ({path}); it has "
                       + (f"iteration(s) {', '.join(map(str, kept))}" if kept else "none")
                       + " (checkpoint.keep_last and checkpoint.keep_every decide which are kept)")
    return iteration, path


def export(log_path: Path, iteration: int | None, out: Path, base: Path | None = None) -> Exported:
    """Write the policy of ``iteration`` into ``out``, which must not exist (or be empty).
    ``base``: with LoRA, the base model (default: the one the adapter names). Raises BadInput
    before writing anything for a missing checkpoint, base or a taken ``out``, and
    CheckpointCorrupt for a checkpoint that does not match its manifest."""
    iteration, source = find(log_path, iteration)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise BadInput(f"--out {out} exists and is not an empty directory: choose a new one")
    adapter = checkpoints.is_adapter(source)
    if adapter:
        base = base or Path(checkpoints.adapter_base(source))
        if not (base / "config.json").is_file():
            raise BadInput(f"the checkpoint of iteration {iteration} is a LoRA adapter of {base}, which is not a model directory "
                           f"here: give the base model with --base-model")
    master = not adapter and checkpoints.master_dir(source) is not None
    checkpoints.verify(source, checkpoints.ALL if master else checkpoints.WEIGHTS)  # what an export reads
    rebuilt = not master and deltas.needs_base(source)  # only the published weights, as a delta: rebuilt from its chain
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.export-{uuid.uuid4().hex[:8]}"
    try:
        if adapter:
            _merge(source, base, staging)
        elif rebuilt:
            _rebuild(log_path, iteration, staging)
        else:
            _copy(source, staging)
        if out.exists():
            out.rmdir()  # empty, checked above
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    return Exported(iteration, source, out, base if adapter else None, master, rebuilt, size)


def _rebuild(log_path: Path, iteration: int, into: Path) -> None:
    """The published weights of ``iteration`` rebuilt from the chain of deltas they end
    (checkpoints/node_copy.py), in the published dtype."""
    layout, scratch = RunLayout(log_path), into.parent / f"{into.name}.chain"
    try:
        built = node_copy.NodeCopies(layout, scratch).get(store.Checkpoint(layout.checkpoint(iteration), iteration))
        shutil.copytree(built, into)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _merge(adapter: Path, base: Path, into: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(base, use_safetensors=True)
    merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    merged.save_pretrained(into)
    AutoTokenizer.from_pretrained(base).save_pretrained(into)


def _copy(source: Path, into: Path) -> None:
    into.mkdir()
    master = checkpoints.master_dir(source)
    for p in sorted(source.iterdir()):
        weights = p.name.endswith(".safetensors") or p.name.endswith(".safetensors.index.json")
        if p.is_file() and p.name not in _RUN_ONLY and not p.name.startswith(".") and not (master and weights):
            shutil.copy2(p, into / p.name)
    if master is not None:
        for p in sorted(master.iterdir()):
            shutil.copy2(p, into / p.name)
