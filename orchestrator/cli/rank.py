"""Which rank this process is, how many nodes the run has, and each node's weight: from the
flags of `run`, `local`, `doctor` and `plan`, else from the environment a launcher sets
(torchrun's ``RANK``, ``NODE_RANK``, Slurm's ``SLURM_PROCID`` and ``SLURM_NTASKS``).

Only the CLI reads the launcher's environment; below it a rank is a number in ``RunConfig``.
"""

from __future__ import annotations

import os
import typing

from orchestrator.errors import ConfigError


def slurm_tasks(environ: typing.Mapping[str, str] = os.environ) -> int | None:
    """``SLURM_NTASKS`` when this process runs under Slurm (None otherwise); ConfigError when
    Slurm runs more than one task on a node, since a rank is a node."""
    if "SLURM_NTASKS" not in environ:
        return None
    try:
        tasks, nodes = int(environ["SLURM_NTASKS"]), int(environ.get("SLURM_NNODES", environ["SLURM_NTASKS"]))
    except ValueError:
        raise ConfigError(f"environment SLURM_NTASKS={environ['SLURM_NTASKS']!r} or SLURM_NNODES="
                          f"{environ.get('SLURM_NNODES')!r} is not an integer") from None
    if tasks != nodes:
        raise ConfigError(f"Slurm runs SLURM_NTASKS={tasks} tasks on SLURM_NNODES={nodes} nodes, but every node runs one rank: "
                          f"start one task per node (srun --ntasks-per-node=1), or give --num-nodes and --master/--worker R")
    return tasks


def resolve_num_nodes(given: int | None, environ: typing.Mapping[str, str] = os.environ) -> int:
    """``--num-nodes``, else Slurm's task count (one task per node), else 1."""
    if given is not None:
        if given < 1:
            raise ConfigError(f"--num-nodes must be at least 1, got {given}")
        return given
    tasks = slurm_tasks(environ)
    return 1 if tasks is None else tasks


def resolve_rank(master: bool, worker: int | None, num_nodes: int, environ: typing.Mapping[str, str] = os.environ) -> int:
    """``--master`` is rank 0, ``--worker R`` is rank R; else ``RANK``, then ``NODE_RANK``,
    then ``SLURM_PROCID`` (with one Slurm task per node)."""
    if master and worker is not None:
        raise ConfigError("--master and --worker are exclusive: give --master on node 0 and --worker R on the others")
    if master:
        return 0
    if worker is not None:
        if worker == 0:
            raise ConfigError("--worker 0 is the master's rank: use --master on node 0 and --worker 1..N-1 elsewhere")
        return worker
    for var in ("RANK", "NODE_RANK", "SLURM_PROCID"):
        if var in environ:
            if var == "SLURM_PROCID":
                slurm_tasks(environ)
            try:
                return int(environ[var])
            except ValueError:
                raise ConfigError(f"environment {var}={environ[var]!r} is not an integer rank") from None
    if num_nodes == 1:
        return 0
    raise ConfigError(f"no rank given for a {num_nodes}-node run: pass --master (rank 0) or --worker R, or set RANK "
                      f"(srun sets SLURM_PROCID)")


def parse_weights(text: str | None, num_nodes: int) -> tuple[float, ...] | None:
    """``--rank-weights``: one number per node, or ``auto`` (None)."""
    if text is None:
        if num_nodes > 1:
            raise ConfigError(f"--rank-weights is required with --num-nodes {num_nodes}: one weight per node, e.g. "
                              f"\"{','.join(['1'] * num_nodes)}\", or auto (each node by its engines' GPUs)")
        return (1.0,)
    if text.strip() == "auto":
        return None
    try:
        return tuple(float(w) for w in text.split(","))
    except ValueError:
        raise ConfigError(f"--rank-weights must be comma-separated numbers or auto, got {text!r}") from None
