"""The RL workload: what each phase asks of the compute, done for real.

Rollout and eval send the rank's prompts to its node's engine over the OpenAI-compatible
HTTP API (the embedded engine, or vLLM) and score each completion with the configured
reward. Training runs ``orchestrator.train.worker`` on every rank as one torch.distributed
job. Records are JSON (see docs/demo.md and the trainer's contract in train/worker.py).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import logging
import random
import time
from pathlib import Path

from orchestrator.phase_table import Phase
from orchestrator.plugins import agents, environments, rewards
from orchestrator.config import RunConfig
from orchestrator import checkpoints
from orchestrator.checkpoints import node_copy, retention, store
from orchestrator.data import carry, prompts, resample, shards
from orchestrator.engine.client import EngineClient
from orchestrator.node.procs import Children
from orchestrator.protocol.layout import RunLayout
from orchestrator.protocol.waiting import Backoff, Deadline, poll
from orchestrator.protocol.schema import TrainingPlan
from orchestrator.runtime.context import PhaseContext
from orchestrator.workloads.rl.aux_models import AuxModels
from orchestrator.workloads.rl.engine_process import NodeEngines, wait_memory_released
from orchestrator.workloads.rl.engine_requests import REQUEST_TIMEOUT_S, Inflight
from orchestrator.workloads.rl.episodes import Episodes, RoomWatch
from orchestrator.workloads.rl.judge import Judge
from orchestrator.workloads.rl.rollout_pipe import MultiTurnPipe, RLRolloutPipe
from orchestrator.workloads.rl.scoring import Scorer
from orchestrator.workloads.rl.teacher import Teacher
from orchestrator.train import launch
from orchestrator.train.settings import TrainerSettings, UpdateSettings
from orchestrator.workloads.rl import trainer_address

log = logging.getLogger(__name__)

MIN_CHUNK_TASKS = 16
"""The smallest chunk of tasks a rank claims: fewer claim files than one per task, and small
enough that a rank which finishes early still finds work to steal."""
DEFAULT_MAX_INFLIGHT = {"embedded": 1024, "vllm": 1024}
"""Sequences in flight per engine when rollout.max_inflight is 0: what each engine batches well."""
SEQUENCES_PER_REQUEST = {"embedded": 128, "vllm": 1}
"""Sequences per engine request when rollout.prompts_per_request is 0 (in whole prompts, at
least one): vLLM schedules each sequence on its own and a request carries one seed, so one
prompt's samples a request; each request to the embedded engine costs an HTTP round trip and
a prefill of its own, which for short completions on a CPU node is worth many prompts."""


def prompts_per_request(engine: str, samples: int) -> int:
    """The engine's default prompts a request at ``samples`` a prompt (SEQUENCES_PER_REQUEST)."""
    return max(1, SEQUENCES_PER_REQUEST[engine] // samples)


def shortfall(split: str, wanted: int, path: Path, held: int, usable: int) -> str | None:
    """The note for a task file with fewer usable tasks than an iteration asks for (``held``
    in the file, ``usable`` of them with a prompt that fits), else None."""
    if wanted <= usable:
        return None
    key = "rl.train_tasks" if split == "train" else "rl.eval_tasks"
    fits = f", {usable} of them with a prompt short enough" if usable < held else ""
    uses = f"each iteration samples all {usable}" if split == "train" else f"each evaluation uses all {usable}"
    return f"{key}={wanted} but {path} holds {held} tasks{fits}: {uses}"


class RLWorkload:
    min_chunk_tasks = MIN_CHUNK_TASKS
    simulated = False

    def __init__(self, config: RunConfig, children: Children):
        self.config = config
        self.rl = config.rl
        self.children = children
        self.reward = rewards.load(self.rl.reward)
        self.eval_reward = rewards.load(self.rl.eval_reward, "rl.eval_reward") if self.rl.eval_reward else self.reward
        self._judge_parts = None  # (template, tokenizer, context) of judge.model, loaded once
        # Each split's tasks with the text the engine continues, without those whose prompt is too long.
        self.prompts = {split: prompts.measure(config, split) for split in ("train", "eval")}
        self.tasks = {split: m.tasks for split, m in self.prompts.items()}
        self.by_id = {split: {t["id"]: t for t in split_tasks} for split, split_tasks in self.tasks.items()}
        for split, m in self.prompts.items():
            if m.skipped:
                log.warning("%d of %d %s tasks are left out: their prompt is longer than %d tokens (rl.max_prompt_tokens%s)",
                            m.skipped, m.total, split, m.limit, "" if self.rl.max_prompt_tokens else
                            f" unset: the model's context length less rl.max_tokens={self.rl.max_tokens}")
        self.layout = RunLayout(config.log_path)
        self.engines: NodeEngines | None = None  # built from the placement at the first start
        self.clients: list[EngineClient] = []
        self.aux = AuxModels(children, config, self.layout)  # models.<name>: served here, or by other nodes
        self._verified = checkpoints.Verified()
        self.copies: node_copy.NodeCopies | None = None  # publish.delta: the versions this node rebuilt (made at the first start)
        self._ids: dict[tuple[str, int], list[str]] = {}  # task_ids, drawn once per split and iteration
        self._carry_of: tuple[int, dict[str, dict]] = (0, {})  # rollout.partial: (iteration, the groups it continues)
        self._tokenizer = None  # the model's, for multi-turn rollouts (rl.environment)
        self._room = RoomWatch()  # across the run's multi-turn rollouts: their samples cut for room, warned of once
        self.trainers = launch.NodeTrainers(children, keep_alive=config.train.keep_alive)

    # -- tasks -------------------------------------------------------------------------------

    def tasks_per_iteration(self, split: str) -> int:
        if resample.is_round(split):  # what the train file holds beyond the rounds before it
            k = resample.round_of(split)
            return max(0, min(self.rl.train_tasks, len(self.tasks["train"]) - k * self.tasks_per_iteration("train")))
        if split == "train" and self.config.rollout.partial:  # and rollout.oversample more, to stop early
            return min(carry.pool(self.rl.train_tasks, self.config.rollout.oversample), len(self.tasks[split]))
        return min(self._wanted(split), len(self.tasks[split]))  # fewer than asked: notes() says so

    def trained_per_iteration(self) -> int:
        """Groups an iteration trains: its train tasks (with rollout.partial, fewer than it rolls out)."""
        return min(self.rl.train_tasks, len(self.tasks["train"]))

    def carried(self, iteration: int) -> dict[str, dict]:
        """rollout.partial: the groups the rollout of ``iteration`` continues first (the carry
        aggregate of the iteration before), by task id, in their order."""
        if not self.config.rollout.partial or iteration <= 1:
            return {}
        if self._carry_of[0] != iteration:
            path = self.layout.iteration(iteration - 1).aggregate("carry")  # the master made one before this iteration's plan
            timeout = self.config.coordination.node_timeout_s
            records = poll(lambda: carry.read(path), deadline=Deadline.after(timeout, f"the carried groups {path}"),
                           backoff=Backoff(0.05, 1.0), on_timeout=lambda: shards.ShardError(
                               f"the carried groups of iteration {iteration - 1} ({path}) are not there (waited "
                               f"coordination.node_timeout_s={timeout:g} s): the master writes them as it aggregates that "
                               f"iteration; check that this node sees --log-path as the master does"))
            self._carry_of = (iteration, {r["task_id"]: r for r in records})
        return self._carry_of[1]

    def prompts_too_long(self, split: str) -> int:
        return self.prompts[split].skipped

    def notes(self) -> list[str]:
        return [n for split in ("train", "eval") if (n := shortfall(split, self._wanted(split), self.config.task_file(split),
                                                                   self.prompts[split].total, len(self.tasks[split])))]

    def _wanted(self, split: str) -> int:
        return self.rl.train_tasks if split == "train" else self.rl.eval_tasks

    def task_ids(self, split: str, iteration: int) -> list[str]:
        key = (split, iteration)
        if key not in self._ids:
            self._ids = {k: v for k, v in self._ids.items() if k[1] >= iteration - 1}  # keep the last iterations' only
            self._ids[key] = self._task_ids(split, iteration)
        return self._ids[key]

    def _task_ids(self, split: str, iteration: int) -> list[str]:
        if resample.is_round(split):  # rl.filter_groups: further train tasks, none an earlier round drew
            k = resample.round_of(split)
            drawn = {t for j in range(k) for t in self.task_ids(resample.split_of(j), iteration)}
            rest = [t["id"] for t in self.tasks["train"] if t["id"] not in drawn]
            return random.Random(f"{self.config.seed}:train:{iteration}:round{k}").sample(rest, min(self.tasks_per_iteration(split), len(rest)))
        ids = [t["id"] for t in self.tasks[split]]
        n = self.tasks_per_iteration(split)
        if split == "eval":
            return ids[:n]  # the same eval set every time, so the curve compares like with like
        carried = [t for t in self.carried(iteration) if t in self.by_id["train"]]  # first, then new ones
        if carried:
            taken = set(carried)
            return carried + random.Random(f"{self.config.seed}:train:{iteration}").sample(
                [t for t in ids if t not in taken], max(0, n - len(carried)))
        return random.Random(f"{self.config.seed}:train:{iteration}").sample(ids, n)

    # -- engine ------------------------------------------------------------------------------

    def verified(self, policy: store.Checkpoint, timing=None, fault=None) -> Path:
        """The directory the engines load ``policy`` from: with ``publish.delta`` the node-local
        copy, rebuilt and checked (checkpoints/node_copy.py); otherwise the checkpoint itself,
        its weights checked against its manifest (the base model has none). This rank's
        consumer marker names the checkpoint first: retention never removes a checkpoint a
        marker names (nor the chain it is rebuilt from)."""
        if not self._rebuilds(policy):
            return self._consumed(policy, checkpoints.WEIGHTS)
        self._consumed(policy, None)
        copies = self._node_copies()
        before = copies.last
        path = copies.get(policy, fault)
        if timing is not None and copies.last is not before:
            timing("engine.rebuild", copies.last.seconds, bytes=copies.last.bytes_read)
        return path

    def _rebuilds(self, policy: store.Checkpoint) -> bool:
        """Whether the engines serve ``policy`` from a node-local copy (publish.delta, no
        LoRA): the base model too, copied as it is, which the first version's delta applies to."""
        return self.config.publish.delta and not self.config.train.lora_rank

    def _node_copies(self) -> node_copy.NodeCopies:
        if self.copies is None:
            self.copies = node_copy.NodeCopies(self.layout, local_cache(self.config))
        return self.copies

    def _consumed(self, policy: store.Checkpoint, part: str | None) -> Path:
        """``policy``'s directory, named by this rank's consumer marker, and ``part`` of it
        verified (None: the reader verifies what it reads, as a trainer does when it loads)."""
        retention.mark_consumer(self.layout, self.config.rank, policy.path)
        if not policy.is_base and part is not None:
            self._verified.check(policy.path, part)
        return policy.path

    def _node_engines(self, ctx: PhaseContext) -> NodeEngines:
        if self.engines is None:
            specs = ctx.run.placement.engines_on(ctx.rank)
            self.engines = NodeEngines(self.children, specs, self.config.rollout, self.layout, ctx.rank, seed=self.config.seed,
                                       base=self.config.model_path if self.config.train.lora_rank else None,
                                       lora_rank=self.config.train.lora_rank, local=local_cache(self.config))
        return self.engines

    def engine_start(self, ctx: PhaseContext) -> None:
        if self.config.debug_mode:
            self.clients = [EngineClient(self.config.rollout.engine_url, timeout_s=600)]
            return
        engines = self._node_engines(ctx)
        if not engines.engines:  # a node that only trains: it reads no weights (and names none as consumed)
            self.clients = []
            self.aux.start(ctx)  # it may serve a model beside the policy (models.<name>.nodes)
            return
        shared = sorted(self.trainers.gpus & {g for e in engines.engines if not e.running for g in e.spec.gpus})
        if shared:  # kept-alive trainers offloaded their state after training: check that the memory is back
            wait_memory_released(shared, self.config.rollout, ctx.cancel)
        fault = functools.partial(ctx.run.fault_point, "hold-in-rebuild", ctx.iteration, ctx.phase)
        self.clients = engines.ensure(self.verified(ctx.policy, ctx.run.timing, fault), ctx.cancel, timing=ctx.run.timing)
        self.aux.start(ctx)

    def engine_stop(self, ctx: PhaseContext) -> None:
        """Phase 7: free the GPUs training shares with the engines (colocated); disaggregated
        engines keep their GPUs and serve on until phase 12 moves them, and an embedded engine
        on CPU has nothing to free and serves on too."""
        if self.config.debug_mode:
            return
        placement = ctx.run.placement
        if not placement.colocated:
            kept = "keep their GPUs and " if any(e.gpus for e in placement.engines) else ""  # on CPU they hold none
            ctx.log.info(f"disaggregated placement: the engines {kept}serve on through training")
            return
        if self.engines is not None:
            train_gpus = [w.gpu for w in placement.train_workers_on(ctx.rank) if w.gpu is not None]
            began = time.monotonic()
            if all(d == "kept" for d in self.engines.release(train_gpus, ctx.cancel)):
                return  # they serve on: phase 12 moves them to the new checkpoint in place
            ctx.run.timing("engine.release", time.monotonic() - began)
        self.clients = []

    def close(self) -> None:
        self.trainers.stop()
        if self.engines is not None:
            self.engines.stop()
        self.aux.stop()
        if self.copies is not None:
            self.copies.close()
        self.clients = []

    # -- rollout and eval ----------------------------------------------------------------------

    def rollout_pipe(self, ctx: PhaseContext, split: str) -> RLRolloutPipe:
        """The rollout's requests in flight on this node's engines (``rollout.max_inflight``
        sequences on each), answered as scored records in durable batches (with
        ``rl.environment``, multi-turn episodes). The engines start with the first task (a node
        without engines never gets one)."""
        train = resample.base(split) == "train"
        sampling = {"n": self.rl.samples_per_prompt if train else self.rl.eval_samples,
                    "temperature": self.rl.temperature if train else self.rl.eval_temperature,
                    "top_p": self.rl.top_p, "max_tokens": self.rl.max_tokens, "stop": self.rl.stop, "logprobs": 0,
                    "return_token_ids": True}

        def start() -> Inflight:
            if not self.clients:
                self.engine_start(ctx)
            for client in self.clients:
                client.model()  # the served name, asked once here: the requests in flight send nothing else
                if self.config.rollout.partial:
                    client.resume()  # an engine a rank stopped mid-rollout before it died serves on
            return Inflight(self.clients, max_sequences=self.max_inflight(), sampling=sampling, timeout_s=REQUEST_TIMEOUT_S)

        tasks = resample.base(split)
        key, spec = ("rl.reward", self.rl.reward) if train or not self.rl.eval_reward else ("rl.eval_reward", self.rl.eval_reward)
        judged = rewards.is_judge(spec)

        def judge() -> Judge:  # after start(): the judge's engines started with the policy's
            template, tokenizer, context = self._judge()
            inflight = self.aux.inflight(ctx, self.config.judge.model, max_sequences=self.max_inflight(), sampling={
                "n": 1, "temperature": self.config.judge.temperature, "max_tokens": self.config.judge.max_tokens})
            return Judge(inflight, self.config.judge, template, tokenizer, context, self.by_id[tasks],
                         f"{self.config.seed}:{split}:{ctx.iteration}:judge")

        def teacher() -> Teacher:  # after start(): the teacher's engines started with the policy's
            return Teacher(self.aux.inflight(ctx, self.rl.teacher, max_sequences=self.max_inflight(), sampling={"n": 1}),
                           self.rl.teacher)

        policy = ctx.policy  # what the engines serve: phase 1 or 6 moved them to it
        record = functools.partial(self._record, policy=str(policy.path), policy_iteration=policy.iteration)
        carried = self.carried(ctx.iteration) if split == "train" else {}
        stages = ([judge] if judged else []) + ([teacher] if train and self.rl.teacher else [])  # eval is never distilled
        if self.rl.environment:
            scorer = Scorer(None, f"rl.environment={self.rl.environment}", self.rl.max_reward_error_fraction, split)
            return MultiTurnPipe(ctx, split, start, scorer, self._episodes(), self.by_id[tasks], record, samples=sampling["n"],
                                 carried=carried, stages=stages)
        if self.rl.agent:
            scorer = Scorer(None, f"rl.agent={self.rl.agent}", self.rl.max_reward_error_fraction, split)
            return MultiTurnPipe(ctx, split, start, scorer, self._agents(self.reward if train else self.eval_reward), self.by_id[tasks],
                                 record, samples=sampling["n"], carried=carried, stages=stages)
        scorer = Scorer(None if judged else self.reward if train else self.eval_reward, f"{key}={spec}", self.rl.max_reward_error_fraction,
                        split)
        return RLRolloutPipe(ctx, split, start, scorer, self.prompts[tasks].texts, self.by_id[tasks], record,
                             prompts_per_request=self.prompts_per_request(sampling["n"]), carried=carried, max_tokens=self.rl.max_tokens,
                             stages=stages)

    def _judge(self) -> tuple[str, object, int]:
        """judge.model's (template, tokenizer, context length), loaded once."""
        if self._judge_parts is None:
            from transformers import AutoTokenizer

            path = self.config.aux_model_path(self.config.judge.model)
            self._judge_parts = (self.config.judge_template(), AutoTokenizer.from_pretrained(str(path)), prompts.context_length(path))
        return self._judge_parts

    def _chat_tokenizer(self):
        """The model's tokenizer, for multi-turn rollouts and agents (loaded once)."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(str(self.config.model_path))
        return self._tokenizer

    def _agents(self, reward):
        """The agent rollout's runner (``rl.agent``): the user's agent against this rollout's
        endpoint (agents/endpoint.py), ``reward`` scoring an answer it returns as text."""
        from orchestrator.agents import endpoint, runner

        serving = endpoint.AgentEndpoint(self._chat_tokenizer(), tool_parser=self.config.rollout.tool_parser,
                                         max_tokens=self.rl.max_tokens, context=prompts.context_length(self.config.model_path))
        return runner.Agents(agents.load(self.rl.agent, self.rl.environment_args), f"rl.agent={self.rl.agent}", serving, reward, self.rl.env_timeout_s)

    def _episodes(self) -> Episodes:
        """The multi-turn rollout's runner (``rl.environment``), with the model's tokenizer."""
        return Episodes(environments.load(self.rl.environment), self.rl.environment, self._chat_tokenizer(), max_turns=self.rl.max_turns,
                        max_tokens=self.rl.max_tokens, context=prompts.context_length(self.config.model_path),
                        timeout_s=self.rl.env_timeout_s, args=self.rl.environment_args, step_rewards=self.rl.step_rewards,
                        room=self._room)

    def prompts_per_request(self, samples: int) -> int:
        """Prompts in one engine request at ``samples`` a prompt: ``rollout.prompts_per_request``,
        or the engine's default."""
        return self.config.rollout.prompts_per_request or prompts_per_request(self.config.rollout.engine, samples)

    def max_inflight(self) -> int:
        """Sequences in flight per engine: ``rollout.max_inflight``, or the engine's default."""
        return self.config.rollout.max_inflight or DEFAULT_MAX_INFLIGHT[self.config.rollout.engine]

    def _record(self, ctx: PhaseContext, split: str, task: dict, prompt: str, prompt_ids: list[int], samples: list[dict],
                seconds: float, *, policy: str, policy_iteration: int, sent_at: float) -> dict:
        """One task's trajectory record. The trainer trains on the token ids the engine sampled
        (``prompt_token_ids``, each sample's ``token_ids``), never on the text re-tokenized. The
        task's other columns ride along (``columns``; ``data_source`` at the top, for eval's
        breakdown by source)."""
        columns = {k: v for k, v in task.items() if k not in _OWN_COLUMNS}
        return {
            "task_id": task["id"],
            "split": split,
            "iteration": ctx.iteration,
            "rank": ctx.rank,
            "attempt": ctx.attempt_id,
            "policy": policy,
            "policy_iteration": policy_iteration,
            "prompt": prompt,
            "prompt_token_ids": prompt_ids,
            "answer": task["answer"],
            "seconds": seconds,
            "sent_at": sent_at,
            "samples": samples,
        } | ({"data_source": str(task["data_source"])} if task.get("data_source") is not None else {}) | (
            {"columns": json.loads(json.dumps(columns, default=str))} if columns else {})  # as JSON holds them

    def metrics(self, ctx: PhaseContext, eval_records: Path) -> dict:
        rewards_all, best, lengths, turns = [], [], [], []
        env_metrics: dict[str, list[float]] = {}  # rl.environment's Step.metrics, per name
        by_source: dict[str, list[float]] = {}  # the rewards of each data_source
        tokens: dict[int, int] = collections.Counter()  # per rank
        spans: dict[int, list[float]] = {}  # per rank: first request sent, last answered
        with open(eval_records, "rb") as f:
            for line in f:
                rec = json.loads(line)
                rs = [s["reward"] for s in rec["samples"]]
                rewards_all += rs
                if rec.get("data_source") is not None:
                    by_source.setdefault(rec["data_source"], []).extend(rs)
                best.append(max(rs))
                for s in rec["samples"]:
                    if "loss_mask" in s:  # multi-turn: the ids sampled, not the environment's
                        n_tok = sum(s["loss_mask"])
                        turns.append(len(s.get("turns") or ()))
                        for name, value in (s.get("metrics") or {}).items():
                            env_metrics.setdefault(name, []).append(value)
                    else:
                        n_tok = len(s["logprobs"]) if s.get("logprobs") is not None else len(s["text"])
                    lengths.append(n_tok)
                    tokens[rec["rank"]] += n_tok
                sent = rec.get("sent_at", 0.0)
                span = spans.setdefault(rec["rank"], [sent, sent])
                span[0], span[1] = min(span[0], sent), max(span[1], sent + rec.get("seconds", 0.0))
        if not rewards_all:
            return {"accuracy": 0.0, "mean_reward": 0.0, "pass_at_k": 0.0, "response_length": 0.0, "tokens_per_s": 0.0}
        mean = sum(rewards_all) / len(rewards_all)
        return {
            "accuracy": sum(1.0 for r in rewards_all if r >= 1.0) / len(rewards_all),
            "mean_reward": mean,
            "pass_at_k": sum(1.0 for b in best if b >= 1.0) / len(best),
            "k": self.rl.eval_samples,
            "response_length": sum(lengths) / len(lengths),
            # Requests overlap: each rank's tokens over its span, added up over the ranks.
            "tokens_per_s": sum(tokens[r] / (end - start) for r, (start, end) in spans.items() if end > start),
            "tasks": len(best),
        } | ({"turns": sum(turns) / len(turns)} if turns else {}) | {
            f"env/{name}": sum(values) / len(values) for name, values in sorted(env_metrics.items())} | {
            f"{what}/{source}": figure for source, rs in sorted(by_source.items())
            for what, figure in (("accuracy", sum(1.0 for r in rs if r >= 1.0) / len(rs)), ("mean_reward", sum(rs) / len(rs)))}

    # -- training ------------------------------------------------------------------------------

    def train(self, ctx: PhaseContext, plan: TrainingPlan, checkpoint_dir: Path | None) -> None:
        """Run this node's train workers (one per GPU the placement gives it; one on CPU) as
        part of one torch.distributed job (train/launch.py); worker 0 writes into
        ``checkpoint_dir`` (None on the other nodes), and every other worker its part into the
        same staging directory."""
        began = time.monotonic()
        step = self._train_step(ctx, plan, checkpoint_dir)
        if not step.workers:
            return
        done = self.trainers.update(step)
        for worker, record in sorted(done.items()):
            stats = record.get("stats") or {}
            if stats.get("replayed"):
                ctx.log.info("train worker %d replayed iterations %d..%d from their aggregates before iteration %d's update",
                             worker, *stats["replayed"], ctx.iteration)
            written = stats.get("checkpoint_bytes")  # worker 0's: the whole checkpoint
            for part, seconds in record["timing"].items():
                extra = ({"bytes": written, "bytes_state": stats.get("state_bytes") or 0, "bytes_delta": stats.get("delta_bytes") or 0}
                         if part == "checkpoint" and written else {})
                ctx.run.timing(f"train.{part}", seconds, worker=worker, pid=record["pid"], **extra)
        ctx.run.timing("train.total", time.monotonic() - began)

    def _train_step(self, ctx: PhaseContext, plan: TrainingPlan, checkpoint_dir: Path | None) -> launch.Step:
        """The iteration's update on this node, described once for the launcher: each worker's
        request and files, the group, and where its rendezvous comes from."""
        run = ctx.run
        placement, attempt = run.placement, run.attempt
        here = placement.train_workers_on(ctx.rank)
        workers = ()
        if here:
            base = self._trainer_config(ctx, plan)
            # Every worker writes its part into the staging directory that the node of worker 0
            # made (phase 10); with LoRA under ddp worker 0 writes it all (megabytes).
            staging = checkpoint_dir or ctx.layout.checkpoint_staging(ctx.iteration, ctx.attempt_id, run.train_round)
            offload = placement.colocated and bool(placement.engines_on(ctx.rank))
            workers = tuple(
                launch.Worker(w.rank, w.gpu,
                              {**base, "output": str(staging),
                               "offload": offload and w.gpu is not None},
                              launch.WorkerFiles(attempt.trainer_config(w.rank), attempt.trainer_done(w.rank),
                                                 attempt.trainer_error(w.rank), attempt.trainer_log(w.rank)))
                for w in here)
        return launch.Step(
            iteration=ctx.iteration, node=ctx.rank, workers=workers, group=tuple((w.rank, w.node) for w in placement.train_workers),
            rendezvous=lambda: trainer_address.publish_or_read(ctx), cancel=ctx.cancel, timeout_s=self.rl.train_timeout_s,
            peer_verdict_s=run.verdict_s, training=lambda: run.position()[1] is Phase.TRAIN)

    def _writes_state(self, ctx: PhaseContext) -> bool:
        """Whether this iteration's checkpoint holds the training state: every
        ``checkpoint.state_every`` iterations, at the last, when a stop was asked for, and
        always when no trainer is kept between iterations (each would replay otherwise)."""
        cfg = self.config
        last = cfg.max_iterations is not None and ctx.iteration >= cfg.max_iterations
        return (ctx.iteration % cfg.checkpoint.state_every == 0 or last or not cfg.train.keep_alive
                or ctx.run.attempt.stop.exists())

    def _replay(self, ctx: PhaseContext, plan: TrainingPlan) -> dict:
        """The request's replay, when the checkpoint the update starts from holds no training
        state (checkpoint.state_every): the last checkpoint before it that does (or the base
        model) and the iterations after it, each trained again from its durable aggregate by
        a trainer that does not hold the init in memory. Nothing when there is no need."""
        if not plan.init or checkpoints.has_state(self.layout.root / plan.init):
            return {}
        start = plan.init_iteration - 1
        while start > 0 and not checkpoints.has_state(self.layout.checkpoint(start)):
            start -= 1
        steps = []
        for j in range(start + 1, plan.init_iteration + 1):
            data = self.layout.iteration(j).aggregate("train")
            if shards.sealed(data) is None:
                raise checkpoints.CheckpointCorrupt(
                    f"iteration {plan.init_iteration}'s checkpoint holds no training state and iteration {j}'s train aggregate "
                    f"{data} is not there to train it again: restore it, or start a new --log-path")
            steps.append({"iteration": j, "data": str(data), "seed": self.config.seed + j})
        source = store.Checkpoint(self.layout.checkpoint(start), start) if start else store.Checkpoint(self.config.model_path, 0)
        ctx.log.info("iteration %d's update starts from iteration %d, whose checkpoint holds no training state: a trainer that does "
                     "not hold it in memory replays iterations %d..%d from their aggregates, from %s", ctx.iteration,
                     plan.init_iteration, start + 1, plan.init_iteration, f"iteration {start}'s state" if start else "the base model")
        return {"replay": steps, "replay_from": str(source.path), "replay_from_iteration": start or None}

    def _correction(self) -> str:
        """rl.is_correction as the update applies it: auto is tis with rollout.partial too (a
        carried sample's first tokens come from an older policy), as with rl.max_staleness."""
        if self.config.rollout.partial and self.rl.is_correction == "auto" and self.rl.old_logprobs == "trainer":
            return "tis"
        return self.rl.correction

    def _publish_dtype(self) -> str:
        """publish.dtype as the trainer takes it: a torch dtype's name, or auto (the dtype the
        engines serve: vLLM's rollout.dtype when it names one, else the checkpoint's own, which
        is what the embedded engine and vLLM's auto load)."""
        chosen = self.config.publish.dtype
        if chosen == "auto" and self.config.rollout.engine == "vllm":
            chosen = self.config.rollout.dtype
        return _TORCH_DTYPES.get(chosen, "auto")

    def _trainer_config(self, ctx: PhaseContext, plan: TrainingPlan) -> dict:
        """The train request (train/request.py) of ``plan``: its paths, and the run's own ``rl``
        and ``train`` settings of the update as the run validated them (train/settings.py)."""
        init = store.Checkpoint(self.layout.root / plan.init, plan.init_iteration) if plan.init else \
            store.Checkpoint(self.config.model_path, 0)
        return {
            "iteration": ctx.iteration,
            "data": str(self.config.log_path / plan.data),
            "init_checkpoint": str(self._consumed(init, None)),  # a trainer that loads it verifies it (train/policy.py)
            "init_iteration": plan.init_iteration or None,
            "reference_checkpoint": str(self.config.model_path) if self.rl.kl_coef > 0 else None,
            "seed": self.config.seed + ctx.iteration,
            "base_model": str(self.config.model_path) if self.config.train.lora_rank else None,
            "publish_dtype": self._publish_dtype(),
            "write_state": self._writes_state(ctx),
            **self._replay(ctx, plan),
            "publish_delta": self.config.publish.delta,
            "publish_full_every": self.config.publish.full_every,
            "rl": {**_section(self.rl, UpdateSettings), "is_correction": self._correction()},
            "train": _section(self.config.train, TrainerSettings),
        }


def local_cache(config: RunConfig) -> Path:
    """This rank's node-local directory of rebuilt versions: under ``rollout.local_cache``,
    or the node's temp dir, named by the run and the rank (ranks share a machine in tests)."""
    import hashlib
    import tempfile

    root = Path(config.rollout.local_cache) if config.rollout.local_cache else Path(tempfile.gettempdir()) / "orchestrator-cache"
    run = hashlib.sha256(str(Path(config.log_path).resolve()).encode()).hexdigest()[:12]
    return root / f"{run}-r{config.rank:05d}"


_OWN_COLUMNS = ("id", "prompt", "answer", "data_source")
"""A task's columns that a record holds under names of its own (``task_id``, ``prompt``, ...)."""

_TORCH_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16", "half": "float16",
                 "fp32": "float32", "float32": "float32", "float": "float32"}


def _section(values, section: type) -> dict:
    """The fields of ``section`` (a settings dataclass) as ``values`` (a run config section derived from it) has them."""
    return {f.name: getattr(values, f.name) for f in dataclasses.fields(section)}
