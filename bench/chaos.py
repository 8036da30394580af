"""A seeded random fault soak that hunts hangs: real rank processes, a fault at a random point
of the run, recovery as the docs say, and the reliability promises checked after every episode.

    python bench/chaos.py --episodes 12 --seed 1             # rehearsal, elastic off and on
    python bench/chaos.py --budget-s 1800 --seed 5 --elastic on
    python bench/chaos.py --episodes 0 --rl-episodes 2       # the RL loop on demo data

Why: each fault of docs/reliability.md has its own test, at a point of the run someone chose.
A soak puts the same faults at points nobody chose (any rank, iteration and phase, recovered
from by the operator's recipe) and checks what that page promises every time: no process
outlives its deadline, no task is lost or done twice, nothing is left running, and the
failure names the rank that failed.

An episode: a fresh log path and three rehearsal ranks, each ``orchestrator run`` in its own
session with its output in a file per rank per start (``<out>/e<N>/rank<R>.start<K>.log``, K
counting the episode's starts); 3 iterations at weights 2,1,1, eval every second, the tests'
fast settings with a node timeout of 3 s and ``rehearsal.work_s=0.3``; ``coordination.elastic``
on or off (``--elastic both``: off on odd episodes, on on even ones). One fault: its kind is
the episode's turn in the kinds shuffled by ``--seed`` (each kind once every len(KINDS)
episodes); its rank(s), its moment (a faulted rank's heartbeat reaching a random iteration and
phase; in the last iteration no later than 10:train, whose quick tail could pass unseen) and
its durations come from ``random.Random(seed * 1000 + episode)``. ``--first N`` starts at
episode N: ``--seed S --first N --episodes 1`` runs one episode again.

    kill9-worker, kill9-master, kill9-two, kill9-all   kill -9 of each rank's process tree
    kill9-restart       kill -9, and the same command started again at once
    stop-short          SIGSTOP for 1-2 s (under the node timeout), then SIGCONT
    stop-long-worker, stop-long-master   SIGSTOP for 5-12 s, then SIGCONT
    sigterm, sigint     the signal to the rank
    sigterm-kill9       SIGTERM, then kill -9 of its tree 0.05-1 s later

Recovery, as docs/operations.md says: without elastic, once every process of the failed
attempt has ended, every rank that exited is started again with the same command ("re-run
the same commands on every node"); with elastic, a rank that exited is started again alone
0-2 s later (a worker rejoins; workers wait for a restarted master). Until every rank exited 0
on a complete run, within a bound.

Checks:

    hang       no rank process alive without moving (its heartbeats' attempt, iteration,
               phase, state and progress; the last released barrier; the lease) for longer
               than node timeout + join timeout + a margin, and the run done within its
               bound; else the rank's log tail and ``status --json`` are kept, and
               everything is killed
    tasks      each iteration's train (and eval) aggregate holds every task of its plan
               (``iterations/<I>/plan.json``) once: lost, duplicated and extra ids counted
    orphans    no process whose command line names the log path is left
    misnamed   a fault that ended its attempt is the root cause ``status --json`` gives for
               that attempt (``failure``: a faulted rank; kind dead, or interrupted after
               SIGINT/SIGTERM; an iteration and a phase label); after kill9-all, status
               says ``gone``; a complete run shows no failure

``--rl-episodes M`` adds M episodes of the real loop on demo data with the defaults that move
the policy (weights published as deltas, each rollout node rebuilding each version, the
training state written only at the last of 3 iterations, ``checkpoint.state_every=3``) and
``rl.max_staleness=1`` (``rl.is_correction=none``): rank 0 trains, ranks 1 and 2 roll out,
the tests' small settings.
The fault: a rollout node killed or frozen past the node timeout, the trainer's node killed,
or every node killed, when the rank reaches rollout, training (where a new trainer replays),
publish or the engines' move (where a node rebuilds the version). One more check:

    weights    the last checkpoint's files (published weights or delta, fp32 master, AdamW
               state) are byte for byte those of the same run without a fault, made once at
               the start (``reference/``), whenever the aggregates trained on are the same
               (a sample rolled out again may come out otherwise: then not compared)

Prints a line per episode and tables by fault kind; ``--json`` writes the same as an object.
Exit 1 on any hang, lost, duplicated or extra task, or orphan; misnamed faults and other
anomalies are reported, not failed on.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import console, descendants, machine, python_env, table, write_json  # noqa: E402
from orchestrator.data import summary  # noqa: E402
from orchestrator.ops import status  # noqa: E402
from orchestrator.phase_table import Phase  # noqa: E402
from orchestrator.protocol import fsio  # noqa: E402
from orchestrator.protocol.wire import TERMINAL_STATES  # noqa: E402
from orchestrator.protocol.layout import RunLayout  # noqa: E402

TICK_S = 0.05
SIGNATURE_EVERY_S = 0.25
PHASE_LABEL = re.compile(r"\d{1,2}:[a-z_]+")


@dataclass(frozen=True)
class Setup:
    """One kind of episode: its ranks, flags and time bounds."""

    num_nodes: int
    weights: str
    iterations: int
    settings: tuple[str, ...]
    node_timeout_s: float
    join_timeout_s: float
    margin_s: float
    bound_s: float
    trigger_phases: tuple[int, ...]

    @property
    def stall_s(self) -> float:
        """How long a live rank may stand still before it counts as hung."""
        return self.node_timeout_s + self.join_timeout_s + self.margin_s


REHEARSAL = Setup(
    3, "2,1,1", 3,
    ("--rehearsal", "--eval-interval=2", "rehearsal.tasks=12", "rehearsal.eval_tasks=6",
     "coordination.heartbeat_interval_s=0.5", "coordination.node_timeout_s=3", "coordination.join_timeout_s=20",
     "rehearsal.work_s=0.3"),
    node_timeout_s=3, join_timeout_s=20, margin_s=15, bound_s=150, trigger_phases=tuple(range(14)),
)
RL = Setup(
    3, "0,1,1", 3,
    ("--eval-interval=2", "rl.train_tasks=8", "rl.samples_per_prompt=4", "rl.eval_tasks=16", "rl.eval_samples=2",
     "rl.epochs=1", "rl.micro_batch=4", "coordination.heartbeat_interval_s=0.5", "coordination.node_timeout_s=10",
     "coordination.join_timeout_s=60", "rollout.engine_port=0",
     # the defaults publish deltas (publish.delta) and write the state every 10 iterations: here only
     # at the last, so a trainer started again after a kill replays what came before it
     "checkpoint.state_every=3", "rl.max_staleness=1", "train.nodes=0", "rollout.nodes=1-2",
     # no importance correction (auto: tis with a staleness): the update then depends on the samples'
     # tokens and rewards, not on the engines' log-probs, whose last bits vary with how requests batch
     "rl.is_correction=none"),
    node_timeout_s=10, join_timeout_s=60, margin_s=30, bound_s=600,
    trigger_phases=(int(Phase.ROLLOUT), int(Phase.TRAIN), int(Phase.PUBLISH), int(Phase.ENGINE_RESTART)),
)

# kind: (whom it hits, its steps as (seconds after the trigger, or a range for the RNG; action))
KINDS = {
    "kill9-worker": ("worker", [(0, "kill")]),
    "kill9-master": ("master", [(0, "kill")]),
    "kill9-two": ("two", [(0, "kill")]),
    "kill9-all": ("all", [(0, "kill"), (0, "gone")]),
    "kill9-restart": ("any", [(0, "kill"), (0, "start")]),
    "stop-short": ("any", [(0, "stop"), ((1, 2), "cont")]),
    "stop-long-worker": ("worker", [(0, "stop"), ((5, 12), "cont")]),
    "stop-long-master": ("master", [(0, "stop"), ((5, 12), "cont")]),
    "sigterm": ("any", [(0, "term")]),
    "sigint": ("any", [(0, "int")]),
    "sigterm-kill9": ("any", [(0, "term"), ((0.05, 1.0), "kill")]),
}
RL_KINDS = {
    "rl-kill9-worker": ("worker", [(0, "kill")]),
    "rl-kill9-master": ("master", [(0, "kill")]),
    "rl-kill9-all": ("all", [(0, "kill")]),
    "rl-stop-long-worker": ("worker", [(0, "stop"), ((12, 16), "cont")]),
}


# -- an episode's plan ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Step:
    at_s: float
    action: str


@dataclass(frozen=True)
class EpisodeSpec:
    episode: int
    seed: int
    setup: Setup
    kind: str
    elastic: bool
    ranks: tuple[int, ...]
    trigger: tuple[int, int, int]  # (rank watched, iteration, phase)
    steps: tuple[Step, ...]
    restart_delay_s: float

    @property
    def rng_seed(self) -> int:
        return self.seed * 1000 + self.episode


def pick_ranks(who: str, rng: random.Random, n: int) -> tuple[int, ...]:
    return {
        "worker": lambda: (rng.randrange(1, n),),
        "master": lambda: (0,),
        "any": lambda: (rng.randrange(n),),
        "two": lambda: tuple(sorted(rng.sample(range(n), 2))),
        "all": lambda: tuple(range(n)),
    }[who]()


def plan_episode(seed: int, episode: int, setup: Setup, kinds: dict, elastic_mode: str) -> EpisodeSpec:
    """Episode ``episode`` (from 1): its kind in turn from ``kinds`` shuffled by ``seed``, the
    rest from ``random.Random(seed * 1000 + episode)``."""
    deck = sorted(kinds)
    random.Random(seed).shuffle(deck)
    kind = deck[(episode - 1) % len(deck)]
    rng = random.Random(seed * 1000 + episode)
    who, steps = kinds[kind]
    ranks = pick_ranks(who, rng, setup.num_nodes)
    trigger = (rng.choice(ranks), rng.randint(1, setup.iterations), rng.choice(setup.trigger_phases))
    if trigger[1] == setup.iterations and trigger[2] > Phase.TRAIN:
        trigger = (trigger[0], setup.iterations, int(Phase.TRAIN))  # the last iteration's quick tail may pass unseen
    timed = tuple(Step(rng.uniform(*at) if isinstance(at, tuple) else at, action) for at, action in steps)
    elastic = {"on": True, "off": False}.get(elastic_mode, episode % 2 == 0)
    return EpisodeSpec(episode, seed, setup, kind, elastic, ranks, trigger, timed, rng.uniform(0, 2))


def run_flags(spec: EpisodeSpec, log_path: Path, data_path: Path) -> list[str]:
    s = spec.setup
    return [f"--data-path={data_path}", f"--log-path={log_path}", "--rl-phase=both", f"--num-nodes={s.num_nodes}",
            f"--rank-weights={s.weights}", f"--max-iterations={s.iterations}", *s.settings,
            *(["coordination.elastic=true"] if spec.elastic else [])]


# -- processes -----------------------------------------------------------------------------------

@dataclass
class RankRun:
    """One start of one rank's command."""

    rank: int
    proc: subprocess.Popen
    log: Path
    wave: int
    moved: float
    exited_at: float | None = None
    stopped: bool = False
    signature: tuple = ()

    @property
    def alive(self) -> bool:
        return self.exited_at is None

    @property
    def code(self) -> int | None:
        return self.proc.returncode


def kill_node(pid: int) -> None:
    """kill -9 of a rank's whole tree, as when its node dies: its session, then anything below
    it that left the session."""
    tree = descendants(pid)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    for child in tree:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(child, signal.SIGKILL)


def names_path(cmdline: list[str], path: Path) -> bool:
    return re.search(re.escape(str(path)) + r"(?=$|/|\s)", " ".join(cmdline or [])) is not None


def leftovers(log_path: Path, grace_s: float = 5.0) -> list[dict]:
    """Processes whose command line names ``log_path``, once ``grace_s`` has let the dying go;
    those found are killed after they are listed."""
    deadline = time.monotonic() + grace_s
    while True:
        found = []
        for p in psutil.process_iter(["pid", "cmdline", "status"]):
            if p.info["status"] != psutil.STATUS_ZOMBIE and names_path(p.info["cmdline"], log_path):
                found.append({"pid": p.info["pid"], "cmdline": " ".join(p.info["cmdline"])[:300]})
        if not found or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for p in found:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p["pid"], signal.SIGKILL)
    return found


def log_tail(path: Path, lines: int = 20) -> str:
    """The last ``lines`` lines of a rank's log, a line repeated (but for its time stamp) once
    with its count: a rank that loops says so in one line."""
    kept: list[list] = []  # [line, line without its stamp, count, the last one's stamp]
    for line in path.read_text(errors="replace").splitlines():
        stamp, _, text = line.partition(" ")
        if kept and kept[-1][1] == text:
            kept[-1][2:] = [kept[-1][2] + 1, stamp]
        else:
            kept.append([line, text, 1, stamp])
    return "\n".join(line if n == 1 else f"{line}  [{n} times, the last at {last}]" for line, _, n, last in kept[-lines:])


def status_json(log_path: Path) -> dict:
    """``orchestrator status --log-path L --json``, or what went wrong running it."""
    out = subprocess.run([sys.executable, "-m", "orchestrator", "status", f"--log-path={log_path}", "--json"],
                         capture_output=True, text=True, timeout=60, env=python_env())
    return json.loads(out.stdout) if out.returncode == 0 else {"exit": out.returncode, "stderr": out.stderr[-2000:]}


# -- reading the run -----------------------------------------------------------------------------

def current_attempt(layout: RunLayout) -> str | None:
    lease = fsio.read_record(layout.lease)
    return lease["attempt"] if lease else None


def heartbeats_of(layout: RunLayout, rank: int, pid: int) -> list[dict]:
    """Rank ``rank``'s heartbeats written by process ``pid``, in any attempt."""
    beats = []
    with contextlib.suppress(FileNotFoundError):
        for attempt in sorted(layout.attempts.iterdir()):
            hb = fsio.read_record(layout.attempt(attempt.name).heartbeat(rank))
            if hb and hb.get("pid") == pid:
                beats.append(hb)
    return beats


def position(hb: dict) -> tuple[int, int]:
    phase = Phase.from_label(hb.get("phase"))
    return hb.get("iteration") or 0, -1 if phase is None else int(phase)


def read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


def out_events(layout: RunLayout, attempt: str) -> list[dict]:
    members = fsio.read_record(layout.attempt(attempt).members) or {}
    return [e for e in members.get("events", []) if e.get("event") == "out"]


def out_ranks(layout: RunLayout, attempt: str) -> set[int]:
    return {int(r) for r in (fsio.read_record(layout.attempt(attempt).members) or {}).get("out", {})}


def run_complete(layout: RunLayout, iterations: int) -> bool:
    return all((summary.read(layout, i) or {}).get("complete") for i in range(1, iterations + 1))


def task_check(layout: RunLayout, iterations: list[int], rehearsal: bool) -> dict:
    """Lost, duplicated and extra task ids of each iteration's aggregates against its plan."""
    found = {"lost": 0, "duplicated": 0, "extra": 0, "details": []}
    for i in iterations:
        plan = fsio.read_record(layout.iteration(i).plan) or {}
        for split in ("train", "eval"):
            if not (plan.get(split) or {}).get("enabled"):
                continue
            total = plan[split]["total"]
            path = layout.iteration(i).aggregate(split)
            ids = [json.loads(line)["task_id"] for line in path.read_text().splitlines()] if path.exists() else []
            unique = set(ids)
            if rehearsal:
                planned = {f"{split}-{i:06d}-{k:06d}" for k in range(total)}  # the rehearsal workload's ids
                lost, extra = len(planned - unique), len(unique - planned)
            else:
                lost, extra = max(0, total - len(unique)), max(0, len(unique) - total)
            dup = len(ids) - len(unique)
            for key, n in (("lost", lost), ("duplicated", dup), ("extra", extra)):
                found[key] += n
            if lost or dup or extra:
                twice = sorted(t for t, c in Counter(ids).items() if c > 1)
                found["details"].append(f"iteration {i} {split}: {len(ids)} ids for {total} tasks, lost {lost}, "
                                        f"duplicated {dup} {twice[:5]}, extra {extra}")
    return found


# -- one episode ---------------------------------------------------------------------------------

@dataclass
class Outcome:
    """What an episode did and what its checks found."""

    episode: int
    rng_seed: int
    kind: str
    elastic: bool
    ranks: list[int]
    trigger: list[int]
    phase_at_fault: str | None = None
    detection_s: float | None = None
    restarts: int = 0
    seconds: float = 0.0
    exits: list[list] = field(default_factory=list)
    hangs: list[dict] = field(default_factory=list)
    tasks: dict = field(default_factory=dict)
    orphans: list[dict] = field(default_factory=list)
    misnamed: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    weights: str = ""
    """RL: ``equal`` (the last checkpoint's files are the uninterrupted run's, byte for byte),
    ``differ`` (and its aggregates are the same: a failure), ``aggregates differ`` (a sample
    was rolled out again and came out otherwise: not compared), or empty (not checked)."""
    replayed: list = field(default_factory=list)
    log_path: str = ""

    @property
    def failed(self) -> bool:
        t = self.tasks
        return bool(self.hangs or self.orphans or t.get("lost") or t.get("duplicated") or t.get("extra") or self.weights == "differ")

    def result(self) -> str:
        t = self.tasks
        parts = [f"HANG r{','.join(str(h['rank']) for h in self.hangs)}" if self.hangs else "",
                 f"lost {t['lost']}" if t.get("lost") else "", f"dup {t['duplicated']}" if t.get("duplicated") else "",
                 f"extra {t['extra']}" if t.get("extra") else "", f"orphans {len(self.orphans)}" if self.orphans else "",
                 "WEIGHTS DIFFER" if self.weights == "differ" else "",
                 "misnamed" if self.misnamed else "", "notes" if self.notes else ""]
        return " ".join(p for p in parts if p) or "ok"


class Episode:
    """Starts the ranks, injects the fault, restarts what exited, and watches for hangs."""

    def __init__(self, spec: EpisodeSpec, root: Path, data_path: Path, reference: "Reference | None" = None):
        self.spec, self.setup, self.root, self.reference = spec, spec.setup, root, reference
        self.log_path = root / "run"
        self.layout = RunLayout(self.log_path)
        self.argv = run_flags(spec, self.log_path, data_path)
        self.runs: dict[int, RankRun] = {}
        self.starts = self.wave = 0
        self.pending: list[tuple[float, Step, list[RankRun]]] = []
        self.fault_at: float | None = None
        self.fault_attempt: str | None = None
        self.outs_before = 0
        self.next_signature = self.t0 = 0.0
        self.out = Outcome(spec.episode, spec.rng_seed, spec.kind, spec.elastic, list(spec.ranks), list(spec.trigger),
                           log_path=str(self.log_path))

    # -- processes -------------------------------------------------------------------------------
    def start(self, rank: int, wave: int) -> None:
        self.starts += 1
        log = self.root / f"rank{rank}.start{self.starts}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen([sys.executable, "-m", "orchestrator", "run", *self.argv, "--master" if rank == 0 else f"--worker={rank}"],
                                    stdout=out, stderr=subprocess.STDOUT, env=python_env(), start_new_session=True)
        self.runs[rank] = RankRun(rank, proc, log, wave, moved=time.monotonic())

    def restart(self, runs: list[RankRun]) -> None:
        if not runs:
            return
        self.wave += 1
        for run in runs:
            self.start(run.rank, self.wave)

    def reap(self, now: float) -> None:
        for run in self.runs.values():
            if run.alive and run.proc.poll() is not None:
                run.exited_at = now
                self.out.exits.append([round(now - self.t0, 1), run.rank, run.code])

    def kill_all(self) -> None:
        for run in self.runs.values():
            if run.alive:
                kill_node(run.proc.pid)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    run.proc.wait(timeout=10)

    # -- the fault -------------------------------------------------------------------------------
    def trigger_beat(self) -> dict | None:
        """The watched rank's heartbeat once it has reached the trigger's iteration and phase."""
        rank, iteration, phase = self.spec.trigger
        attempt = current_attempt(self.layout)
        hb = fsio.read_record(self.layout.attempt(attempt).heartbeat(rank)) if attempt else None
        if hb and hb.get("state") not in TERMINAL_STATES and position(hb) >= (iteration, phase):
            return hb
        return None

    def inject(self, now: float, hb: dict) -> None:
        self.fault_at = now
        self.fault_attempt = hb["attempt"]
        self.outs_before = len(out_events(self.layout, self.fault_attempt))
        self.out.phase_at_fault = f"i{hb.get('iteration')} {hb.get('phase')}"
        targets = [self.runs[r] for r in self.spec.ranks]
        self.pending = [(now + step.at_s, step, targets) for step in self.spec.steps]

    def run_due_steps(self, now: float) -> None:
        due = [p for p in self.pending if p[0] <= now]
        self.pending = [p for p in self.pending if p[0] > now]
        for _, step, targets in due:
            if step.action == "gone":
                self.wait_gone()
                continue
            for run in targets:
                self.act(step.action, run)

    def act(self, action: str, run: RankRun) -> None:
        if action == "start":
            self.start(run.rank, self.wave + 1)  # of the next wave: it outlives the attempt it left
            return
        if not run.alive:
            return
        if action == "kill":
            kill_node(run.proc.pid)
            with contextlib.suppress(subprocess.TimeoutExpired):
                run.proc.wait(timeout=10)
            self.reap(time.monotonic())
            return
        os.kill(run.proc.pid, {"stop": signal.SIGSTOP, "cont": signal.SIGCONT, "term": signal.SIGTERM, "int": signal.SIGINT}[action])
        run.stopped = action == "stop"
        run.moved = time.monotonic()

    def wait_gone(self) -> None:
        """After every rank was killed: status must say so once a node timeout has passed."""
        deadline = time.monotonic() + self.setup.node_timeout_s + 10
        while time.monotonic() < deadline:
            if status.snapshot(self.log_path)["gone"] is not None:
                self.out.detection_s = round(time.monotonic() - self.fault_at, 2)
                return
            time.sleep(0.2)
        self.out.misnamed.append("every rank killed, but status --json never said `gone`")

    def note_detection(self, now: float) -> None:
        """When the run first showed that it noticed the fault: the attempt aborted, a rank not
        faulted wrote a failure or exited, or the master marked a rank out."""
        if self.fault_at is None or self.out.detection_s is not None:
            return
        attempt = self.layout.attempt(self.fault_attempt)
        others = [r for r in range(self.setup.num_nodes) if r not in self.spec.ranks]
        if (attempt.abort.exists() or any(attempt.failure(r).exists() for r in others)
                or len(out_events(self.layout, self.fault_attempt)) > self.outs_before
                or any(self.runs[r].code not in (None, 0) and self.runs[r].exited_at > self.fault_at for r in others)):
            self.out.detection_s = round(now - self.fault_at, 2)

    # -- hangs -----------------------------------------------------------------------------------
    def stalled(self, now: float) -> RankRun | None:
        """A live rank that has not moved for longer than the stall bound (a frozen one is not
        counted while this bench holds it)."""
        if now < self.next_signature:
            return None
        self.next_signature = now + SIGNATURE_EVERY_S
        shared = (read_bytes(self.layout.progress), read_bytes(self.layout.lease))
        for run in self.runs.values():
            if not run.alive or run.stopped:
                continue
            own = tuple((hb.get("attempt"), *position(hb), hb.get("state"), json.dumps(hb.get("progress")))
                        for hb in heartbeats_of(self.layout, run.rank, run.proc.pid))
            if (shared, own) != run.signature:
                run.signature, run.moved = (shared, own), now
            elif now - run.moved > self.setup.stall_s:
                return run
        return None

    def record_hang(self, runs: list[RankRun], why: str) -> None:
        snap = status_json(self.log_path)
        for run in runs:
            self.out.hangs.append({"rank": run.rank, "pid": run.proc.pid, "why": why, "log": str(run.log),
                                   "log_tail": log_tail(run.log), "status": snap})

    # -- recovery --------------------------------------------------------------------------------
    def recover(self, now: float) -> None:
        runs = list(self.runs.values())
        ended = [r for r in runs if not r.alive]
        if not ended:
            return
        complete = run_complete(self.layout, self.setup.iterations)
        if len(ended) == len(runs):
            if not complete and all(r.code == 0 for r in ended):
                self.out.notes.append(f"every rank exited 0 at {now - self.t0:.1f} s but the run is not complete")
            self.restart([r for r in ended if r.code != 0 or not complete])
            return
        failed = [r for r in ended if r.code != 0]
        if not failed:
            return
        if self.spec.elastic:
            self.restart([r for r in failed if now - r.exited_at >= self.spec.restart_delay_s])
            return
        wave = min(r.wave for r in failed)
        if not any(r.alive and r.wave <= wave for r in runs):
            self.restart([r for r in ended if r.code != 0 or not complete])

    def done(self) -> bool:
        return (not self.pending and all(not r.alive and r.code == 0 for r in self.runs.values())
                and run_complete(self.layout, self.setup.iterations))

    # -- the episode -----------------------------------------------------------------------------
    def run(self) -> Outcome:
        self.t0 = time.monotonic()
        for rank in range(self.setup.num_nodes):
            self.start(rank, 0)
        try:
            self.supervise()
        finally:
            self.kill_all()
        self.out.seconds = round(time.monotonic() - self.t0, 1)
        self.out.restarts = self.starts - self.setup.num_nodes
        self.check()
        return self.out

    def supervise(self) -> None:
        deadline = self.t0 + self.setup.bound_s
        max_starts = self.setup.num_nodes * 10
        while True:
            now = time.monotonic()
            self.reap(now)
            if self.fault_at is None and (hb := self.trigger_beat()):
                self.inject(now, hb)
            self.run_due_steps(now)
            self.note_detection(now)
            if (hung := self.stalled(now)) is not None:
                self.record_hang([hung], f"alive and not moving for {now - hung.moved:.0f} s (bound {self.setup.stall_s:g} s)")
                return
            if self.done():
                return
            if now > deadline or self.starts > max_starts:
                self.record_hang([r for r in self.runs.values() if r.alive] or list(self.runs.values()),
                                 f"the run did not finish within {self.setup.bound_s:g} s and {max_starts} starts")
                return
            self.recover(now)
            time.sleep(TICK_S)

    # -- checks ----------------------------------------------------------------------------------
    def check(self) -> None:
        complete = run_complete(self.layout, self.setup.iterations)
        iterations = [i for i in range(1, self.setup.iterations + 1)
                      if complete or (summary.read(self.layout, i) or {}).get("complete")]
        self.out.tasks = task_check(self.layout, iterations, self.setup is REHEARSAL)
        self.out.orphans = leftovers(self.log_path)
        if self.fault_at is None:
            self.out.notes.append("the fault was never injected: the run passed its trigger unseen")
        else:
            self.check_named()
        if complete and not self.out.hangs:
            self.check_final_status()
            if self.reference is not None:
                self.out.weights = self.reference.compare(self.layout, self.setup.iterations)
                self.out.replayed = replays(self.layout, self.setup.iterations)

    def check_named(self) -> None:
        """The faulted attempt's root cause, if the fault ended that attempt."""
        attempt = self.fault_attempt
        if self.spec.kind.endswith("kill9-all"):
            return
        ended = self.layout.attempt(attempt).abort.exists() or current_attempt(self.layout) != attempt
        expected = self.expected_end()
        if expected is not None and ended != expected:
            self.out.notes.append(f"the {self.spec.kind} of rank(s) {list(self.spec.ranks)} {'ended' if ended else 'did not end'} "
                                  f"attempt {attempt}")
        if not ended:
            return
        cause = status.root_cause(self.layout.attempt(attempt), self.setup.num_nodes, out_ranks(self.layout, attempt))
        actions = {s.action for s in self.spec.steps}
        kinds = ({"interrupted"} if actions & {"term", "int"} else set()) | ({"dead"} if actions & {"kill", "stop"} else set())
        problem = self.naming_problem(cause, kinds)
        if problem:
            self.out.misnamed.append(f"attempt {attempt}: {problem}; failure: {cause}")

    def expected_end(self) -> bool | None:
        """Whether the fault should end its attempt (None: either way). A short stop should go
        unnoticed; with elastic, a worker that dies or freezes is marked out, but an interrupted
        one (SIGINT, SIGTERM) stops the attempt as without it."""
        actions = {s.action for s in self.spec.steps}
        if self.spec.kind == "stop-short":
            return False
        if not self.spec.elastic or 0 in self.spec.ranks:
            return True
        if actions & {"term", "int"}:
            return None if "kill" in actions else True
        return False

    def naming_problem(self, cause: dict | None, kinds: set[str]) -> str | None:
        if cause is None:
            return "the attempt ended with no failure named"
        if cause.get("rank") not in self.spec.ranks:
            return f"names rank {cause.get('rank')}, not the faulted {list(self.spec.ranks)}"
        if cause.get("kind") not in kinds:
            return f"kind {cause.get('kind')!r}, expected {sorted(kinds)}"
        if not isinstance(cause.get("iteration"), int) or not PHASE_LABEL.fullmatch(str(cause.get("phase"))):
            return "no iteration or phase label"
        return None

    def check_final_status(self) -> None:
        snap = status.snapshot(self.log_path)
        if snap["failure"] is not None:
            self.out.misnamed.append(f"the run is complete but status shows a failure: {snap['failure']}")
        not_done = [(r["rank"], r["state"]) for r in snap["ranks"] if r["state"] != "done" and not r["out"]]
        if not_done:
            self.out.notes.append(f"the run is complete but status shows ranks in it not done: {not_done}")


# -- the RL episodes' weights --------------------------------------------------------------------

def trained_on(layout: RunLayout, iterations: int) -> list:
    """What the updates trained on: each iteration's train aggregate, the samples' token ids and
    rewards in the aggregate's order (not who rolled them out, or when, nor the engines'
    log-probs, which the update does not use here: rl.is_correction=none)."""
    out = []
    for i in range(1, iterations + 1):
        path = layout.iteration(i).aggregate("train")
        records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        out.append([(r["task_id"], r.get("policy_iteration"),
                     [(x["token_ids"], x["reward"]) for x in r["samples"]]) for r in records])
    return out


def state_files(checkpoint: Path) -> dict[str, str]:
    """Every safetensors file of a checkpoint (published weights or deltas, fp32 master,
    optimizer state) by path, with its sum."""
    from orchestrator.checkpoints import sums

    return {p.relative_to(checkpoint).as_posix(): sums.file_sum(p) for p in sorted(checkpoint.rglob("*.safetensors"))}


def replays(layout: RunLayout, iterations: int) -> list:
    """The iterations whose trainer replayed earlier ones (train_stats.json ``replayed``)."""
    out = []
    for i in range(1, iterations + 1):
        with contextlib.suppress(OSError, ValueError):
            stats = json.loads((layout.checkpoint(i) / "train_stats.json").read_text())
            if stats.get("replayed"):
                out.append([i, *stats["replayed"]])
    return out


@dataclass
class Reference:
    """The RL episodes' run without a fault: what it trained on, and its last checkpoint."""

    trained_on: list
    files: dict[str, str]

    @classmethod
    def make(cls, spec: EpisodeSpec, root: Path, data_path: Path) -> "Reference":
        log_path = root / "run"
        console.print(f"the uninterrupted RL run, to compare the episodes' weights with: {log_path} ...", markup=False)
        with open(root / "local.log", "wb") as out:
            subprocess.run([sys.executable, "-m", "orchestrator", "local", *run_flags(spec, log_path, data_path)],
                           stdout=out, stderr=subprocess.STDOUT, env=python_env(), timeout=spec.setup.bound_s, check=True)
        layout = RunLayout(log_path)
        return cls(trained_on(layout, spec.setup.iterations), state_files(layout.checkpoint(spec.setup.iterations)))

    def compare(self, layout: RunLayout, iterations: int) -> str:
        if trained_on(layout, iterations) != self.trained_on:
            return "aggregates differ"
        return "equal" if state_files(layout.checkpoint(iterations)) == self.files else "differ"


# -- the soak ------------------------------------------------------------------------------------

def make_rl_data(data: Path | None, work: Path) -> Path:
    """``data`` when given, else the demo with a briefly warmed-up model, as the RL tests use."""
    if data is not None:
        return data
    data = work / "data"
    console.print(f"making demo data in {data} (--warm-steps=100) ...", markup=False)
    subprocess.run([sys.executable, "-m", "orchestrator", "demo-data", f"--data-path={data}", "--warm-steps=100"], check=True,
                   env=python_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return data


def print_episode(o: Outcome) -> None:
    det = "-" if o.detection_s is None else f"{o.detection_s:.1f}s"
    console.print(f"ep {o.episode:3d}  elastic {'on ' if o.elastic else 'off'}  {o.kind:<20} ranks {','.join(map(str, o.ranks)):<6}"
                  f" at {o.phase_at_fault or '-':<18} detected {det:>6}  restarts {o.restarts:2d}  {o.seconds:6.1f}s  {o.result()}"
                  + (f"  weights {o.weights}" if o.weights else "") + (f"  replayed {o.replayed}" if o.replayed else ""),
                  markup=False)
    for line in [*o.tasks.get("details", []), *o.misnamed, *o.notes]:
        console.print(f"        {line}", markup=False)
    for p in o.orphans:
        console.print(f"        orphan pid {p['pid']}: {p['cmdline']}", markup=False)
    for h in o.hangs:
        console.print(f"        HANG rank {h['rank']} (pid {h['pid']}): {h['why']}; log {h['log']}; its tail:", markup=False)
        console.print("          " + h["log_tail"].replace("\n", "\n          "), markup=False)


def tally(outcomes: list[Outcome]) -> dict:
    return {
        "episodes": len(outcomes),
        "ok": sum(o.result() == "ok" for o in outcomes),
        "hangs": sum(len(o.hangs) for o in outcomes),
        "tasks_lost": sum(o.tasks.get("lost", 0) for o in outcomes),
        "tasks_duplicated": sum(o.tasks.get("duplicated", 0) for o in outcomes),
        "tasks_extra": sum(o.tasks.get("extra", 0) for o in outcomes),
        "orphans": sum(len(o.orphans) for o in outcomes),
        "misnamed": sum(len(o.misnamed) for o in outcomes),
        "anomalies": sum(len(o.notes) for o in outcomes),
        "weights_equal": sum(o.weights == "equal" for o in outcomes),
        "weights_differ": sum(o.weights == "differ" for o in outcomes),
        "replays": sum(len(o.replayed) for o in outcomes),
        "detection_s_median": round(statistics.median(d), 2) if (d := [o.detection_s for o in outcomes if o.detection_s is not None]) else None,
        "seconds": round(sum(o.seconds for o in outcomes), 1),
    }


COLUMNS = ["episodes", "ok", "hangs", "tasks_lost", "tasks_duplicated", "tasks_extra", "orphans", "misnamed", "anomalies",
           "weights_equal", "weights_differ", "replays", "detection_s_median", "seconds"]


HEADERS = ["episodes", "ok", "hangs", "lost", "duplicated", "extra", "orphans", "misnamed", "anomalies", "weights equal",
           "weights differ", "replays", "detection p50 s", "seconds"]


def print_tables(by_kind: dict[str, dict], totals: dict) -> None:
    table("faults by kind", ["kind", *HEADERS], [[k, *(t[c] for c in COLUMNS)] for k, t in by_kind.items()])
    table("totals", HEADERS, [[totals[c] for c in COLUMNS]], right_from=0)


def plans(args: argparse.Namespace) -> list[tuple[EpisodeSpec, bool]]:
    """The rehearsal episodes' plans from ``--first`` on (a budget: more than it can use), then
    the RL ones."""
    last = args.first - 1 + (args.episodes if args.budget_s is None else 10_000)
    specs = [(plan_episode(args.seed, e, REHEARSAL, KINDS, args.elastic), False) for e in range(args.first, last + 1)]
    return specs + [(plan_episode(args.seed, last + e, RL, RL_KINDS, args.elastic), True) for e in range(1, args.rl_episodes + 1)]


def soak(args: argparse.Namespace, out_dir: Path) -> list[Outcome]:
    outcomes, began, data, reference = [], time.monotonic(), None, None
    for spec, rl in plans(args):
        if not rl and args.budget_s is not None and time.monotonic() - began >= args.budget_s:
            continue
        if rl and data is None:
            data = make_rl_data(args.data_path, out_dir)
            (out_dir / "reference").mkdir()
            reference = Reference.make(spec, out_dir / "reference", data)
        root = out_dir / f"e{spec.episode:04d}"
        root.mkdir(parents=True)
        outcome = Episode(spec, root, data if rl else root, reference if rl else None).run()
        print_episode(outcome)
        outcomes.append(outcome)
    return outcomes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    how_long = p.add_mutually_exclusive_group()
    how_long.add_argument("--episodes", type=int, default=12, help="rehearsal episodes (default 12)")
    how_long.add_argument("--budget-s", type=float, help="rehearsal episodes until this many seconds have passed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--first", type=int, default=1, help="the first episode's number (to run one episode of a seed again)")
    p.add_argument("--elastic", choices=("on", "off", "both"), default="both")
    p.add_argument("--rl-episodes", type=int, default=0, help="episodes of the real RL loop after the rehearsal ones")
    p.add_argument("--data-path", type=Path, help="demo data for the RL episodes (made in --out if not given)")
    p.add_argument("--out", type=Path, help="where the episodes' log paths and rank logs go (default: a new temp dir)")
    p.add_argument("--json", type=Path, help="write the summary here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out_dir = args.out or Path(tempfile.mkdtemp(prefix="chaos-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    console.print(f"chaos soak: seed {args.seed}, elastic {args.elastic}, output in {out_dir}", markup=False)
    outcomes = soak(args, out_dir)
    by_kind = {kind: tally([o for o in outcomes if o.kind == kind]) for kind in sorted({o.kind for o in outcomes})}
    totals = tally(outcomes)
    print_tables(by_kind, totals)
    if args.json:
        write_json(args.json, {"machine": machine(), "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                               "out": str(out_dir), "episodes": [{**asdict(o), "result": o.result()} for o in outcomes],
                               "by_kind": by_kind, "totals": totals})
    return 1 if any(o.failed for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
