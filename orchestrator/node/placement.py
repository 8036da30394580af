"""GPU placement: which node runs which train worker and which inference engine, on which
of its GPUs and ports. Derived from the device mappings and the GPU counts the nodes
report, never assumed (see docs/placement.md).

A device mapping lists global GPU ranks: node ``n`` owns ranks ``n*G .. n*G+G-1`` where
``G`` is the GPUs per node, the same on every node. Train workers take one GPU each, in the
order the mapping lists them; engines take ``gpus_per_engine`` consecutive entries each and
must find them all on one node. Overlapping train and rollout mappings share GPUs
(colocated: engines stop before training); disjoint ones do not (disaggregated).

Both mappings empty is the CPU placement: one train worker and one engine per node, no GPUs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

from orchestrator.errors import ConfigError

_RANGE_CALL = re.compile(r"^(?:list\()?\s*range\(\s*(\d+)\s*,\s*(\d+)\s*\)\s*\)?$")
_ITEM = re.compile(r"^(\d+)(?:\s*-\s*(\d+))?$")


def parse_mapping(text: str, key: str = "device_mapping") -> tuple[int, ...]:
    """``"0-7"``, ``"0,1,2,3"``, ``"0-3,8-11"`` (inclusive ranges) or ROLL's
    ``"list(range(0,8))"`` (end exclusive) as a tuple of GPU ranks. No ``eval``."""
    text = text.strip()
    if not text:
        return ()
    m = _RANGE_CALL.match(text)
    if m:
        lo, hi = int(m.group(1)), int(m.group(2))
        if hi <= lo:
            raise ConfigError(f"{key}={text!r} is empty: range(a, b) needs b > a")
        return tuple(range(lo, hi))
    gpus: list[int] = []
    for item in text.split(","):
        m = _ITEM.match(item.strip())
        if not m:
            raise ConfigError(f"{key}={text!r}: {item.strip()!r} is not a GPU rank or an inclusive range like 0-7")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        if hi < lo:
            raise ConfigError(f"{key}={text!r}: the range {item.strip()!r} runs backwards")
        gpus.extend(range(lo, hi + 1))
    seen: set[int] = set()
    for g in gpus:
        if g in seen:
            raise ConfigError(f"{key}={text!r} lists GPU {g} twice: a role uses each GPU at most once")
        seen.add(g)
    return tuple(gpus)


@dataclass(frozen=True, slots=True)
class TrainWorker:
    rank: int
    """Global rank in the training process group."""
    node: int
    gpu: int | None
    """Node-local GPU id (None on CPU)."""


@dataclass(frozen=True, slots=True)
class Engine:
    engine: int
    node: int
    gpus: tuple[int, ...]
    """Node-local GPU ids: the engine's CUDA_VISIBLE_DEVICES (empty on CPU)."""
    port: int
    """Planned port, node-local: the first engine of a node gets the base port, the next +1
    (0: any free port, chosen when the engine starts)."""


@dataclass(frozen=True, slots=True)
class Placement:
    num_nodes: int
    gpus_per_node: int
    colocated: bool
    train_workers: tuple[TrainWorker, ...]
    engines: tuple[Engine, ...]
    gpus_per_engine: int

    @property
    def on_gpu(self) -> bool:
        return self.gpus_per_node > 0 and any(w.gpu is not None for w in self.train_workers)

    def train_workers_on(self, node: int) -> list[TrainWorker]:
        return [w for w in self.train_workers if w.node == node]

    def engines_on(self, node: int) -> list[Engine]:
        return [e for e in self.engines if e.node == node]

    @property
    def checkpoint_node(self) -> int:
        """The node of train worker 0: it hosts the training rendezvous and writes the checkpoint."""
        return self.train_workers[0].node


def check_mappings(train_mapping: str, rollout_mapping: str, gpus_per_engine: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The parsed mappings, checked for what needs no cluster: syntax, both-or-neither, and
    that the engines divide the rollout GPUs."""
    if gpus_per_engine < 1:
        raise ConfigError(f"rollout.gpus_per_engine must be at least 1, got {gpus_per_engine}")
    train = parse_mapping(train_mapping, "train.device_mapping")
    rollout = parse_mapping(rollout_mapping, "rollout.device_mapping")
    if bool(train) != bool(rollout):
        empty = "train.device_mapping" if not train else "rollout.device_mapping"
        raise ConfigError(f"{empty} is empty but the other role has a GPU mapping: give both (GPU placement) or neither (CPU)")
    if len(rollout) % gpus_per_engine:
        raise ConfigError(
            f"rollout.device_mapping has {len(rollout)} GPUs, which rollout.gpus_per_engine={gpus_per_engine} does not divide: "
            f"{len(rollout) // gpus_per_engine} engines would use {len(rollout) // gpus_per_engine * gpus_per_engine} and "
            f"{len(rollout) % gpus_per_engine} would be left over"
        )
    return train, rollout


def resolve(
    *,
    num_nodes: int,
    gpus_per_node: int,
    train_mapping: str,
    rollout_mapping: str,
    gpus_per_engine: int = 1,
    engine_port: int = 8000,
) -> Placement:
    """The placement of both roles on ``num_nodes`` nodes of ``gpus_per_node`` GPUs each.
    Raises ConfigError naming the numbers when the mappings do not fit."""
    if num_nodes < 1:
        raise ConfigError(f"the cluster needs at least 1 node, got {num_nodes}")
    train, rollout = check_mappings(train_mapping, rollout_mapping, gpus_per_engine)
    if not train:
        return _cpu(num_nodes, engine_port)
    total = num_nodes * gpus_per_node
    for key, gpus in (("train.device_mapping", train), ("rollout.device_mapping", rollout)):
        beyond = [g for g in gpus if g >= total]
        if beyond:
            raise ConfigError(
                f"{key} uses GPU {max(beyond)}, but {num_nodes} node(s) x {gpus_per_node} GPUs per node have GPUs 0-{total - 1}"
                if total else f"{key} needs GPUs, but the {num_nodes} node(s) have none"
            )
    if gpus_per_engine > gpus_per_node:
        raise ConfigError(f"rollout.gpus_per_engine={gpus_per_engine} exceeds the {gpus_per_node} GPUs of a node: an engine runs on one node")
    workers = tuple(TrainWorker(rank=i, node=g // gpus_per_node, gpu=g % gpus_per_node) for i, g in enumerate(train))
    engines: list[Engine] = []
    per_node: dict[int, int] = {}
    for e in range(len(rollout) // gpus_per_engine):
        chunk = rollout[e * gpus_per_engine : (e + 1) * gpus_per_engine]
        nodes = sorted({g // gpus_per_node for g in chunk})
        if len(nodes) > 1:
            raise ConfigError(
                f"engine {e} would straddle nodes {' and '.join(map(str, nodes))}: its GPUs {','.join(map(str, chunk))} "
                f"(rollout.gpus_per_engine={gpus_per_engine}, {gpus_per_node} GPUs per node); an engine's GPUs must be on one node"
            )
        node = nodes[0]
        k = per_node.get(node, 0)
        per_node[node] = k + 1
        port = engine_port + k if engine_port else 0  # 0: any free port, chosen at start
        engines.append(Engine(engine=e, node=node, gpus=tuple(g % gpus_per_node for g in chunk), port=port))
    return Placement(
        num_nodes=num_nodes,
        gpus_per_node=gpus_per_node,
        colocated=bool(set(train) & set(rollout)),
        train_workers=workers,
        engines=tuple(engines),
        gpus_per_engine=gpus_per_engine,
    )


def _cpu(num_nodes: int, engine_port: int) -> Placement:
    return Placement(
        num_nodes=num_nodes,
        gpus_per_node=0,
        colocated=True,
        train_workers=tuple(TrainWorker(rank=n, node=n, gpu=None) for n in range(num_nodes)),
        engines=tuple(Engine(engine=n, node=n, gpus=(), port=engine_port) for n in range(num_nodes)),
        gpus_per_engine=0,
    )


def check_runnable(placement: Placement, hosts: Sequence[str] | None = None) -> None:
    """What a run needs beyond a valid placement: every node rolls out its share of the tasks
    (rank weights are positive), so every node needs an engine."""
    without = [n for n in range(placement.num_nodes) if not placement.engines_on(n)]
    if without:
        names = ", ".join(f"node {n}" + (f" ({hosts[n]})" if hosts else "") for n in without)
        raise ConfigError(
            f"{names} would run no rollout engine, but every node rolls out its share of the tasks "
            f"(--rank-weights): extend rollout.device_mapping to GPUs on {'that node' if len(without) == 1 else 'those nodes'}"
        )


def cluster_gpus(reports: dict[int, dict]) -> int:
    """The GPUs per node of a cluster from each node's report ``{node: {"count", "host", ...}}``;
    raises ConfigError naming the nodes when they differ."""
    counts = {n: r["count"] for n, r in sorted(reports.items())}
    if len(set(counts.values())) > 1:
        listed = ", ".join(f"node {n} ({reports[n].get('host', '?')}) {c}" for n, c in counts.items())
        raise ConfigError(
            f"the nodes report different GPU counts: {listed}. Global GPU ranks need the same count on every node: "
            f"set CUDA_VISIBLE_DEVICES so that each node shows the same number"
        )
    return next(iter(counts.values())) if counts else 0
