"""What every benchmark script shares: machine facts, percentiles, tables, JSON output,
filesystems to run on (a local directory, or one sshfs client per rank), and process-tree
clean-up.

Each script records :func:`machine` in its JSON, so a figure always travels with the
machine and the load it was taken under.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python bench/x.py` from a checkout that is not installed
    sys.path.insert(0, str(REPO))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

RESULTS = REPO / "bench" / "results"

console = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True, highlight=False, width=None if sys.stderr.isatty() else 160)


class BenchError(Exception):
    """A run did not produce a valid measurement; the message says why."""


# -- the machine ---------------------------------------------------------------------------------

def loadavg() -> list[float]:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return list(os.getloadavg())


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def machine() -> dict:
    """Facts about this machine and its load right now (versions without importing torch)."""
    return {
        "host_cpus": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "memory_gib": _memory_gib(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "orchestrator": _version("orchestrator"),
        "loadavg": loadavg(),
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def wait_for_quiet(max_load: float | None, max_wait_s: float, check_every_s: float = 60.0) -> list[float]:
    """Wait until the 1-minute load average is below ``max_load`` (None: do not wait), at most
    ``max_wait_s``; returns the load average seen last (the caller records it either way)."""
    load = loadavg()
    if max_load is None:
        return load
    deadline = time.monotonic() + max_wait_s
    while load[0] >= max_load and time.monotonic() < deadline:
        console.print(f"load average {load[0]:.2f} >= {max_load:g}: waiting {check_every_s:g} s", markup=False, style="dim")
        time.sleep(min(check_every_s, max(0.0, deadline - time.monotonic())))
        load = loadavg()
    if load[0] >= max_load:
        err_console.print(f"warning: load average still {load[0]:.2f} after {max_wait_s:g} s; measuring anyway", markup=False)
    return load


# -- numbers -------------------------------------------------------------------------------------

def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def geometric_length(rng, mean: float, most: int) -> int:
    """A completion's length drawn from a long tail: geometric-like with this mean, at least
    1, at most ``most`` (the benches' stand-in for RL's completion lengths)."""
    return min(most, 1 + int(rng.expovariate(1 / mean)))


def stats(values: list[float]) -> dict:
    if not values:
        return {"n": 0, "p50": None, "p99": None, "max": None, "mean": None}
    return {"n": len(values), "p50": percentile(values, 50), "p99": percentile(values, 99), "max": max(values),
            "mean": statistics.fmean(values)}


def ms(seconds: float | None, digits: int = 1) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.{digits}f}"


def table(title: str, columns: list[str], rows: list[list], right_from: int = 1) -> None:
    t = Table(title=title, title_justify="left")
    for i, col in enumerate(columns):
        t.add_column(col, justify="right" if i >= right_from else "left")
    for row in rows:
        t.add_row(*("-" if v is None else str(v) for v in row))
    console.print(t)


def write_json(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    console.print(f"wrote {path}", markup=False)


def python_env() -> dict:
    """The environment for child Pythons: this checkout first on the path, no test faults."""
    env = {k: v for k, v in os.environ.items() if k != "ORCHESTRATOR_FAULT"}
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def demo_data(data: Path | None, work: Path) -> Path:
    """``data`` when given, else the demo (``orchestrator demo-data``, its defaults) made in ``work``."""
    if data is not None:
        return data
    data = work / "data"
    console.print(f"making demo data in {data} ...")
    subprocess.run([sys.executable, "-m", "orchestrator", "demo-data", f"--data-path={data}"], check=True, env=python_env(),
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return data


def run_iterations(argv: list[str], log_path: Path, *, iterations: int, env: dict, timeout_s: float, what: str) -> tuple[float, list[dict]]:
    """Run ``argv`` (an ``orchestrator run`` or ``local`` of ``iterations`` iterations on
    ``log_path``), its output in ``<log_path>.out``; returns its wall seconds and each
    iteration's timing from ``status --json``. Raises BenchError when it fails or a timing is
    missing."""
    from orchestrator.ops import status

    out_file = log_path.with_name(log_path.name + ".out")
    began = time.monotonic()
    with open(out_file, "wb") as out:
        code = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=timeout_s).returncode
    wall = time.monotonic() - began
    if code != 0:
        raise BenchError(f"{what}: the run exited with {code}; see {out_file}")
    snap = status.snapshot(log_path)
    timings = [it["timing"] for it in snap["iterations"]]
    if len(timings) != iterations or any(t is None for t in timings):
        raise BenchError(f"{what}: status has no timing for every iteration")
    return wall, snap["iterations"]


# -- filesystems ---------------------------------------------------------------------------------

FILESYSTEMS = ("local", "sshfs")


@contextlib.contextmanager
def rank_dirs(fs: str, work: Path, n: int) -> Iterator[tuple[Path, list[Path]]]:
    """(export, [the directory rank r uses]) for ``n`` ranks on ``fs``.

    local: one directory on this machine's disk, the same for every rank. sshfs: one sshfs
    client (mount) of one export directory per rank, like one node each (tests/sshfs.py:
    default caching, no sshd); every mount is unmounted on the way out, even on failure.
    """
    export = work / "export"
    export.mkdir(parents=True, exist_ok=True)
    if fs == "local":
        yield export, [export] * n
        return
    if fs != "sshfs":
        raise ValueError(f"unknown filesystem {fs!r}; choose from {FILESYSTEMS}")
    from tests.sshfs import SshfsMounts, missing_prerequisites

    missing = missing_prerequisites()
    if missing:
        raise BenchError("sshfs is not usable here; missing: " + ", ".join(missing) + " (scripts/setup-dev.sh installs them)")
    mounts = SshfsMounts(export, work / "mounts")
    try:
        yield export, mounts.mount(n)
    finally:
        mounts.close()


# -- processes -----------------------------------------------------------------------------------

def descendants(pid: int) -> list[int]:
    """PIDs below ``pid`` (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def kill_tree(proc: subprocess.Popen, term_grace_s: float = 10.0) -> None:
    """Stop ``proc`` and everything below it: SIGTERM, then SIGKILL to what is left. A process
    already reaped is left alone (its pid, and its children's, may be someone else's by now;
    the project's own children die with their parent through their death signal)."""
    if proc.poll() is not None:
        return
    tree = descendants(proc.pid)
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=term_grace_s)
    for pid in tree:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    if proc.poll() is None:
        proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)


def orchestrator(*args: str, env: dict) -> None:
    """``python -m orchestrator ARGS`` from the checkout to its end, its time printed; a failure
    ends the benchmark with the command's output."""
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "orchestrator", *args], cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"orchestrator {args[0]} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    print(f"  orchestrator {args[0]}: {time.monotonic() - began:.0f} s", flush=True)


def accuracies(log: Path, env: dict) -> dict[int, float]:
    """A run's eval accuracy by iteration, from ``status --json``."""
    out = subprocess.run([sys.executable, "-m", "orchestrator", "status", f"--log-path={log}", "--json"], cwd=REPO, env=env,
                         capture_output=True, text=True, check=True).stdout
    return {it["iteration"]: it["metrics"]["accuracy"] for it in json.loads(out)["iterations"] if it["evaluated"]}


def kernels_env(kernels: str | None) -> dict:
    """The environment of a learning benchmark's runs: this one's, with ``ATEN_CPU_CAPABILITY``
    set to ``kernels`` (None: the CPU's own kernels)."""
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    if kernels:
        env["ATEN_CPU_CAPABILITY"] = kernels
    return env
