"""This rank's facts as one plain JSON dict: what `doctor` compares between ranks.

Nothing here imports torch or vLLM (versions come from the installed distributions'
metadata) or initialises CUDA (GPUs come from ``nvidia-smi``). ``collect(quick=True)`` is
cheap enough for the start of every run (well under 0.5 s): psutil, /proc, importlib
metadata and at most one ``nvidia-smi`` query. The full collection adds ``ip route get``
towards the master and the fabric manager's state.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import ipaddress
import json
import os
import platform
import shutil
import socket
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

import psutil

import orchestrator
from orchestrator.node import gpus as gpus_mod
from orchestrator.node import identity

SCHEMA = 1

# Distributions whose versions must agree between ranks (None: not installed there).
PACKAGES = ("torch", "transformers", "vllm", "orchestrator", "nvidia-nccl-cu12", "nvidia-nccl-cu13")
# Environment variables compared between ranks (by prefix), and reported.
ENV_PREFIXES = ("NCCL_", "GLOO_", "TORCH_NCCL_")
FAST_SUBPROCESS_TIMEOUT_S = 5.0
NVIDIA_SMI_QUERY = "index,uuid,name,driver_version,memory.free,memory.total"
FABRIC_MANAGER_UNIT = "nvidia-fabricmanager"


def collect(*, rank: int, num_nodes: int, log_path: Path | str | None = None, quick: bool = False,
            master_addrs: list[str] | None = None, gpus: dict | None = None,
            environ: Mapping[str, str] = os.environ) -> dict:
    """This rank's facts.

    ``master_addrs``: the master's addresses (from the doctor session record); a worker then
    records the route it takes to the master (``ip route get``). ``gpus``: a report from
    :func:`orchestrator.node.gpus.detect` already made (the run's join), to spare an ``nvidia-smi -L``.
    """
    started = time.monotonic()
    facts: dict = {
        "schema": SCHEMA,
        "quick": quick,
        "rank": rank,
        "num_nodes": num_nodes,
        "host": identity.host(),
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "clock": {"wall": time.time(), "monotonic": time.monotonic()},
        "interfaces": interfaces(),
        "env": {k: v for k, v in sorted(environ.items()) if k.startswith(ENV_PREFIXES)},
        "cuda_visible_devices": environ.get("CUDA_VISIBLE_DEVICES"),
        "versions": versions(),
        "tools": {t: shutil.which(t) is not None for t in ("ip", "nvidia-smi", "systemctl")},
    }
    facts["gpus"] = gpu_facts(gpus, environ)
    facts["versions"]["driver"] = facts["gpus"].get("driver")
    facts["log_path"] = disk_facts(Path(log_path)) if log_path is not None else None
    if not quick:
        facts["route_to_master"] = route_to(master_addrs or []) if facts["tools"]["ip"] else None
        facts["fabric_manager"] = fabric_manager(facts["tools"])
    facts["collect_s"] = round(time.monotonic() - started, 4)
    return facts


# -- network --------------------------------------------------------------------------------


def interfaces() -> dict:
    """``{name: {up, mtu, loopback, addrs: [{family, address, netmask}]}}`` for every interface."""
    stats = psutil.net_if_stats()
    addrs = psutil.net_if_addrs()
    out = {}
    for name in sorted(set(stats) | set(addrs)):
        st = stats.get(name)
        entries = []
        for a in addrs.get(name, []):
            family = {socket.AF_INET: "inet", socket.AF_INET6: "inet6"}.get(a.family)
            if family is None:
                continue
            entries.append({"family": family, "address": a.address.split("%")[0], "netmask": a.netmask})
        flags = (st.flags.split(",") if st is not None and getattr(st, "flags", "") else [])
        out[name] = {
            "up": bool(st.isup) if st is not None else False,
            "mtu": int(st.mtu) if st is not None else None,
            "loopback": "loopback" in flags or name == "lo",
            "addrs": entries,
        }
    return out


def reachable_addresses(ifaces: dict) -> list[dict]:
    """The addresses other nodes could reach this one at: up, not loopback, not link-local.
    IPv4 first. ``[{address, interface}]``."""
    found = []
    for name, info in ifaces.items():
        if not info.get("up") or info.get("loopback"):
            continue
        for a in info.get("addrs", []):
            try:
                ip = ipaddress.ip_address(a["address"])
            except ValueError:
                continue
            if ip.is_loopback or ip.is_link_local or ip.is_multicast:
                continue
            found.append({"address": a["address"], "interface": name, "v": ip.version})
    found.sort(key=lambda d: (d["v"], d["interface"], d["address"]))
    return [{"address": d["address"], "interface": d["interface"]} for d in found]


def route_to(addrs: list[str]) -> dict | None:
    """The route this node takes to the first of ``addrs`` it does not hold itself:
    ``{addr, dev, src, mtu}`` (``mtu``: a route's own MTU, else null). None when none routes."""
    for addr in addrs:
        try:
            out = subprocess.run(["ip", "-j", "route", "get", addr], check=False, capture_output=True, text=True,
                                 timeout=FAST_SUBPROCESS_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired):
            return None
        if out.returncode != 0:
            continue
        try:
            routes = json.loads(out.stdout or "[]")
        except ValueError:
            continue
        if not routes:
            continue
        r = routes[0]
        dev = r.get("dev")
        if not dev or dev == "lo" or r.get("type") == "local":
            continue  # an address of this very node (same host)
        mtu = None
        for m in r.get("metrics", []) or []:
            if isinstance(m, dict) and "mtu" in m:
                mtu = int(m["mtu"])
        return {"addr": addr, "dev": dev, "src": r.get("prefsrc"), "gateway": r.get("gateway"), "mtu": mtu}
    return None


# -- software -------------------------------------------------------------------------------


def versions() -> dict:
    found = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    if found["orchestrator"] is None:
        found["orchestrator"] = orchestrator.__version__
    found["orchestrator_source"] = source_digest()
    return found


def source_digest() -> str:
    """A short digest of the orchestrator's own .py files: two checkouts at one version differ here."""
    root = Path(orchestrator.__file__).resolve().parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        h.update(str(path.relative_to(root)).encode() + b"\0" + hashlib.sha256(data).digest())
    return h.hexdigest()[:12]


# -- GPUs -----------------------------------------------------------------------------------


def _run(*argv: str) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(list(argv), check=False, capture_output=True, text=True, timeout=FAST_SUBPROCESS_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None


def gpu_facts(report: dict | None, environ: Mapping[str, str]) -> dict:
    """GPU count (the join's report when given), driver version and memory per visible GPU."""
    if shutil.which("nvidia-smi") is None:
        base = report or {"count": 0, "names": [], "source": "nvidia-smi not found",
                          "cuda_visible_devices": environ.get("CUDA_VISIBLE_DEVICES")}
        return {**base, "driver": None, "memory": []}
    base = report if report is not None else gpus_mod.detect(environ)
    out = _run("nvidia-smi", f"--query-gpu={NVIDIA_SMI_QUERY}", "--format=csv,noheader,nounits")
    if out is None or out.returncode != 0:
        return {**base, "driver": None, "memory": [], "query_error": (out.stderr.strip()[-300:] if out else "nvidia-smi failed")}
    return {**base, **parse_gpu_query(out.stdout, environ)}


def parse_gpu_query(text: str, environ: Mapping[str, str]) -> dict:
    physical, drivers = [], set()
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 6 or not parts[0].isdigit():
            continue
        drivers.add(parts[3])
        physical.append({"index": int(parts[0]), "uuid": parts[1], "name": parts[2],
                         "free_mib": _int(parts[4]), "total_mib": _int(parts[5])})
    visible = gpus_mod._visible(physical, environ)  # the same CUDA_VISIBLE_DEVICES rules as the count
    return {"driver": ",".join(sorted(drivers)) or None,
            "memory": [{"index": g["index"], "free_mib": g["free_mib"], "total_mib": g["total_mib"]} for g in visible]}


def _int(text: str) -> int | None:
    try:
        return int(float(text))
    except ValueError:
        return None


def fabric_manager(tools: dict) -> dict | None:
    """NVSwitch fabric manager: whether this node needs it, and its systemd state.

    None where ``nvidia-smi`` or ``systemctl`` is missing (nothing to ask)."""
    if not (tools.get("nvidia-smi") and tools.get("systemctl")):
        return None
    nvswitches = sorted(p.name for p in Path("/dev").glob("nvidia-nvswitch[0-9]*"))
    out = _run("systemctl", "show", "-p", "LoadState", "-p", "ActiveState", "-p", "SubState", FABRIC_MANAGER_UNIT)
    state: dict = {"nvswitches": len(nvswitches), "load_state": None, "active_state": None, "sub_state": None, "error": None}
    if out is None:
        state["error"] = "systemctl did not answer"
    elif out.returncode != 0:
        state["error"] = (out.stderr or out.stdout).strip()[-300:] or f"systemctl exited {out.returncode}"
    else:
        for line in out.stdout.splitlines():
            key, _, value = line.partition("=")
            if key == "LoadState":
                state["load_state"] = value
            elif key == "ActiveState":
                state["active_state"] = value
            elif key == "SubState":
                state["sub_state"] = value
    state["expected"] = bool(nvswitches) or state["load_state"] == "loaded"
    return state


# -- disk -----------------------------------------------------------------------------------


def disk_facts(path: Path) -> dict:
    """Free space on the log path (or its nearest existing parent) and the mount it lives on."""
    probe = path
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    try:
        usage = psutil.disk_usage(str(probe))
        free, total = usage.free, usage.total
    except OSError:
        free = total = None
    mount = _mount_of(probe)
    return {"path": str(path), "free_bytes": free, "total_bytes": total, **mount}


def _mount_of(path: Path) -> dict:
    """The /proc/self/mounts entry with the longest mount point containing ``path``."""
    target = os.path.realpath(path)
    best = {"mountpoint": None, "fstype": None, "options": None}
    try:
        with open("/proc/self/mounts") as f:
            lines = f.read().splitlines()
    except OSError:
        return best
    best_len = -1
    for line in lines:
        fields = line.split()
        if len(fields) < 4:
            continue
        mp = fields[1].replace("\\040", " ")
        if (target == mp or target.startswith(mp.rstrip("/") + "/")) and len(mp) > best_len:
            best_len = len(mp)
            best = {"mountpoint": mp, "fstype": fields[2], "options": fields[3]}
    return best
