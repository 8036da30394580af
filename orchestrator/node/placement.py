"""GPU placement: which node runs which train worker and which inference engine, on which
of its GPUs and ports. Derived from the device mappings and the GPU counts the nodes
report, never assumed (see docs/placement.md).

A device mapping lists global GPU ranks, counted node 0's GPUs first, then node 1's, and so
on, from the GPUs each node reports (nodes may differ: 8, 4, 4 gives node 1 ranks 8-11).
Train workers take one GPU each, in the order the mapping lists them; engines take
``gpus_per_engine`` consecutive entries each and must find them all on one node.
Overlapping train and rollout mappings share GPUs (colocated: engines stop before
training); disjoint ones do not (disaggregated). A node may run only train workers or only
engines; one with neither has no part in the run and is refused.

Both mappings empty is the CPU placement: one train worker and one engine per node, no GPUs;
``train.nodes`` and ``rollout.nodes`` narrow each role to the nodes they name, so that a CPU
run can keep training and rollout apart (disaggregated when no node has both).

A model served beside the policy (``models.<name>``) has one engine on each node that serves
it: on CPU the nodes of ``models.<name>.nodes`` (empty: every node that rolls out), on GPUs
those that hold GPUs of ``models.<name>.device_mapping`` (an engine over all of a node's,
never shared with training or the policy's engines). A node that serves one has a part in
the run even if it neither trains nor rolls out.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Mapping, NamedTuple, Sequence

from orchestrator.errors import ConfigError, Culprit, FailureKind

_RANGE_CALL = re.compile(r"^(?:list\()?\s*range\(\s*(\d+)\s*,\s*(\d+)\s*\)\s*\)?$")
_ITEM = re.compile(r"^(\d+)(?:\s*-\s*(\d+))?$")


def parse_mapping(text: str, key: str = "device_mapping", unit: str = "GPU") -> tuple[int, ...]:
    """``"0-7"``, ``"0,1,2,3"``, ``"0-3,8-11"`` (inclusive ranges) or ROLL's
    ``"list(range(0,8))"`` (end exclusive) as a tuple of GPU ranks (or node ranks: ``unit``).
    No ``eval``."""
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
            raise ConfigError(f"{key}={text!r}: {item.strip()!r} is not a {unit} rank or an inclusive range like 0-7")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        if hi < lo:
            raise ConfigError(f"{key}={text!r}: the range {item.strip()!r} runs backwards")
        gpus.extend(range(lo, hi + 1))
    seen: set[int] = set()
    for g in gpus:
        if g in seen:
            raise ConfigError(f"{key}={text!r} lists {unit} {g} twice: a role uses each {unit} at most once")
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
    gpus_per_node: tuple[int, ...]
    """The GPUs of each node, node 0 first."""
    colocated: bool
    train_workers: tuple[TrainWorker, ...]
    engines: tuple[Engine, ...]
    gpus_per_engine: int
    aux: dict[str, tuple[Engine, ...]] = field(default_factory=dict)
    """The engines of each model beside the policy (models.<name>), by name: one on each node
    that serves it, numbered 0 on its node."""

    @property
    def on_gpu(self) -> bool:
        return any(w.gpu is not None for w in self.train_workers)

    def engine_gpus_on(self, node: int) -> int:
        """GPUs the node's engines hold (on CPU: its engine count), its ``--rank-weights auto`` weight."""
        return sum(len(e.gpus) or 1 for e in self.engines_on(node))

    def train_workers_on(self, node: int) -> list[TrainWorker]:
        return [w for w in self.train_workers if w.node == node]

    def engines_on(self, node: int) -> list[Engine]:
        return [e for e in self.engines if e.node == node]

    def aux_on(self, name: str, node: int) -> Engine | None:
        """The engine of models.<name> that ``node`` runs, if it serves that model."""
        return next((e for e in self.aux.get(name, ()) if e.node == node), None)

    def serving(self, name: str) -> tuple[int, ...]:
        """The nodes that serve models.<name>."""
        return tuple(e.node for e in self.aux.get(name, ()))

    @property
    def checkpoint_node(self) -> int:
        """The node of train worker 0: it hosts the training rendezvous and writes the checkpoint."""
        return self.train_workers[0].node

    def without(self, nodes) -> "Placement":
        """The placement once the run goes on without ``nodes`` (coordination.elastic): their
        train workers leave the training group and the others are numbered 0.. in the same
        order (the update does not depend on the number of workers: train/plan.py). Their
        engines stay listed; the plan gives those nodes no rollout work."""
        gone = set(nodes)
        kept = [w for w in self.train_workers if w.node not in gone]
        workers = tuple(TrainWorker(rank=i, node=w.node, gpu=w.gpu) for i, w in enumerate(kept))
        return dataclasses.replace(self, train_workers=workers)


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


def check_role_nodes(train_nodes: str, rollout_nodes: str, num_nodes: int, *, gpu: bool,
                     serving: Mapping[str, Serving] = {}) -> tuple[tuple[int, ...], tuple[int, ...]]:  # noqa: B006 - read only
    """``train.nodes`` and ``rollout.nodes`` parsed (empty: every node), checked against the
    cluster: on CPU only, within 0..num_nodes-1, and every node with a role (a node named to
    serve a model beside the policy, ``serving`` as :func:`check_aux` returns it, has one)."""
    train = parse_mapping(train_nodes, "train.nodes", unit="node")
    rollout = parse_mapping(rollout_nodes, "rollout.nodes", unit="node")
    if gpu:
        if train or rollout:
            raise ConfigError("train.nodes and rollout.nodes place the roles of a CPU run; with device mappings the "
                              "mappings place them: leave the nodes empty")
        return (), ()
    for key, nodes in (("train.nodes", train), ("rollout.nodes", rollout)):
        beyond = [n for n in nodes if n >= num_nodes]
        if beyond:
            raise ConfigError(f"{key} names node {max(beyond)}, but the run has {num_nodes} node(s): 0-{num_nodes - 1}")
    train, rollout = train or tuple(range(num_nodes)), rollout or tuple(range(num_nodes))
    serves = {n for model in serving.values() for n in model.nodes}
    idle = [n for n in range(num_nodes) if n not in train and n not in rollout and n not in serves]
    if idle:
        raise ConfigError(f"{', '.join(f'node {n}' for n in idle)} would neither train nor roll out: name "
                          f"{'it' if len(idle) == 1 else 'them'} in train.nodes or rollout.nodes, or run on fewer nodes")
    return train, rollout


def check_cpu_weights(weights: Sequence[float], rollout_nodes: Sequence[int]) -> None:
    """On CPU, the nodes that roll out need a positive weight and the others weight 0."""
    for n, w in enumerate(weights):
        if n in rollout_nodes and w <= 0:
            raise ConfigError(f"--rank-weights gives node {n} weight {w:g}, but it runs an engine and rolls out"
                              f"{'' if len(rollout_nodes) < len(weights) else ' (every node does without rollout.nodes)'}: "
                              f"give it a positive weight, or auto")
        if n not in rollout_nodes and w > 0:
            raise ConfigError(f"--rank-weights gives node {n} weight {w:g}, but rollout.nodes does not name it: it runs no "
                              f"engine; give it 0, or auto")


def per_node_counts(num_nodes: int, gpus_per_node: int | Sequence[int]) -> tuple[int, ...]:
    """One GPU count per node: a single number is every node's."""
    if isinstance(gpus_per_node, int):
        return (gpus_per_node,) * num_nodes
    counts = tuple(gpus_per_node)
    if len(counts) != num_nodes:
        raise ConfigError(f"{len(counts)} GPU count(s) ({','.join(map(str, counts))}) for {num_nodes} node(s): give one per node")
    return counts


def _describe(counts: tuple[int, ...]) -> str:
    if len(set(counts)) == 1:
        return f"{len(counts)} node(s) x {counts[0]} GPUs per node"
    return f"{len(counts)} nodes of {','.join(map(str, counts))} GPUs"


def resolve(
    *,
    num_nodes: int,
    gpus_per_node: int | Sequence[int],
    train_mapping: str,
    rollout_mapping: str,
    gpus_per_engine: int = 1,
    engine_port: int = 8000,
    train_nodes: str = "",
    rollout_nodes: str = "",
    models: Mapping = {},  # noqa: B006 - read only
) -> Placement:
    """The placement of both roles on ``num_nodes`` nodes with ``gpus_per_node`` GPUs (one
    count for all, or one per node); on CPU, on ``train_nodes`` and ``rollout_nodes``
    (``check_role_nodes``); and of the ``models`` beside the policy (name -> its section, with
    ``nodes`` and ``device_mapping``). Raises ConfigError naming the numbers when the mappings
    do not fit."""
    if num_nodes < 1:
        raise ConfigError(f"the cluster needs at least 1 node, got {num_nodes}")
    train, rollout = check_mappings(train_mapping, rollout_mapping, gpus_per_engine)
    serving = check_aux(models, train, rollout, num_nodes)
    trainers, rollers = check_role_nodes(train_nodes, rollout_nodes, num_nodes, gpu=bool(train), serving=serving)
    if not train:
        placed = _cpu(num_nodes, engine_port, trainers, rollers)
        aux = {name: tuple(Engine(engine=0, node=n, gpus=(), port=0) for n in serving[name].nodes or rollers) for name in models}
        return dataclasses.replace(placed, aux=aux)
    counts = per_node_counts(num_nodes, gpus_per_node)
    owner = [(n, local) for n, c in enumerate(counts) for local in range(c)]  # global GPU rank -> (node, local id)
    aux_gpus = {f"models.{name}.device_mapping": s.gpus for name, s in serving.items()}
    for key, gpus in (("train.device_mapping", train), ("rollout.device_mapping", rollout), *aux_gpus.items()):
        beyond = [g for g in gpus if g >= len(owner)]
        if beyond:
            raise ConfigError(f"{key} uses GPU {max(beyond)}, but {_describe(counts)} have GPUs 0-{len(owner) - 1}"
                              if owner else f"{key} needs GPUs, but the {num_nodes} node(s) have none")
    workers = tuple(TrainWorker(rank=i, node=owner[g][0], gpu=owner[g][1]) for i, g in enumerate(train))
    engines: list[Engine] = []
    per_node: dict[int, int] = {}
    for e in range(len(rollout) // gpus_per_engine):
        chunk = rollout[e * gpus_per_engine : (e + 1) * gpus_per_engine]
        nodes = sorted({owner[g][0] for g in chunk})
        if len(nodes) > 1:
            raise ConfigError(
                f"engine {e} would straddle nodes {' and '.join(map(str, nodes))}: its GPUs {','.join(map(str, chunk))} "
                f"(rollout.gpus_per_engine={gpus_per_engine}, {_describe(counts)}); an engine's GPUs must be on one node"
            )
        node = nodes[0]
        k = per_node.get(node, 0)
        per_node[node] = k + 1
        port = engine_port + k if engine_port else 0  # 0: any free port, chosen at start
        engines.append(Engine(engine=e, node=node, gpus=tuple(owner[g][1] for g in chunk), port=port))
    aux: dict[str, tuple[Engine, ...]] = {}
    for name, gpus in zip(models, aux_gpus.values()):
        by_node: dict[int, list[int]] = {}
        for g in gpus:
            by_node.setdefault(owner[g][0], []).append(owner[g][1])
        aux[name] = tuple(Engine(engine=0, node=n, gpus=tuple(local), port=0) for n, local in sorted(by_node.items()))
    serving = {e.node for engines_ in aux.values() for e in engines_}
    idle = [n for n in range(num_nodes) if n not in per_node and n not in serving and not any(w.node == n for w in workers)]
    if idle:
        raise ConfigError(
            f"{', '.join(f'node {n}' for n in idle)} would neither train nor roll out: no GPU of "
            f"{'it' if len(idle) == 1 else 'them'} is in train.device_mapping or rollout.device_mapping ({_describe(counts)}); "
            f"map some of its GPUs, or run on fewer nodes")
    return Placement(
        num_nodes=num_nodes,
        gpus_per_node=counts,
        colocated=bool(set(train) & set(rollout)),
        train_workers=workers,
        engines=tuple(engines),
        gpus_per_engine=gpus_per_engine,
        aux=aux,
    )


class Serving(NamedTuple):
    """Where a model beside the policy is served, as its section names it (parsed)."""

    nodes: tuple[int, ...]
    """On CPU, ``nodes`` (empty: every node that rolls out); empty on GPUs."""
    gpus: tuple[int, ...]
    """On GPUs, ``device_mapping`` (global GPU ranks); empty on CPU."""


def check_aux(models: Mapping, train: Sequence[int], rollout: Sequence[int], num_nodes: int) -> dict[str, Serving]:
    """The models beside the policy (name -> its section) checked against the placement of
    the policy's roles (``train``, ``rollout``: the parsed mappings, empty on CPU) without the
    cluster's GPU counts: on CPU ``nodes`` within the run and no ``device_mapping``; on GPUs a
    ``device_mapping`` of GPUs of its own and no ``nodes``. Returns where each is served."""
    named: dict[str, Serving] = {}
    owners: dict[int, str] = {}
    for name, model in models.items():
        nodes_key, gpus_key = f"models.{name}.nodes", f"models.{name}.device_mapping"
        nodes = parse_mapping(model.nodes, nodes_key, unit="node")
        gpus = parse_mapping(model.device_mapping, gpus_key)
        if not train:
            if gpus:
                raise ConfigError(f"{gpus_key}={model.device_mapping} places models.{name} on GPUs, but this run is on CPU "
                                  f"(no train.device_mapping/rollout.device_mapping): use {nodes_key} to choose the nodes "
                                  f"that serve it, or unset it")
            beyond = [n for n in nodes if n >= num_nodes]
            if beyond:
                raise ConfigError(f"{nodes_key} names node {max(beyond)}, but the run has {num_nodes} node(s): 0-{num_nodes - 1}")
            named[name] = Serving(tuple(nodes), ())
            continue
        if nodes:
            raise ConfigError(f"{nodes_key} chooses the nodes that serve models.{name} on CPU; on GPUs {gpus_key} places "
                              f"it: leave {nodes_key} empty")
        if not gpus:
            raise ConfigError(f"models.{name} needs GPUs of its own in a GPU run: set {gpus_key} (global GPU ranks, as "
                              f"rollout.device_mapping) to GPUs outside train.device_mapping and rollout.device_mapping")
        for g in gpus:
            role = "train.device_mapping" if g in train else "rollout.device_mapping" if g in rollout else None
            if role:
                raise ConfigError(f"{gpus_key}={model.device_mapping} shares GPU {g} with {role}: a model beside the policy "
                                  f"holds its GPUs for the whole run; give it GPUs of its own")
            if g in owners:
                raise ConfigError(f"{gpus_key} and models.{owners[g]}.device_mapping both use GPU {g}: give each its own")
            owners[g] = name
        named[name] = Serving((), tuple(gpus))
    return named


def _cpu(num_nodes: int, engine_port: int, train_nodes: Sequence[int], rollout_nodes: Sequence[int]) -> Placement:
    """One train worker on each of ``train_nodes``, one engine on each of ``rollout_nodes``:
    colocated when a node has both (the CPU default, every node both)."""
    return Placement(
        num_nodes=num_nodes,
        gpus_per_node=(0,) * num_nodes,
        colocated=bool(set(train_nodes) & set(rollout_nodes)),
        train_workers=tuple(TrainWorker(rank=i, node=n, gpu=None) for i, n in enumerate(train_nodes)),
        engines=tuple(Engine(engine=i, node=n, gpus=(), port=engine_port) for i, n in enumerate(rollout_nodes)),
        gpus_per_engine=0,
    )


def rollout_weights(placement: Placement, weights: Sequence[float] | None, hosts: Sequence[str] | None = None) -> tuple[float, ...]:
    """Each node's share of rollout and eval: ``--rank-weights`` checked against the engines
    (a node with engines needs a positive weight, a node without takes 0), or with ``None``
    (``--rank-weights auto``) its engines' GPUs."""
    if weights is None:
        return tuple(float(placement.engine_gpus_on(n)) for n in range(placement.num_nodes))

    def name(n: int) -> str:
        return f"node {n}" + (f" ({hosts[n]})" if hosts else "")

    for n, w in enumerate(weights):
        engines = placement.engines_on(n)
        if engines and w <= 0:
            raise ConfigError(f"--rank-weights gives {name(n)} weight {w:g}, but it runs {len(engines)} rollout engine(s): "
                              f"give it a positive weight, or --rank-weights auto (each node by its engines' GPUs)")
        if not engines and w > 0:
            why = "rollout.device_mapping has none of its GPUs" if placement.gpus_per_engine else "rollout.nodes does not name it"
            raise ConfigError(f"--rank-weights gives {name(n)} weight {w:g}, but it runs no rollout engine ({why}): "
                              f"give it 0, or --rank-weights auto")
    return tuple(weights)


def cluster_gpus(reports: dict[int, dict]) -> tuple[int, ...]:
    """Each node's GPU count, node 0 first, from the reports ``{node: {"count", ...}}``."""
    return tuple(r["count"] for _, r in sorted(reports.items()))

class Unplaceable(Exception):
    """The cluster does not fit the GPU placement; ``culprit`` is the node to blame."""

    def __init__(self, culprit: Culprit):
        super().__init__(culprit.error)
        self.culprit = culprit


def place(*, num_nodes: int, rank_weights, train, rollout, max_staleness: int, reports: dict[int, dict],
          models: Mapping = {}) -> Placement:  # noqa: B006 - read only
    """The placement for the GPUs the nodes reported (``reports``: node -> its GPU report and
    host), decided once by the master before any work; ``train``, ``rollout`` and ``models``:
    the run's sections of those names. Raises :class:`Unplaceable` naming the node to blame."""
    import logging

    try:
        gpus_per_node = cluster_gpus(reports) if train.device_mapping else 0
        resolved = resolve(
            num_nodes=num_nodes, gpus_per_node=gpus_per_node, train_mapping=train.device_mapping,
            rollout_mapping=rollout.device_mapping, gpus_per_engine=rollout.gpus_per_engine, engine_port=rollout.engine_port,
            train_nodes=train.nodes, rollout_nodes=rollout.nodes, models=models,
        )
        rollout_weights(resolved, rank_weights, [reports[n]["host"] for n in sorted(reports)])
        if max_staleness and resolved.colocated:
            raise ConfigError(f"rl.max_staleness={max_staleness} runs rollout while training, so the engines need GPUs "
                              f"of their own, but the device mappings share some with the train workers: map them apart")
    except ConfigError as e:
        seen = "; ".join(f"node {n} ({r['host']}): {r['count']} GPU(s) ({r['source']})" for n, r in sorted(reports.items()))
        node = _short_node(reports)
        message = f"the cluster does not fit the GPU placement: {e}. The nodes report: {seen}"
        raise Unplaceable(Culprit(node, reports[node]["host"], None, None, FailureKind.ERROR, message)) from None
    if resolved.on_gpu:
        logging.getLogger(__name__).info("placement: %d train worker(s), %d engine(s), %s", len(resolved.train_workers),
                                         len(resolved.engines), "colocated" if resolved.colocated else "disaggregated")
    return resolved


def _short_node(reports: dict[int, dict]) -> int:
    """The node to blame: the one with the fewest GPUs when counts differ, else node 0."""
    counts = {n: r["count"] for n, r in reports.items()}
    if len(set(counts.values())) > 1:
        return min(counts, key=lambda n: (counts[n], n))
    return 0
