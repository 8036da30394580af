"""The doctor's exchange through the shared filesystem, and its measurements of it.

Files (``RunLayout.doctor_*``), all records written with ``fsio.write_record``:

    doctor/session.json          master: {session, state open|closed|interrupted, num_nodes, master, addresses, timeout_s}
    doctor/<S>/replace.json      master: {session, seq}: seq 0 before the session opens, replaced by seq 1 later
    doctor/<S>/r<R>.json         rank R: its facts (facts.collect), plus the session id
    doctor/<S>/replace-acks/r<R>.json  rank R: seq 0 once it has read replace.json seq 0; seq 1 once it sees seq 1
    doctor/<S>/new.json          master: created once all facts are in (t0 = its wall time)
    doctor/<S>/new-acks/r<R>.json      rank R: when it first saw new.json (its wall times, its processing time)
    doctor/<S>/result.json       master: the verdict (problems, rank summaries, measurements, exit code)

Steps. The master publishes replace.json (seq 0), its own facts and session.json. A worker
polls session.json until it names an open session, collects its facts (with the route to
the master's addresses from the record), writes them and acknowledges replace.json seq 0.
The master waits for every rank (``--timeout``; missing ranks -> exit 3 for everyone), then:

- new file: creates new.json; every worker, polling it by name, answers in new-acks/ the
  moment it sees it. Latency = (round trip on the master's monotonic clock - the worker's
  processing time on its own monotonic clock) / 2: no two clocks are compared.
- replaced file: replaces replace.json with seq 1 (workers hold seq 0 in their caches); each
  worker answers by replacing its own ack (seq 0 -> 1, which the master has read). Same formula.
- clock skew, NTP style from the new-file exchange: master wall t0 (before publishing),
  worker wall t1 (seen) and t2 (answering), master wall t3 (answer seen):
  skew = ((t1 - t0) + (t2 - t3)) / 2, uncertainty = ((t3 - t0) - (t2 - t1)) / 2.

Every poll refreshes the directory first (``fsio.refresh_dir``) and opens known names, like
the run's own polls, so the latencies are the ones the run will see. Workers watch
session.json while they wait: a new master session replaces a stale one (the worker moves
to it), a closed one means the master finished or was stopped.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator import defaults
from orchestrator.errors import (
    EXIT_ERROR,
    EXIT_OK,
    EXIT_PEER_FAILED,
    BadInput,
    DeadlineExceeded,
    OrchestratorError,
)
from orchestrator.node import checks, identity
from orchestrator.node import facts as facts_mod
from orchestrator.protocol import fsio
from orchestrator.protocol.layout import RunLayout
from orchestrator.protocol.waiting import Backoff, CancelToken, Deadline, poll

log = logging.getLogger(__name__)

# Waiting for a session or for the other ranks: gentle on the metadata server.
WAIT_BACKOFF = Backoff(0.01, 0.25)
# While measuring: fine enough that the poll interval (<= max_s) is small next to NFS/sshfs caches.
MEASURE_BACKOFF = Backoff(0.001, 0.05)
# How often a waiting worker re-reads session.json (moved or closed sessions).
SESSION_CHECK_S = 0.5


class RanksMissing(OrchestratorError):
    """Ranks never showed up (or stopped answering) within the timeout: exit 3."""

    exit_code = EXIT_PEER_FAILED

    def __init__(self, message: str, ranks: list[int]):
        super().__init__(message)
        self.ranks = ranks


class _SessionMoved(Exception):
    pass


class _SessionClosed(Exception):
    def __init__(self, state: str):
        super().__init__(state)
        self.state = state


@dataclass
class Options:
    log_path: Path
    rank: int
    num_nodes: int
    timeout_s: float = 120.0
    thresholds: checks.Thresholds = field(default_factory=checks.Thresholds)


def new_session_id() -> str:
    return f"s{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


def run(opts: Options, cancel: CancelToken | None = None) -> dict:
    """Take part in one doctor session as ``opts.rank``; the verdict every rank prints."""
    cancel = cancel or CancelToken()
    if opts.rank == 0:
        return Master(opts, cancel).run()
    return Worker(opts, cancel).run()


# -- master ----------------------------------------------------------------------------------


class Master:
    def __init__(self, opts: Options, cancel: CancelToken):
        self.o = opts
        self.cancel = cancel
        self.layout = RunLayout(opts.log_path)
        self.session = new_session_id()
        self.record: dict = {}

    def _publish_session(self, state: str, **extra) -> None:
        self.record = {**self.record, "state": state, **extra}
        fsio.write_record(self.layout.doctor_session, self.record)

    def run(self) -> dict:
        L, S, n = self.layout, self.session, self.o.num_nodes
        mine = facts_mod.collect(rank=0, num_nodes=n, log_path=self.o.log_path)
        mine["session"] = S
        for d in (L.doctor_dir(S), L.doctor_new_acks(S), L.doctor_replace_acks(S)):
            d.mkdir(parents=True, exist_ok=True)
        fsio.write_record(L.doctor_probe_replace(S), {"session": S, "seq": 0})
        fsio.write_record(L.doctor_facts(S, 0), mine)
        addresses = [a["address"] for a in facts_mod.reachable_addresses(mine["interfaces"])]
        self.record = {"session": S, "num_nodes": n, "master": identity.me(), "addresses": addresses,
                       "timeout_s": self.o.timeout_s, "opened": time.time()}
        self._publish_session("open")
        log.info("doctor session %s open under %s: waiting for %d worker(s)", S, L.doctor_dir(S), n - 1)
        finished = False
        try:
            try:
                all_facts = {0: mine, **self._wait_facts()}
                filesystem = self._measure(all_facts)
                problems = checks.run_checks(all_facts, filesystem, self.o.thresholds)
                result = verdict(S, all_facts, problems, filesystem, EXIT_ERROR if problems else EXIT_OK)
            except RanksMissing as e:
                result = verdict(S, {0: mine, **self._facts_so_far()}, [], None, EXIT_PEER_FAILED,
                                 missing=e.ranks, error=str(e))
            fsio.write_record(L.doctor_result(S), result)
            self._publish_session("closed", exit_code=result["exit_code"])
            finished = True
            return result
        finally:
            if not finished:
                self._publish_session("interrupted")

    def _facts_so_far(self) -> dict[int, dict]:
        got = {}
        for r in range(1, self.o.num_nodes):
            f = fsio.read_record(self.layout.doctor_facts(self.session, r))
            if f and f.get("session") == self.session:
                got[r] = f
        return got

    def _wait_facts(self) -> dict[int, dict]:
        L, S = self.layout, self.session
        missing = set(range(1, self.o.num_nodes))
        got: dict[int, dict] = {}

        def probe():
            fsio.refresh_dir(L.doctor_replace_acks(S))
            fsio.refresh_dir(L.doctor_dir(S))
            for r in sorted(missing):
                ack = fsio.read_record(L.doctor_replace_ack(S, r))
                if not ack or ack.get("session") != S:
                    continue
                f = fsio.read_record(L.doctor_facts(S, r))
                if f and f.get("session") == S and f.get("rank") == r:
                    got[r] = f
                    missing.discard(r)
            return got if not missing else None

        def on_timeout():
            return RanksMissing(never_showed_up(sorted(missing), self.o), sorted(missing))

        return poll(probe, deadline=Deadline.after(self.o.timeout_s, "workers' facts"), cancel=self.cancel,
                    backoff=WAIT_BACKOFF, on_timeout=on_timeout)

    def _collect_answers(self, directory: Path, path_of, accept) -> dict[int, dict]:
        """Poll every worker's answer file: ``{rank: {mono, wall, gap, record}}``, where ``gap`` is
        the time since this rank's previous (missed) look: the answer landed somewhere in it."""
        pending = set(range(1, self.o.num_nodes))
        seen: dict[int, dict] = {}
        missed_at: dict[int, float] = {}  # when each rank's answer was last looked for in vain

        def probe():
            fsio.refresh_dir(directory)
            for r in sorted(pending):
                looked = time.monotonic()
                rec = fsio.read_record(path_of(r))
                if rec and rec.get("session") == self.session and accept(rec):
                    seen[r] = {"mono": looked, "wall": time.time(), "record": rec,
                               "gap": looked - missed_at[r] if r in missed_at else 0.0}
                    pending.discard(r)
                else:
                    missed_at[r] = looked
            return seen if not pending else None

        try:
            poll(probe, deadline=Deadline.after(self.o.timeout_s, "answers"), cancel=self.cancel, backoff=MEASURE_BACKOFF)
        except DeadlineExceeded:
            pass  # the ranks still pending get no measurement: check_filesystem reports them
        return seen

    @staticmethod
    def _one_way(start: float, answer: dict) -> tuple[float, float, float]:
        """(round trip, one-way latency estimate, its resolution) of a probe published at
        ``start`` (master monotonic) and answered by ``answer``. Each side's detection delay
        lies within its poll gap; the estimate takes the middle of both gaps."""
        rec = answer["record"]
        rtt = answer["mono"] - start
        gap_w, gap_m = float(rec.get("gap_s") or 0.0), answer["gap"]
        est = max(0.0, rtt - float(rec.get("processing_s") or 0.0) - gap_w / 2 - gap_m / 2) / 2
        return rtt, est, (gap_w + gap_m) / 4

    def _measure(self, all_facts: dict[int, dict]) -> dict:
        L, S = self.layout, self.session
        per: dict[str, dict] = {"0": {"new_file_s": 0.0, "replaced_file_s": 0.0, "clock_skew_s": 0.0, "clock_uncertainty_s": 0.0}}
        if self.o.num_nodes > 1:
            # New file: t0 and m0 are taken before publishing, so the publish (fsync, rename) counts.
            t0, m0 = time.time(), time.monotonic()
            fsio.write_record(L.doctor_probe_new(S), {"session": S, "t0": t0})
            news = self._collect_answers(L.doctor_new_acks(S), lambda r: L.doctor_new_ack(S, r), lambda rec: True)
            # Replaced file: every worker holds seq 0 already.
            m1 = time.monotonic()
            fsio.write_record(L.doctor_probe_replace(S), {"session": S, "seq": 1})
            reps = self._collect_answers(L.doctor_replace_acks(S), lambda r: L.doctor_replace_ack(S, r),
                                         lambda rec: rec.get("seq") == 1)
            for r in range(1, self.o.num_nodes):
                m: dict = {"new_file_s": None, "new_file_rtt_s": None, "new_file_resolution_s": None,
                           "replaced_file_s": None, "replaced_file_rtt_s": None, "replaced_file_resolution_s": None,
                           "clock_skew_s": None, "clock_uncertainty_s": None}
                if r in news:
                    ans = news[r]
                    rtt, est, res = self._one_way(m0, ans)
                    m.update(new_file_rtt_s=round(rtt, 4), new_file_s=round(est, 4), new_file_resolution_s=round(res, 4))
                    rec = ans["record"]
                    t1 = rec["t1"] - float(rec.get("gap_s") or 0.0) / 2  # middle of the worker's poll gap
                    t2 = rec["t2"]
                    t3 = ans["wall"] - ans["gap"] / 2
                    m["clock_skew_s"] = round(((t1 - t0) + (t2 - t3)) / 2, 4)
                    m["clock_uncertainty_s"] = round(max(0.0, (ans["wall"] - t0) - (t2 - rec["t1"])) / 2, 4)
                if r in reps:
                    rtt, est, res = self._one_way(m1, reps[r])
                    m.update(replaced_file_rtt_s=round(rtt, 4), replaced_file_s=round(est, 4),
                             replaced_file_resolution_s=round(res, 4))
                per[str(r)] = m
        workers = [m for r, m in per.items() if r != "0"]

        def worst(key: str) -> float | None:
            vals = [m[key] for m in workers if m.get(key) is not None]
            return max(vals) if vals else None

        return {
            "log_path": str(self.o.log_path),
            "timeout_s": self.o.timeout_s,
            "poll_max_s": MEASURE_BACKOFF.max_s,
            "per_rank": per,
            "max_new_file_s": worst("new_file_s"),
            "max_replaced_file_s": worst("replaced_file_s"),
            "max_abs_clock_skew_s": max((abs(m["clock_skew_s"]) for m in workers if m.get("clock_skew_s") is not None), default=None),
            "mounts": {str(r): {k: (f.get("log_path") or {}).get(k) for k in ("fstype", "mountpoint", "options")}
                       for r, f in sorted(all_facts.items())},
        }


def never_showed_up(ranks: list[int], opts: Options) -> str:
    names = ", ".join(str(r) for r in ranks)
    return (f"rank(s) {names} never showed up within {opts.timeout_s:g} s: start `orchestrator doctor "
            f"--log-path {opts.log_path} --num-nodes {opts.num_nodes} --worker R` on each of those nodes "
            f"(the same --log-path, on the shared filesystem)")


def verdict(session: str, all_facts: dict[int, dict], problems: list[dict], filesystem: dict | None, exit_code: int,
            **extra) -> dict:
    return {"session": session, "exit_code": exit_code, "problems": problems, "ranks": summarize(all_facts),
            "filesystem": filesystem, **extra}


def summarize(all_facts: dict[int, dict]) -> list[dict]:
    paths = checks.path_interfaces(all_facts)
    out = []
    for r, f in sorted(all_facts.items()):
        g = f.get("gpus") or {}
        lp = f.get("log_path") or {}
        fm = f.get("fabric_manager") or {}
        out.append({
            "rank": r,
            "host": f.get("host"),
            "addresses": [a["address"] for a in facts_mod.reachable_addresses(f.get("interfaces") or {})],
            "path": paths.get(r),
            "route_to_master": f.get("route_to_master"),
            "versions": f.get("versions"),
            "env": f.get("env"),
            "cuda_visible_devices": f.get("cuda_visible_devices"),
            "gpus": {"count": g.get("count"), "names": g.get("names"), "driver": g.get("driver"),
                     "free_mib": [m.get("free_mib") for m in g.get("memory") or []]},
            "fabric_manager": fm.get("active_state") if fm else None,
            "log_path_free_bytes": lp.get("free_bytes"),
            "log_path_fs": lp.get("fstype"),
            "clock": f.get("clock"),
        })
    return out


# -- worker ----------------------------------------------------------------------------------


class Worker:
    def __init__(self, opts: Options, cancel: CancelToken):
        self.o = opts
        self.cancel = cancel
        self.layout = RunLayout(opts.log_path)
        self.session = ""
        self._last_check = 0.0
        self.gap_s = 0.0

    def run(self) -> dict:
        deadline = Deadline.after(self.o.timeout_s, "the master (rank 0) to open a doctor session")
        while True:
            record = self._wait_session(deadline)
            try:
                return self._in_session(record)
            except _SessionMoved:
                log.info("doctor session %s was replaced by a newer one: joining that", self.session)
                deadline = Deadline.after(self.o.timeout_s, "the master (rank 0) to open a doctor session")

    def _wait_session(self, deadline: Deadline) -> dict:
        L = self.layout

        def probe():
            fsio.refresh_dir(L.doctor)
            rec = fsio.read_record(L.doctor_session)
            if not rec or rec.get("state") != "open" or rec.get("session") == self.session:
                return None
            if identity.same_host_process_alive(rec.get("master") or {}) is False:
                return None  # left open by a master on this host that is gone
            return rec

        def on_timeout():
            return RanksMissing(f"the master (rank 0) never showed up within {self.o.timeout_s:g} s: start "
                                f"`orchestrator doctor --log-path {self.o.log_path} --num-nodes {self.o.num_nodes} --master` "
                                f"on node 0 (the same --log-path, on the shared filesystem)", [0])

        return poll(probe, deadline=deadline, cancel=self.cancel, backoff=WAIT_BACKOFF, on_timeout=on_timeout)

    def _watch_session(self) -> None:
        """Raise when session.json no longer names this open session (checked every SESSION_CHECK_S)."""
        now = time.monotonic()
        if now - self._last_check < SESSION_CHECK_S:
            return
        self._last_check = now
        fsio.refresh_dir(self.layout.doctor)
        rec = fsio.read_record(self.layout.doctor_session)
        if rec is None:
            return
        if rec.get("session") != self.session:
            if rec.get("state") == "open":
                raise _SessionMoved()
            return
        if rec.get("state") != "open":
            raise _SessionClosed(str(rec.get("state")))

    def _wait(self, probe, what: str, backoff: Backoff, *, watch: bool = True):
        """Poll ``probe``; ``self.gap_s`` is then the time between the last miss and the hit."""
        last: list[float | None] = [None]

        def watched():
            now = time.monotonic()
            got = probe()
            if got is None:
                last[0] = now
                if watch:
                    self._watch_session()
            else:
                self.gap_s = 0.0 if last[0] is None else now - last[0]
            return got

        def on_timeout():
            return RanksMissing(f"the master (rank 0) stopped answering in doctor session {self.session}: "
                                f"no {what} within {self.o.timeout_s + defaults.WORKER_GRACE_S:g} s", [0])

        return poll(watched, deadline=Deadline.after(self.o.timeout_s + defaults.WORKER_GRACE_S, what), cancel=self.cancel,
                    backoff=backoff, on_timeout=on_timeout)

    def _in_session(self, record: dict) -> dict:
        L, r = self.layout, self.o.rank
        S = self.session = record["session"]
        self._last_check = time.monotonic()
        n = int(record.get("num_nodes", 0))
        if r >= n:
            raise BadInput(f"rank {r} is outside the master's --num-nodes {n} (doctor session {S}): "
                           f"give every node the same --num-nodes and ranks 1..{n - 1} to the workers")
        d = L.doctor_dir(S)
        try:
            def replace_probe():
                fsio.refresh_dir(d)
                rec = fsio.read_record(L.doctor_probe_replace(S))
                return rec if rec and rec.get("session") == S else None

            self._wait(replace_probe, "replace.json", WAIT_BACKOFF)  # seq 0 (or 1 if we are late): now cached here
            mine = facts_mod.collect(rank=r, num_nodes=self.o.num_nodes, log_path=self.o.log_path,
                                     master_addrs=list(record.get("addresses") or []))
            mine["session"] = S
            fsio.write_record(L.doctor_facts(S, r), mine)
            fsio.write_record(L.doctor_replace_ack(S, r), {"session": S, "rank": r, "seq": 0})
            log.info("doctor session %s: facts written; waiting for the master's probes", S)

            # New file: answer the moment it is seen.
            def new_probe():
                fsio.refresh_dir(d)
                return fsio.read_record(L.doctor_probe_new(S))

            self._wait(new_probe, "new.json (the new-file probe)", MEASURE_BACKOFF)
            m_seen, t1 = time.monotonic(), time.time()
            fsio.write_record(L.doctor_new_ack(S, r), {"session": S, "rank": r, "t1": t1, "t2": time.time(),
                                                       "gap_s": self.gap_s, "processing_s": time.monotonic() - m_seen})

            # Replaced file.
            def replaced_probe():
                fsio.refresh_dir(d)
                rec = fsio.read_record(L.doctor_probe_replace(S))
                return rec if rec and rec.get("seq") == 1 else None

            self._wait(replaced_probe, "the replaced replace.json", MEASURE_BACKOFF)
            m_seen = time.monotonic()
            fsio.write_record(L.doctor_replace_ack(S, r), {"session": S, "rank": r, "seq": 1, "gap_s": self.gap_s,
                                                           "processing_s": time.monotonic() - m_seen})
            closed = None
        except _SessionClosed as e:
            closed = e.state  # the master finished (or gave up on this rank): its result says which

        def result_probe():
            fsio.refresh_dir(d)
            return fsio.read_record(L.doctor_result(S))

        if closed is None:
            try:
                return self._wait(result_probe, "result.json (the verdict)", WAIT_BACKOFF)
            except _SessionClosed as e:
                closed = e.state
        if closed == "closed":  # the master wrote result.json before closing: wait until it shows here
            return self._wait(result_probe, "result.json (the verdict)", WAIT_BACKOFF, watch=False)
        got = result_probe()
        if got is not None:
            return got
        raise RanksMissing(f"the master (rank 0) ended doctor session {S} without a verdict ({closed})", [0])

