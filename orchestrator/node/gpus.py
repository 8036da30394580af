"""This node's GPUs, detected, never assumed: the count each node reports at join, and the
memory in use that colocated training waits on after the engines stop.

The orchestrator process itself never initialises CUDA (that would take memory on GPU 0 of
every node); it asks ``nvidia-smi``, the driver's own tool, and honours
``CUDA_VISIBLE_DEVICES`` the way CUDA does: only the listed devices exist, in that order.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from typing import Mapping

NVIDIA_SMI_TIMEOUT_S = 20.0
_GPU_LINE = re.compile(r"^GPU (\d+): (.*?)(?: \(UUID: (\S+)\))?$")


def _nvidia_smi(*args: str) -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, *args], capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def _visible(physical: list[dict], environ: Mapping[str, str]) -> list[dict]:
    """The devices CUDA_VISIBLE_DEVICES leaves, by index or UUID (prefix), in its order."""
    spec = environ.get("CUDA_VISIBLE_DEVICES")
    if spec is None:
        return physical
    chosen: list[dict] = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            break
        match = [g for g in physical if (item.isdigit() and g["index"] == int(item)) or (g.get("uuid") or "").startswith(item)]
        if not match:
            break  # CUDA stops at the first invalid entry
        chosen.append(match[0])
    return chosen


def detect(environ: Mapping[str, str] = os.environ) -> dict:
    """``{"count", "names", "source", "cuda_visible_devices"}`` for this node."""
    listing = _nvidia_smi("-L")
    visible_spec = environ.get("CUDA_VISIBLE_DEVICES")
    if listing is None:
        return {"count": 0, "names": [], "source": "nvidia-smi not found or failed", "cuda_visible_devices": visible_spec}
    physical = []
    for line in listing.splitlines():
        m = _GPU_LINE.match(line.strip())
        if m:
            physical.append({"index": int(m.group(1)), "name": m.group(2), "uuid": m.group(3)})
    visible = _visible(physical, environ)
    return {
        "count": len(visible),
        "names": [g["name"] for g in visible],
        "source": "nvidia-smi -L" + (f" with CUDA_VISIBLE_DEVICES={visible_spec}" if visible_spec is not None else ""),
        "cuda_visible_devices": visible_spec,
    }


def memory_used_mib(local_ids: list[int], environ: Mapping[str, str] = os.environ) -> dict[int, int] | None:
    """Memory in use on these node-local (visible) GPUs, in MiB; None without nvidia-smi."""
    out = _nvidia_smi("--query-gpu=index,uuid,memory.used", "--format=csv,noheader,nounits")
    if out is None:
        return None
    physical, used = [], {}
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and parts[0].isdigit() and parts[2].isdigit():
            physical.append({"index": int(parts[0]), "uuid": parts[1]})
            used[int(parts[0])] = int(parts[2])
    visible = _visible(physical, environ)
    return {local: used[visible[local]["index"]] for local in local_ids if local < len(visible)}


def child_visible_devices(local_ids, environ: Mapping[str, str] = os.environ) -> str:
    """``CUDA_VISIBLE_DEVICES`` for a child that gets these node-local ids: the ids index what
    this process sees, so under ``CUDA_VISIBLE_DEVICES=4,5,6,7`` local GPU 1 is device 5."""
    spec = environ.get("CUDA_VISIBLE_DEVICES")
    if spec is None:
        return ",".join(str(i) for i in local_ids)
    entries = [s.strip() for s in spec.split(",")]
    return ",".join(entries[i] for i in local_ids)
