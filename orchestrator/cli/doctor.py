"""`orchestrator doctor`: check that the nodes agree before a run (run on every node, like `run`).

Exit codes: 0 no problems, 1 problems found, 2 bad input, 3 a rank never showed up (named),
130 interrupted.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import click

from orchestrator import defaults, terminal
from orchestrator.cli.rank import resolve_num_nodes, resolve_rank
from orchestrator.cli.run_options import NUM_NODES_HELP, RANK_OPTIONS, apply
from orchestrator.errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_OK, BadInput, ConfigError
from orchestrator.node import identity, rank_lock
from orchestrator.node.checks import GIB, Thresholds
from orchestrator.ops.doctor.session import Options, RanksMissing
from orchestrator.ops.doctor.session import run as run_session


@click.command()
@click.option("--log-path", required=True, type=click.Path(path_type=Path),
              help="Absolute shared path, the same on every node (the run's --log-path); doctor writes in its doctor/ directory.")
@click.option("--num-nodes", type=int, default=None, metavar="N", help=NUM_NODES_HELP)
@apply(RANK_OPTIONS)
@click.option("--timeout", "timeout_s", type=float, default=120.0, show_default=True, metavar="SECONDS",
              help="Seconds to wait for the other ranks (and for each measurement).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object: problems, ranks, filesystem.")
@click.option("--node-timeout", "node_timeout_s", type=float, default=defaults.NODE_TIMEOUT_S, show_default=True, metavar="SECONDS",
              help="The run's coordination.node_timeout_s: filesystem latency near a quarter of it is a problem.")
@click.option("--min-free-gib", type=float, default=10.0, show_default=True, metavar="GIB", help="Free space the log path needs.")
@click.option("--max-clock-skew", "max_skew_s", type=float, default=2.0, show_default=True, metavar="SECONDS",
              help="Clock skew between nodes reported as a problem.")
def doctor(log_path: Path, num_nodes: int | None, master: bool, worker: int | None, timeout_s: float, as_json: bool,
           node_timeout_s: float, min_free_gib: float, max_skew_s: float) -> None:
    """Compare every node's facts (versions, NCCL/Gloo environment, interfaces and MTUs, GPUs,
    fabric manager, free space) and measure the shared filesystem between nodes.

    Run it on every node with the same --log-path and --num-nodes: --master on node 0,
    --worker R on the others. The master prints a table of problems, each with its fix;
    the workers print the same verdict.
    """
    try:
        if not log_path.is_absolute():
            raise ConfigError(f"--log-path must be absolute (the same shared path on every node), got {log_path}")
        num_nodes = resolve_num_nodes(num_nodes)
        if num_nodes < 1:
            raise ConfigError(f"--num-nodes must be at least 1, got {num_nodes}")
        if timeout_s <= 0 or node_timeout_s <= 0:
            raise ConfigError("--timeout and --node-timeout must be positive")
        rank = resolve_rank(master, worker, num_nodes)
        if not 0 <= rank < num_nodes:
            raise ConfigError(f"rank {rank} is outside --num-nodes {num_nodes}: ranks are 0..{num_nodes - 1}")
    except ConfigError as e:
        terminal.abort(str(e), EXIT_BAD_INPUT)
    terminal.setup_logging(rank, identity.host())
    opts = Options(log_path=log_path, rank=rank, num_nodes=num_nodes, timeout_s=timeout_s,
                   thresholds=Thresholds(min_free_bytes=int(min_free_gib * GIB), max_clock_skew_s=max_skew_s,
                                         node_timeout_s=node_timeout_s))
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        with rank_lock.claim(log_path, rank, rank_lock.Role.DOCTOR):  # its own lock: a doctor may run beside the run
            result = run_session(opts)
    except KeyboardInterrupt:
        terminal.abort("interrupted", EXIT_INTERRUPTED)
    except BadInput as e:
        _fail(as_json, rank, str(e), e.exit_code, [])
    except RanksMissing as e:
        _fail(as_json, rank, str(e), e.exit_code, e.ranks)
    except OSError as e:  # the log path cannot be written (permissions, read-only, not mounted)
        _fail(as_json, rank, f"cannot use {log_path / 'doctor'}: {e}", EXIT_BAD_INPUT, [])
    code = int(result["exit_code"])
    if as_json:
        terminal.out.print(json.dumps({**result, "rank": rank}, indent=2), markup=False)
    else:
        render(result, rank)
    if result.get("error"):
        terminal.display_error(result["error"])
    sys.exit(code)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt()


def _fail(as_json: bool, rank: int, message: str, code: int, missing: list[int]) -> None:
    if as_json:
        terminal.out.print(json.dumps({"rank": rank, "exit_code": code, "error": message, "missing": missing,
                                       "problems": [], "ranks": [], "filesystem": None}, indent=2), markup=False)
    terminal.abort(message, code)


def _fmt_s(v) -> str:
    if v is None:
        return "-"
    return f"{v * 1000:.1f} ms" if abs(v) < 1 else f"{v:.2f} s"


def _fmt_pm(v, resolution) -> str:
    if v is None:
        return "not seen"
    return _fmt_s(v) + ("" if resolution is None else f" ± {_fmt_s(resolution)}")


def render(result: dict, rank: int) -> None:
    ranks = result.get("ranks") or []
    terminal.out.print(f"doctor session {result['session']}: {len(ranks)} rank(s); this is rank {rank}", markup=False)
    rows = []
    for s in ranks:
        p = s.get("path") or {}
        g = s.get("gpus") or {}
        free = s.get("log_path_free_bytes")
        rows.append([s["rank"], s.get("host"), (s.get("addresses") or ["-"])[0],
                     f"{p['interface']} mtu {p['mtu']}" if p else "-", g.get("count"), g.get("driver") or "-",
                     "-" if free is None else f"{free / GIB:.0f} GiB"])
    terminal.display_table("ranks", ["rank", "host", "address", "path to master", "GPUs", "driver", "log free"], rows)
    fs = result.get("filesystem")
    if fs and len(fs.get("per_rank") or {}) > 1:
        fs_rows = []
        for r, m in sorted(fs["per_rank"].items(), key=lambda kv: int(kv[0])):
            if r == "0":
                continue
            skew = m.get("clock_skew_s")
            fs_rows.append([r, _fmt_pm(m.get("new_file_s"), m.get("new_file_resolution_s")),
                            _fmt_pm(m.get("replaced_file_s"), m.get("replaced_file_resolution_s")),
                            "-" if skew is None else f"{skew:+.3f} s ± {m.get('clock_uncertainty_s') or 0:.3f}"])
        terminal.display_table("shared filesystem: time until a worker sees the master's file (half a round trip)",
                               ["rank", "new file visible", "replaced file visible", "clock vs master"], fs_rows)
    problems = result.get("problems") or []
    if problems:
        hosts = {s["rank"]: s.get("host") for s in ranks}
        terminal.display_table("problems", ["check", "ranks", "detail", "fix"],
                               [[p["check"], ", ".join(f"{r} ({hosts.get(r)})" if hosts.get(r) else str(r) for r in p["ranks"]),
                                 p["detail"], p["fix"]] for p in problems])
        terminal.out.print(f"{len(problems)} problem(s) found (exit {result['exit_code']})", markup=False)
    elif result["exit_code"] == EXIT_OK:
        terminal.out.print("no problems found (exit 0)", markup=False)


if __name__ == "__main__":  # `python -m orchestrator.cli.doctor`, the same command before it is registered in cli/__init__.py
    doctor(prog_name="orchestrator doctor")
