"""The generic runner: one rank walks the phase table, iteration after iteration.

It knows nothing of what a phase does: it asks ``phase_table`` who acts and which barrier
ends the phase, calls ``phases.WORK`` and ``phases.DECIDE``, and turns every way a rank can
end into an exit code and a failure record:

    0 done or stopped on request   2 bad input   3 another rank failed or died
    130 SIGINT/SIGTERM             1 anything else
"""

from __future__ import annotations

import logging
import signal
import time
from typing import Callable

from orchestrator.config import RunConfig, WorkloadKind
from orchestrator.errors import (
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_OK,
    BadInput,
    ChildFailed,
    DeadlineExceeded,
    FailureKind,
    Interrupted,
    MarkedOut,
    OrchestratorError,
    PeerFailed,
    Retrain,
    RunFinished,
    ServiceError,
    StopRequested,
)
from orchestrator.data import claims, resample, summary
from orchestrator.node import placement
from orchestrator.node.procs import Children
from orchestrator.phase_table import Barrier, Phase
from orchestrator.protocol import fsio, join, lease, schema
from orchestrator.protocol.wire import HeartbeatState
from orchestrator.coordination.coordinator import Coordinator
from orchestrator.protocol.layout import RunLayout
from orchestrator.protocol.schedule import first_point, next_point, schedule
from orchestrator.protocol.schema import Progress, TrainingPlan
from orchestrator.protocol.waiting import CancelToken, Deadline
from orchestrator.runtime import phases
from orchestrator.runtime.context import PhaseContext, RunView, Tracker, Workload
from orchestrator.runtime.decisions import Decisions
from orchestrator.runtime.background_training import BackgroundTraining

log = logging.getLogger("orchestrator")


# -- the rank ---------------------------------------------------------------------------------

class Rank:
    def __init__(self, config: RunConfig, make_workload: Callable[[RunConfig, Children], Workload],
                 tracker: Tracker | None = None):
        """``make_workload`` builds the compute behind the phases (``workloads.make``): the
        runner itself knows none. ``tracker``: the master's experiment tracking, told after
        each iteration's last barrier (tracking/tracker.py)."""
        self.config = config
        self.layout = RunLayout(config.log_path)
        self.cancel = CancelToken()
        self.children = Children()
        self.coordinator = Coordinator(config, self.cancel, self.children)
        self.workload = make_workload(config, self.children)
        self.training = BackgroundTraining(on_change=self.coordinator.training_in_flight)
        """rl.max_staleness >= 1: this node's training of phase 10, running on while the rank
        walks a later iteration's rollout (protocol/schedule.py)."""
        self._noted = False  # the workload's notes are logged once, however many attempts follow
        self._began = time.monotonic()
        self._first_iteration: int | None = None  # where this start began, for the closing line
        self.decided: Decisions | None = None
        """The released decisions this rank holds (runtime/decisions.py), made anew at each attempt's start."""
        self.tracker = tracker

    def _resume_point(self) -> tuple[int, Phase, dict | None, tuple[TrainingPlan, ...]]:
        """Master: where the attempt starts, that iteration's plan and the training plans in force."""
        fsio.refresh_dir(self.layout.control)
        k = self.config.rl.max_staleness
        progress = schema.read(self.layout.progress, Progress)
        training = progress.training if progress is not None else ()
        start = next_point(progress, k)
        first = first_point(start, self.config.rl_phase, self.config.max_iterations, k)
        if first is None:
            return start[0], start[1], None, training
        iteration, phase = first
        plan = fsio.read_record(self.layout.iteration(iteration).plan)
        return iteration, phase, plan, training

    def _adopt_absent(self, iteration: int, phase: Phase, plan: dict | None, placed: placement.Placement) -> None:
        """Master, before the attempt starts: when it resumes inside a split's rollout whose
        plan gives work to ranks this run does not have (resumed on fewer nodes), keep their
        records and hand their unfinished tasks to this run's ranks (data/claims.py)."""
        if not plan:
            return
        splits = resample.planned(plan) if phase <= Phase.ROLLOUT else ["eval"] if phase in (Phase.EVAL_DECIDE, Phase.EVAL) else []
        for split in splits:  # a resample round not opened yet too: its absent ranks' tasks wait in new chunks
            if plan[split]["enabled"]:
                self._adopt_absent_of(iteration, split, plan, placed)

    def _adopt_absent_of(self, iteration: int, split: str, plan: dict, placed: placement.Placement) -> None:
        cfg = self.config
        ids = self.workload.task_ids(split, iteration)[: plan[split]["total"]]
        it = self.layout.iteration(iteration)
        weights = placement.rollout_weights(placed, cfg.rank_weights)
        chunks = claims.all_chunks(it, split, plan[split])
        absent = claims.ranks_beyond(chunks, claims.owners(it, split, chunks), cfg.num_nodes)
        adopted, moved = claims.adopt(it, split, plan[split], ids, iteration=iteration, ranks=absent, weights=weights,
                                    attempt=self.coordinator.attempt_id)
        if adopted:
            log.warning("ranks %s have %s work in iteration %d but this run has %d node(s): their records so far are kept and "
                        "their %d unfinished task(s) go to this run's ranks", ",".join(map(str, adopted)), split, iteration,
                        cfg.num_nodes, moved)

    def run(self) -> int:
        _install_signal_handlers()
        state = HeartbeatState.FAILED
        try:
            self._refuse_a_finished_run()
            while True:
                try:
                    start = self.coordinator.join(self._resume_point, self._adopt_absent)
                    log.info("attempt %s starts at iteration %d, phase %s", start.attempt, start.iteration, start.phase.label)
                    if self._first_iteration is None:
                        self._first_iteration = start.iteration
                    self.decided = Decisions.entering(self.layout, self.config.model_path, start.training)
                    self.training.entered(rejoined=start.rejoined)
                    self._publish_notes()
                    self._track()  # what an earlier start completed but did not log
                    self._walk(start.iteration, start.phase, start.plan)
                    break
                except Exception as e:  # noqa: BLE001 - whatever the work raised as it was cancelled
                    reason = e if isinstance(e, PeerFailed) else self.cancel.reason
                    if isinstance(e, (Interrupted, StopRequested, RunFinished)):
                        raise
                    if isinstance(reason, PeerFailed) and self._abandoned(reason) and self.config.coordination.master_wait > 0:
                        self._take_them_back(reason)
                    elif isinstance(e, PeerFailed) and self._may_wait_for_master(e):
                        self._leave_for_new_master(e)
                    elif isinstance(reason, MarkedOut):
                        self._leave_to_rejoin(reason)
                    else:
                        raise
            state = HeartbeatState.DONE
            if self.config.is_master:
                log.info("%s", summary.closing(self.layout, seconds=time.monotonic() - self._began, resumed_at=self._first_iteration,
                                               simulated=self.config.workload is WorkloadKind.REHEARSAL))
            else:
                log.info("run complete")
            return EXIT_OK
        except BaseException as e:  # noqa: BLE001 - every ending is classified, recorded and reported
            cause = self._root_cause(e)
            state = {StopRequested: HeartbeatState.STOPPED, Interrupted: HeartbeatState.INTERRUPTED,
                     RunFinished: HeartbeatState.DONE}.get(type(cause), HeartbeatState.FAILED)
            return self._report(cause, e)
        finally:
            _ignore_signals()
            self.cancel.cancel(OrchestratorError("rank is ending"))
            self._stop_children()
            self.coordinator.close(state)
            if self.tracker is not None:
                self.tracker.close()

    def _track(self) -> None:
        if self.tracker is not None:
            self.tracker.poke()

    def _publish_notes(self) -> None:
        """Master: say once in its log, and in every attempt's notes for `status`, where the
        run does other than its configuration asks (the workload's notes)."""
        if not self.config.is_master:
            return
        notes = self.workload.notes()
        if not notes:
            return
        if not self._noted:
            for note in notes:
                log.warning("%s", note)
            self._noted = True
        fsio.write_record(self.coordinator.attempt.notes, {"notes": notes})

    def _refuse_a_finished_run(self) -> None:
        """Master: a run with nothing left to walk ends at once; its workers do the same
        rather than wait for it (protocol/join.py, ``Finished``)."""
        if not self.config.is_master:
            return
        walked = schema.read(self.layout.progress, Progress)
        k = self.config.rl.max_staleness
        if walked is not None and walked.max_staleness != k:
            raise BadInput(f"the run under {self.layout.root} walks with rl.max_staleness={walked.max_staleness} (its order of "
                           f"phases depends on it: docs/rl.md, \"Asynchronous RL\"), and this command says {k}: resume it "
                           f"with rl.max_staleness={walked.max_staleness}, or start a new run under another --log-path")
        progress = self.coordinator.finished()
        if progress is not None:
            changed = self._changed_settings()
            unapplied = (f"; {', '.join(changed)} {'is' if len(changed) == 1 else 'are'} not applied: nothing is left to train. "
                         f"Raise --max-iterations to go on (the iterations after {progress.iteration} take the new "
                         f"{'value' if len(changed) == 1 else 'values'}), or start a new run under another --log-path") if changed else \
                "; raise --max-iterations to go on"
            raise RunFinished(f"the run under {self.layout.root} is complete (iteration {progress.iteration}, phase "
                              f"{progress.phase.label} released): nothing is left to do{unapplied}")

    def _changed_settings(self) -> list[str]:
        """The settings this command gives otherwise than the run's last attempt started with
        (``key=new (the run used old)``), --max-iterations aside."""
        held = lease.read_lease(self.layout)
        start = fsio.read_record(self.layout.attempt(held.attempt).start) if held is not None else None
        before = (start or {}).get("fingerprint")
        if not isinstance(before, dict):
            return []
        return [f"{key}={new!r} (the run used {old!r})" for key, old, new in join.changed_keys(before, self.config.fingerprint())
                if key != "max_iterations"]

    def _abandoned(self, e: PeerFailed) -> bool:
        """The master's monitor found its workers gave up on it: it was frozen or paused past
        the node timeout, and they judged it dead (coordination/monitor.py, ``abandoned_by``)."""
        return self.config.is_master and e.culprit.rank == 0 and e.culprit.kind is FailureKind.DEAD

    def _take_them_back(self, e: PeerFailed) -> None:
        """Master, with coordination.master_wait_s > 0 (by default with elastic): the workers
        that gave up on it wait for a new master, so it becomes that master. It ends its
        attempt (children stopped, lease released) and starts a new one; the run resumes from
        its last released barrier, as after a restart."""
        log.warning("%s. Its workers wait up to %.0f s (coordination.master_wait_s) for a new master: this rank starts a new "
                    "attempt for them to join; the run resumes from its last finished phase", e,
                    self.config.coordination.master_wait)
        self.coordinator.record_failure(FailureKind.PEER, str(e), culprit=e.culprit)
        self.coordinator.start_afresh(self._start_over(e))

    def _may_wait_for_master(self, e: PeerFailed) -> bool:
        """A worker whose master died waits for a new one (coordination.master_wait_s > 0; by
        default with coordination.elastic)."""
        c = e.culprit
        return not self.config.is_master and self.config.coordination.master_wait > 0 and c.rank == 0 and c.kind is FailureKind.DEAD

    def _leave_for_new_master(self, e: PeerFailed) -> None:
        """Leave the dead master's attempt (its children stopped, its work durable as always)
        and join the next one; the worker's join deadline bounds the wait."""
        wait = self.config.coordination.master_wait
        log.warning("%s. Waiting up to %.0f s (coordination.master_wait_s) for a new master: restart rank 0 with the "
                    "same command; the run resumes from its last finished phase", e, wait)
        self.coordinator.record_failure(FailureKind.PEER, str(e), culprit=e.culprit)
        self.coordinator.leave(self._start_over(OrchestratorError("leaving the attempt of a dead master")), join_timeout_s=wait)

    def _leave_to_rejoin(self, e: MarkedOut) -> None:
        """Elastic: the run went on without this rank. Stop its work (what it wrote since
        counts for nothing: data/claims.py) and ask to come back at the next iteration."""
        self.coordinator.leave(self._start_over(e), join_timeout_s=self.config.coordination.join_timeout_s, for_good=False)

    def _start_over(self, reason: OrchestratorError) -> CancelToken:
        """End this rank's current work (cancelled for ``reason``, its children stopped) and
        return the token the work that follows waits on."""
        self.cancel.cancel(reason)
        self._stop_children()
        self.training.forget()
        self.cancel = CancelToken()
        return self.cancel

    def _root_cause(self, e: BaseException) -> BaseException:
        """What really ended the rank: work that fails because the rank was cancelled (its
        engine killed, its wait interrupted) is reported as the cancellation's reason."""
        if isinstance(e, KeyboardInterrupt):
            return Interrupted("SIGINT")
        # A child that died is the cause of what failed with it; a lost connection may be its
        # death still on its way.
        self.children.reap(settle_s=LOST_CONNECTION_SETTLE_S if _lost_connection(e) else 0.0)
        if isinstance(self.cancel.reason, ChildFailed) and not isinstance(e, (Interrupted, StopRequested)):
            return self.cancel.reason
        if isinstance(e, ChildFailed):  # a child killed because the rank was cancelled fails too
            return self.cancel.reason or e
        if isinstance(e, ServiceError) and isinstance(self.cancel.reason, PeerFailed):
            return self.cancel.reason  # its engines were stopped as it stopped for the peer (a request answered 503)
        if isinstance(e, OrchestratorError) or not isinstance(e, Exception):
            return e
        return self.cancel.reason or e

    def _report(self, cause: BaseException, raised: BaseException) -> int:
        """Record ``cause`` for the other ranks and the operator; return the exit code."""
        rank, where = self.config.rank, self._where()
        if isinstance(cause, StopRequested):
            log.warning("%s; re-run the same command to continue", cause)
            return EXIT_OK
        if isinstance(cause, RunFinished):
            log.warning("%s", cause)
            return EXIT_OK
        if isinstance(cause, Interrupted):
            self.coordinator.record_failure(FailureKind.INTERRUPTED, cause.signal_name)
            log.error("interrupted by %s at %s; re-run the same command to resume", cause.signal_name, where)
            return EXIT_INTERRUPTED
        if isinstance(cause, PeerFailed) and cause.culprit.rank == rank:
            self.coordinator.record_failure(FailureKind.PEER, str(cause), culprit=cause.culprit)
            log.error("%s. This rank (%d) was frozen or paused past coordination.node_timeout_s, and the others stopped without "
                      "it: it stops too. Re-run the same commands on every node; the run resumes from its last finished phase "
                      "(with coordination.master_wait_s > 0 the workers would have waited for it)", cause, rank)
            return cause.exit_code
        if isinstance(cause, PeerFailed):
            self.coordinator.record_failure(FailureKind.PEER, str(cause), culprit=cause.culprit)
            log.error("%s. This rank (%d) stops too. Once that is fixed, re-run the same commands on every node; "
                      "the run resumes from its last finished phase", cause, rank)
            return cause.exit_code
        if isinstance(cause, BadInput):
            self.coordinator.record_failure(FailureKind.ERROR, str(cause))
            log.error("%s", cause)
            return cause.exit_code
        if isinstance(cause, DeadlineExceeded):
            self.coordinator.record_failure(FailureKind.DEADLINE, str(cause), raised)
            log.error("deadline at %s: %s. Raise the deadline (deadlines.PHASE=SECONDS) if the work is just slow, "
                      "then re-run the same commands to resume", where, cause)
            return EXIT_ERROR
        if not isinstance(cause, Exception):
            raise cause  # SystemExit and the like: not ours to classify
        self.coordinator.record_failure(FailureKind.ERROR, f"{type(cause).__name__}: {cause}", cause)
        log.error("rank %d failed at %s: %s: %s", rank, where, type(cause).__name__, cause,
                  exc_info=(type(cause), cause, cause.__traceback__))
        return EXIT_ERROR

    def _stop_children(self) -> None:
        self.workload.close()
        self.children.stop_all(grace_s=3.0)

    def _where(self) -> str:
        iteration, phase = self.coordinator.position()
        return f"iteration {iteration}, phase {phase.label}" if iteration is not None else "start-up"

    def _walk(self, iteration: int, phase: Phase, plan: dict | None) -> None:
        group_start, group_budget = None, 0.0  # phases since the last barrier share its deadline
        cfg = self.config
        for iteration, phase in schedule((iteration, phase), cfg.rl_phase, cfg.max_iterations, cfg.rl.max_staleness):
            if plan is None or plan.get("iteration") != iteration:
                plan = fsio.read_record(self.layout.iteration(iteration).plan) or {"iteration": iteration}
            while True:
                try:
                    plan, group_start, group_budget = self._phase(iteration, phase, plan, group_start, group_budget)
                    break
                except Exception as e:  # noqa: BLE001 - whatever the work raised as it was cancelled
                    if not isinstance(self.cancel.reason, Retrain) or isinstance(e, (Interrupted, StopRequested)):
                        raise
                    self._retrain(self.cancel.reason, redo=(iteration, phase))
                    group_start, group_budget = None, 0.0  # phase 10 follows a barrier: the redo gets its own budget

    def _phase(self, iteration: int, phase: Phase, plan: dict, group_start: float | None,
               group_budget: float) -> tuple[dict, float | None, float]:
        """One phase's work and barrier; returns the plan and the deadline group after it."""
        cfg = self.config
        spec = phase.spec
        budget = cfg.deadlines.for_phase(phase)
        if phase is Phase.PUBLISH and cfg.rl.max_staleness:
            budget += cfg.deadlines.for_phase(Phase.TRAIN)  # phase 11 waits for the training phase 10 started
        if group_start is None:
            group_start, group_budget = time.monotonic(), 0.0
        group_budget += budget
        self.coordinator.set_position(iteration, phase, Deadline.after(budget, f"deadlines.{phase.name.lower()}={budget:g} s"))
        ctx = self._ctx(iteration, phase, plan)
        self.cancel.check()
        payload = None
        if spec.needs_engine:
            self.workload.engine_start(ctx)  # a no-op when it runs: covers a resume after phase 12
        self.coordinator.fault_point("hold", iteration, phase)
        self.coordinator.fault_point("raise", iteration, phase)
        acts, work, decide = spec.actor.acts(ctx.is_master), phases.WORK.get(phase), phases.DECIDE.get(phase, phases.no_decision)
        if cfg.rl.max_staleness and phase in phases.PIPELINED:  # training runs on into a later rollout
            acts, (work, decide) = True, phases.PIPELINED[phase](self.training)
        if acts and work is not None:
            payload = work(ctx)
        if spec.barrier is not Barrier.ALL:
            return plan, group_start, group_budget
        # Each rank's monitor enforces its own work deadline and reports it; the barrier's
        # deadline, later by one node timeout, is the backstop for ranks that cannot.
        deadline = Deadline(group_start + group_budget + cfg.coordination.node_timeout_s, f"deadlines.{phase.name.lower()}")
        decision = self.coordinator.barrier(iteration, phase, payload, deadline, lambda arrivals: decide(ctx, arrivals),
                                            self.decided.in_force)
        self.decided.released(decision)
        if "plan" in decision:
            plan = decision["plan"]
        if phase is Phase.SYNC_END:
            self._track()  # the iteration is complete
        if decision.get("stop"):
            raise StopRequested(f"stopped on request after iteration {iteration}, phase {phase.label}")
        return plan, None, 0.0

    def _retrain(self, e: Retrain, redo: tuple[int, Phase]) -> None:
        """Elastic: a rank was lost while the group trained. Stop this node's trainers (a
        collective with the lost one never ends) and its engines, and train the step again
        with the ranks left; the engines start again when a phase needs them. ``redo``: the
        phase the rank does again. A training in the background (rl.max_staleness >= 1) is
        launched again there, as the round the master declared, unless the redo launches it."""
        log.warning("%s", e)
        pending = self.training.pending
        self.coordinator.rearm(self._start_over(e))
        if pending is not None and redo != (pending, Phase.TRAIN):
            self.coordinator.enter_train_round(pending)
            plan = fsio.read_record(self.layout.iteration(pending).plan) or {"iteration": pending}
            launch, _ = phases.PIPELINED[Phase.TRAIN](self.training)
            launch(self._ctx(pending, Phase.TRAIN, plan))

    def _ctx(self, iteration: int, phase: Phase, plan: dict) -> PhaseContext:
        return PhaseContext(
            config=self.config,
            layout=self.layout,
            iteration=iteration,
            phase=phase,
            plan=plan,
            cancel=self.cancel,
            workload=self.workload,
            run=self._view(),
            log=log,
            policy=self.decided.policy,
            training=self.decided.training.get(iteration),
        )

    def _view(self) -> RunView:
        """The run as this phase's work sees it: data as of now, and the hooks it may call."""
        c = self.coordinator
        return RunView(attempt_id=c.attempt_id, attempt=c.attempt, in_run=c.in_run, train_round=c.train_round,
                       backoff=c.backoff, lost=c.lost, position=c.position, fault_point=c.fault_point, timing=c.timing,
                       took=c.took, progress=c.progress, verdict_s=c.verdict_s())


LOST_CONNECTION_SETTLE_S = 1.0


def _lost_connection(e: BaseException) -> bool:
    """Whether ``e`` came from a connection that was reset or refused (a child's server gone)."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, ConnectionError):
            return True
        todo += [x.__cause__, x.__context__, r if isinstance(r := getattr(x, "reason", None), BaseException) else None]
    return False


def _raise_interrupted(signum, _frame) -> None:
    _ignore_signals()
    raise Interrupted(signal.Signals(signum).name)


def _install_signal_handlers() -> None:
    signal.signal(signal.SIGINT, _raise_interrupted)
    signal.signal(signal.SIGTERM, _raise_interrupted)


def _ignore_signals() -> None:
    """While a rank cleans up, a second Ctrl+C must not cut the cleanup short."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
