"""`orchestrator local`: N ranks on this machine against one log path.

The way to try a multi-node run on one box: every rank is a separate `orchestrator run`
process, its output prefixed with its rank; Ctrl+C (or SIGTERM) is passed on to all ranks.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import click

from orchestrator import preflight, terminal
from orchestrator.cli.rank import resolve_num_nodes
from orchestrator.cli.run_options import RUN_OPTIONS, ConfigError, apply, build_config
from orchestrator.errors import EXIT_BAD_INPUT, EXIT_ERROR, EXIT_INTERRUPTED, EXIT_OK, EXIT_PEER_FAILED

# When ranks disagree, the exit code that says most about the root cause wins.
_PRIORITY = (EXIT_INTERRUPTED, EXIT_BAD_INPUT, EXIT_ERROR, EXIT_PEER_FAILED)


def combined_exit_code(codes: list[int]) -> int:
    bad = [c for c in codes if c != EXIT_OK]
    if not bad:
        return EXIT_OK
    for c in _PRIORITY:
        if c in bad:
            return c
    return bad[0]


def thread_budget(ranks: int, env=os.environ) -> dict[str, str]:
    """``OMP_NUM_THREADS`` for each of ``ranks`` ranks sharing this machine: its cores split
    evenly, at least one each; nothing when there is one rank or the environment sets it.

    Torch starts a thread per core in every process. N ranks' engines and trainers computing
    at once would run N times as many spinning threads as there are cores, and on 2 cores two
    ranks' rollouts and updates took 5-35 times as long (docs/performance.md, section 11).
    torchrun does the same for the processes it starts."""
    if ranks <= 1 or env.get("OMP_NUM_THREADS"):
        return {}
    return {"OMP_NUM_THREADS": str(max(1, cores() // ranks))}


def cores() -> int:
    """The cores torch would give one process here: the physical ones this process may run on."""
    import psutil

    return min(len(os.sched_getaffinity(0)), psutil.cpu_count(logical=False) or os.cpu_count() or 1)


def rank_argv(argv: list[str], rank: int) -> list[str]:
    return [sys.executable, "-m", "orchestrator", "run", *argv, "--master" if rank == 0 else f"--worker={rank}"]


@click.command(context_settings={"ignore_unknown_options": False})
@apply(RUN_OPTIONS)
@click.pass_context
def local(click_ctx: click.Context, **params) -> None:
    """Start --num-nodes ranks of one run on this machine. With no --rank-weights, auto: each
    node by its engines' GPUs (on CPU, the same). KEY=VALUE arguments as for `run`."""
    try:
        n = params["num_nodes"] = resolve_num_nodes(params["num_nodes"])
    except ConfigError as e:
        terminal.abort(str(e), EXIT_BAD_INPUT)
    if params["rank_weights"] is None:
        params["rank_weights"] = "auto"
    try:
        for rank in range(n):
            config = build_config(params, rank=rank)
        preflight.create_log_path(config.log_path)
    except ConfigError as e:
        terminal.abort(str(e), EXIT_BAD_INPUT)
    argv = _run_argv(params, click_ctx.command.params)
    threads = thread_budget(n)
    if threads:
        terminal.out.print(f"[local] {n} ranks share this machine's cores: OMP_NUM_THREADS={threads['OMP_NUM_THREADS']} in each "
                           f"(set OMP_NUM_THREADS to choose)", markup=False)
    procs = [
        subprocess.Popen(rank_argv(argv, r), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                         env={**os.environ, **threads})
        for r in range(n)
    ]
    pumps = [threading.Thread(target=_pump, args=(r, p), daemon=True) for r, p in enumerate(procs)]
    for t in pumps:
        t.start()

    def forward(signum, _frame):
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signum)

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    codes = [p.wait() for p in procs]
    for t in pumps:
        t.join(timeout=5)
    summary = ", ".join(f"rank {r}: {c}" for r, c in enumerate(codes))
    code = combined_exit_code(codes)
    (terminal.out if code == EXIT_OK else terminal.err).print(f"[local] ranks exited ({summary})", markup=False)
    sys.exit(code)


def _pump(rank: int, proc: subprocess.Popen) -> None:
    prefix = f"[rank {rank}] ".encode()
    for line in proc.stdout:
        sys.stdout.buffer.write(prefix + line)
        sys.stdout.buffer.flush()


def _run_argv(params: dict, options: list[click.Parameter]) -> list[str]:
    """The `run` flags to hand every rank (the rank flag is added per rank): every option of
    ``options`` (the shared RUN_OPTIONS) that was given, so a new flag cannot be forgotten."""
    argv = []
    for option in options:
        if not isinstance(option, click.Option):
            continue
        value, flag = params[option.name], option.opts[0]
        if option.is_flag:
            if value:
                argv.append(flag)
        elif value is not None:
            argv.append(f"{flag}={value}")
    return argv + list(params["overrides"])
