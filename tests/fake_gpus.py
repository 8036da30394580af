"""A stand-in for ``nvidia-smi`` on a machine without GPUs: the one seam between the
orchestrator and the GPU driver. Everything behind it (reports through the shared
filesystem, the master's validation, placement of engines and train workers) is real.

``fake_nvidia_smi(dir)`` writes an executable ``nvidia-smi`` into ``dir``; put ``dir`` first
on a rank's PATH and set ``FAKE_GPUS=N`` in its environment; optionally
``FAKE_GPU_MEMORY_MIB=M``, or ``FAKE_GPU_MEMORY_FILE=PATH`` holding the MiB in use, which a
test can change while the orchestrator polls.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

SCRIPT = """#!/bin/sh
n="${FAKE_GPUS:-0}"
mem="${FAKE_GPU_MEMORY_MIB:-0}"
if [ -n "$FAKE_GPU_MEMORY_FILE" ] && [ -f "$FAKE_GPU_MEMORY_FILE" ]; then mem=$(cat "$FAKE_GPU_MEMORY_FILE"); fi
i=0
case "$1" in
  -L)
    while [ "$i" -lt "$n" ]; do echo "GPU $i: Fake GPU (UUID: GPU-fake-$i)"; i=$((i+1)); done ;;
  --query-gpu=index,uuid,memory.used)
    while [ "$i" -lt "$n" ]; do echo "$i, GPU-fake-$i, $mem"; i=$((i+1)); done ;;
  *) echo "fake nvidia-smi: unsupported arguments $*" >&2; exit 9 ;;
esac
"""


def fake_nvidia_smi(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    exe = directory / "nvidia-smi"
    exe.write_text(SCRIPT)
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return directory


def gpu_env(directory: Path, count: int, **extra: str) -> dict[str, str]:
    return {"PATH": f"{directory}{os.pathsep}{os.environ.get('PATH', '')}", "FAKE_GPUS": str(count), **extra}
