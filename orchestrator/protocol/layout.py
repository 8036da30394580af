"""Every path under ``--log-path``, in one place (the only module that builds them).

    control/lease.json                        master lease: holder, generation, attempt
    control/claims/gen-<G>                    O_EXCL claim of lease generation G
    control/progress.json                     last released barrier (durable resume point)
    control/recovered/<stamp>/lease.json      `recover --apply`: a dead master's lease, moved aside
    attempts/<A>/start.json                   master: the attempt's plan (release of the join)
    attempts/<A>/release.json                 master: latest barrier release + its decision
    attempts/<A>/abort.json                   master: why the attempt ended (root cause)
    attempts/<A>/stop.json                    `orchestrator stop`: graceful stop request
    attempts/<A>/members.json                 master: ranks the run went on without, and those that rejoined (elastic)
    attempts/<A>/notes.json                   master: what the run does other than the config asked (fewer tasks), shown by `status`
    attempts/<A>/joins/r<R>.json              rank R: joined this attempt (host, pid, fingerprint)
    attempts/<A>/heartbeats/r<R>.json         rank R: liveness counter, where it is
    attempts/<A>/heartbeats/g<G>.json         leader of worker group G: its members' heartbeats as it last read them (coordination.fan_in)
    attempts/<A>/arrivals/r<R>.json           rank R: latest barrier it arrived at
    attempts/<A>/arrivals/g<G>.json           leader of worker group G: its members' arrivals (coordination.fan_in)
    attempts/<A>/failures/r<R>.json           rank R: why it stopped, written before it exits
    attempts/<A>/events/r<R>.jsonl            rank R: its event log (phase and barrier times)
    attempts/<A>/rendezvous.json              node of train worker 0: the training rendezvous address (RL)
    attempts/<A>/train/config-w<W>.json       train worker W's config, written by its node (RL)
    attempts/<A>/train/trainer-w<W>.log       train worker W's output (RL)
    attempts/<A>/train/done-w<W>.json         kept-alive train worker W: its answer to the latest request (RL)
    attempts/<A>/train/error-w<W>.json        train worker W's own error record, if it failed (RL)
    engines/r<R>/engine<E>.log, engine<E>.port  rank R: engine E's output and bound port (RL)
    engines/r<R>/engine<E>.error.json         rank R: embedded engine E's own error record, if it failed (RL)
    engines/r<R>/<name>-engine0.address.json  rank R: where its engine of models.<name> serves the other nodes (RL)
    iterations/<I>/plan.json                  master: tasks per rank, eval due (durable)
    iterations/<I>/summary.json               master: counts and metrics shown by `status`
    iterations/<I>/rollout/<split>/r<R>.jsonl rank R: its shard of trajectories
    iterations/<I>/rollout/<split>/r<R>.manifest.json   rank R: seal (count, sha256)
    iterations/<I>/rollout/<split>/r<R>.adopted.jsonl   master: rank R's records, copied when the run went on without it
    iterations/<I>/claims/<split>/c<K>.<G>.json   the rank that took chunk K (O_EXCL; generation G after a void claim)
    iterations/<I>/claims/<split>/stolen.r<R>.json  rank R: the chunks of other shares it claims, each listed before its claim
    iterations/<I>/claims/<split>/adopted.json    master: chunks made of the unfinished work of ranks no longer in the run
    iterations/<I>/claims/<split>/done.r<R>.json  rank R: the chunks it has finished (elastic, and the resample rounds: nobody
                                              moves on before all are), with their informative groups (rl.filter_groups)
    (<split>: train, eval, and train-r<K> for resample round K of rl.filter_groups, data/resample.py)
    iterations/<I>/aggregate/<split>.jsonl    master: merged shards
    iterations/<I>/aggregate/<split>.manifest.json      master: seal of the aggregate
    checkpoints/iter-<I>/                     master: checkpoint of iteration I
    checkpoints/current.json                  master: pointer to the current checkpoint
    checkpoints/consumers/r<R>.json           rank R: the checkpoint it last loaded (retention keeps it)
    checkpoints/.trash-iter-<I>.<hex>/        master: a checkpoint being removed (renamed aside, then deleted)
    metrics.jsonl                             master: one line of eval metrics per evaluated iteration
    doctor/session.json                       `doctor` master: the current doctor session (id, addresses, open/closed)
    doctor/<S>/r<R>.json, replace.json, new.json, result.json, {new,replace}-acks/r<R>.json   `doctor` session S: facts, probes, answers, verdict
    report/                                   `orchestrator report`: charts, report.json, index.html (default --out)
    tracking/state.json                       master: experiment tracking, each backend's state and the tracked run's ids
    tracking/tensorboard/, tracking/wandb/, tracking/mlflow/   master: what each tracking backend writes (tracking.backends)

Sync files live under ``attempts/<A>/``: a file from another attempt can never release a
barrier of this one (fencing). Work products live under ``iterations/`` and
``checkpoints/``: durable, keyed by iteration, reused on resume (checkpoints until
retention removes them, checkpoints/retention.py). A name that starts with a dot is never a work
product: staging directories, temp files, trash.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_CHECKPOINT_NAME = re.compile(r"iter-(\d{6,})")
TRASH_PREFIX = ".trash-"


def iteration_dir_name(iteration: int) -> str:
    return f"{iteration:06d}"


def checkpoint_iteration(name: str) -> int | None:
    """The iteration of a checkpoint directory named ``name`` (``iter-000003`` -> 3), else None."""
    match = _CHECKPOINT_NAME.fullmatch(name)
    return int(match.group(1)) if match else None


@dataclass(frozen=True, slots=True)
class RunLayout:
    root: Path

    # -- control -------------------------------------------------------------------------
    @property
    def control(self) -> Path:
        return self.root / "control"

    @property
    def lease(self) -> Path:
        return self.control / "lease.json"

    def recovered(self, stamp: str) -> Path:
        """Where `orchestrator recover --apply` moves sync state aside."""
        return self.control / "recovered" / stamp

    def claim(self, generation: int) -> Path:
        return self.control / "claims" / f"gen-{generation:06d}"

    @property
    def progress(self) -> Path:
        return self.control / "progress.json"

    def attempt(self, attempt_id: str) -> "AttemptLayout":
        return AttemptLayout(self.attempts / attempt_id)

    # -- work products ---------------------------------------------------------------------
    def iteration(self, iteration: int) -> "IterationLayout":
        return IterationLayout(self.iterations / iteration_dir_name(iteration))

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    def checkpoint(self, iteration: int) -> Path:
        return self.checkpoints / f"iter-{iteration_dir_name(iteration)}"

    def checkpoint_staging(self, iteration: int, attempt_id: str, round_: int = 0) -> Path:
        """Where an attempt's training writes the checkpoint before phase 10 renames it into
        place; a training round after the first (coordination.elastic) has its own."""
        final = self.checkpoint(iteration)
        return final.with_name(f".{final.name}.{attempt_id}{f'.r{round_}' if round_ else ''}.tmp")

    def checkpoint_stagings(self, iteration: int) -> list[Path]:
        """Every staging directory of ``iteration``'s checkpoint there is: any attempt's, any
        round's (:meth:`checkpoint_staging`)."""
        final = self.checkpoint(iteration)
        return sorted(final.parent.glob(f".{final.name}.*.tmp"))

    @property
    def current_checkpoint(self) -> Path:
        return self.checkpoints / "current.json"

    @property
    def checkpoint_consumers(self) -> Path:
        return self.checkpoints / "consumers"

    def checkpoint_consumer(self, rank: int) -> Path:
        """Rank R's consumer marker: the checkpoint its engines or trainers last loaded."""
        return self.checkpoint_consumers / f"r{rank:05d}.json"

    def checkpoint_trash(self, iteration: int, tag: str) -> Path:
        """Where the checkpoint of ``iteration`` goes while it is being deleted: a dot name that
        nothing reads, so a removal cut short by a crash leaves no half checkpoint behind."""
        return self.checkpoints / f"{TRASH_PREFIX}iter-{iteration_dir_name(iteration)}.{tag}"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def iterations(self) -> Path:
        return self.root / "iterations"

    @property
    def attempts(self) -> Path:
        return self.root / "attempts"

    @property
    def report(self) -> Path:
        return self.root / "report"

    @property
    def tracking(self) -> Path:
        return self.root / "tracking"

    def engine_dir(self, rank: int) -> Path:
        return self.root / "engines" / f"r{rank:05d}"

    def engine_log(self, rank: int, engine: int, model: str = "") -> Path:
        """``model``: an auxiliary model's engine (models.<name>), e.g. teacher-engine0.log."""
        return self.engine_dir(rank) / f"{_engine(engine, model)}.log"

    def engine_port_file(self, rank: int, engine: int, model: str = "") -> Path:
        return self.engine_dir(rank) / f"{_engine(engine, model)}.port"

    def engine_error(self, rank: int, engine: int, model: str = "") -> Path:
        return self.engine_dir(rank) / f"{_engine(engine, model)}.error.json"

    def engine_address(self, rank: int, engine: int, model: str) -> Path:
        """Where rank R's engine of models.<name> serves the nodes that do not serve it (a record:
        host, port, served name)."""
        return self.engine_dir(rank) / f"{_engine(engine, model)}.address.json"

    # -- `orchestrator doctor` -------------------------------------------------------------
    @property
    def doctor(self) -> Path:
        return self.root / "doctor"

    @property
    def doctor_session(self) -> Path:
        """The master's pointer to the current doctor session (rewritten per session)."""
        return self.doctor / "session.json"

    def doctor_dir(self, session: str) -> Path:
        return self.doctor / session

    def doctor_facts(self, session: str, rank: int) -> Path:
        return self.doctor_dir(session) / f"r{rank:05d}.json"

    def doctor_probe_new(self, session: str) -> Path:
        """Created by the master once: how soon each worker sees a new file."""
        return self.doctor_dir(session) / "new.json"

    def doctor_probe_replace(self, session: str) -> Path:
        """Written by the master before the session opens, replaced once: how soon workers see new content."""
        return self.doctor_dir(session) / "replace.json"

    def doctor_new_acks(self, session: str) -> Path:
        return self.doctor_dir(session) / "new-acks"

    def doctor_new_ack(self, session: str, rank: int) -> Path:
        return self.doctor_new_acks(session) / f"r{rank:05d}.json"

    def doctor_replace_acks(self, session: str) -> Path:
        return self.doctor_dir(session) / "replace-acks"

    def doctor_replace_ack(self, session: str, rank: int) -> Path:
        return self.doctor_replace_acks(session) / f"r{rank:05d}.json"

    def doctor_result(self, session: str) -> Path:
        return self.doctor_dir(session) / "result.json"


@dataclass(frozen=True, slots=True)
class AttemptLayout:
    root: Path

    @property
    def start(self) -> Path:
        return self.root / "start.json"

    @property
    def release(self) -> Path:
        return self.root / "release.json"

    @property
    def abort(self) -> Path:
        return self.root / "abort.json"

    @property
    def stop(self) -> Path:
        return self.root / "stop.json"

    @property
    def members(self) -> Path:
        """The master's record of ranks out of the run and back in (protocol/membership.py)."""
        return self.root / "members.json"

    @property
    def notes(self) -> Path:
        """The master's notes on how the attempt reads its configuration (a train split with
        fewer tasks than rl.train_tasks asks), said once in its log and shown by `status`."""
        return self.root / "notes.json"

    # One directory per kind of file, each holding one file per rank: a poll that reads N
    # names refreshes one directory first (NFS revalidates a directory's entries, negative
    # ones included, when it is opened), and no rank's lookup depends on another's mkdir.
    @property
    def joins(self) -> Path:
        return self.root / "joins"

    def join(self, rank: int) -> Path:
        return self.joins / f"r{rank:05d}.json"

    @property
    def heartbeats(self) -> Path:
        return self.root / "heartbeats"

    def heartbeat(self, rank: int) -> Path:
        return self.heartbeats / f"r{rank:05d}.json"

    def group_heartbeat(self, group: int) -> Path:
        return self.heartbeats / f"g{group:05d}.json"

    @property
    def arrivals(self) -> Path:
        return self.root / "arrivals"

    def arrive(self, rank: int) -> Path:
        return self.arrivals / f"r{rank:05d}.json"

    def group_arrival(self, group: int) -> Path:
        return self.arrivals / f"g{group:05d}.json"

    @property
    def failures(self) -> Path:
        return self.root / "failures"

    def failure(self, rank: int) -> Path:
        return self.failures / f"r{rank:05d}.json"

    @property
    def events_dir(self) -> Path:
        return self.root / "events"

    def events(self, rank: int) -> Path:
        return self.events_dir / f"r{rank:05d}.jsonl"

    @property
    def rendezvous(self) -> Path:
        return self.root / "rendezvous.json"

    def trainer_config(self, worker: int) -> Path:
        return self.root / "train" / f"config-w{worker:05d}.json"

    def trainer_log(self, worker: int) -> Path:
        return self.root / "train" / f"trainer-w{worker:05d}.log"

    def trainer_done(self, worker: int) -> Path:
        """A serving trainer's answer to its latest request (train/worker.py, ``--serve``)."""
        return self.root / "train" / f"done-w{worker:05d}.json"

    def trainer_error(self, worker: int) -> Path:
        return self.root / "train" / f"error-w{worker:05d}.json"


@dataclass(frozen=True, slots=True)
class IterationLayout:
    root: Path

    @property
    def plan(self) -> Path:
        return self.root / "plan.json"

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"

    def shard(self, split: str, rank: int) -> Path:
        return self.root / "rollout" / split / f"r{rank:05d}.jsonl"

    def adopted_shard(self, split: str, rank: int) -> Path:
        """The master's sealed copy of an absent rank's records (data/claims.py, ``adopt``): what
        the merge reads for that rank from then on, whatever its own shard still gets."""
        return self.root / "rollout" / split / f"r{rank:05d}.adopted.jsonl"

    def shard_manifest(self, split: str, rank: int) -> Path:
        return self.root / "rollout" / split / f"r{rank:05d}.manifest.json"

    def claims(self, split: str) -> Path:
        return self.root / "claims" / split

    def claim(self, split: str, chunk: int, generation: int) -> Path:
        """Created (O_EXCL) by the rank that takes chunk ``chunk`` of ``split`` (data/claims.py)."""
        return self.claims(split) / f"c{chunk:05d}.{generation}.json"

    def stolen(self, split: str, rank: int) -> Path:
        """The chunks of other ranks' shares ``rank`` claims, each written here before its claim
        is created: with its own chunks, all a restarted rank reads to find what it holds (data/claims.py)."""
        return self.claims(split) / f"stolen.r{rank:05d}.json"

    def adopted(self, split: str) -> Path:
        """The master's chunks of absent ranks' unfinished work (a run resumed on fewer nodes)."""
        return self.claims(split) / "adopted.json"

    def done_chunks(self, split: str, rank: int) -> Path:
        """The chunks ``rank`` has finished, rewritten by it after each (elastic runs)."""
        return self.claims(split) / f"done.r{rank:05d}.json"

    def aggregate(self, split: str) -> Path:
        return self.root / "aggregate" / f"{split}.jsonl"

    def aggregate_manifest(self, split: str) -> Path:
        return self.root / "aggregate" / f"{split}.manifest.json"


def _engine(engine: int, model: str) -> str:
    """An engine's file stem: engine0 (the policy's), teacher-engine0 (models.teacher's)."""
    return f"{model}-engine{engine}" if model else f"engine{engine}"
