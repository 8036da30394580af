"""The RL workload: what each phase asks of the compute, done for real.

Rollout and eval send the rank's prompts to its node's engine over the OpenAI-compatible
HTTP API (the embedded engine, or vLLM) and score each completion with the configured
reward. Training runs ``orchestrator.train.worker`` on every rank as one torch.distributed
job. Records are JSON (see docs/demo.md and the trainer's contract in train/worker.py).
"""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

from orchestrator import fsio, rewards
from orchestrator.config import RunConfig
from orchestrator.context import PhaseContext
from orchestrator.demo.tasks import read_tasks
from orchestrator.engine.client import EngineClient
from orchestrator.layout import RunLayout
from orchestrator.procs import Children
from orchestrator.rl import rendezvous
from orchestrator.rl.engine_process import EngineProcess

log = logging.getLogger(__name__)

PROMPTS_PER_REQUEST = 16


class TrainerFailed(RuntimeError):
    pass


class RLWorkload:
    def __init__(self, config: RunConfig, children: Children):
        self.config = config
        self.rl = config.rl
        self.children = children
        self.reward = rewards.load(self.rl.reward)
        self.tasks = {split: read_tasks(config.tasks_path / f"{name}.jsonl") for split, name in (("train", "train"), ("eval", "test"))}
        self.by_id = {t["id"]: t for tasks in self.tasks.values() for t in tasks}
        self.layout = RunLayout(config.log_path)
        self.engine = EngineProcess(children, first_port=self.rl.engine_port,
                                    log_dir=self.layout.engine_dir(config.rank),
                                    start_timeout_s=self.rl.engine_start_timeout_s)
        self.client: EngineClient | None = None

    # -- tasks -------------------------------------------------------------------------------

    def tasks_per_iteration(self, split: str) -> int:
        wanted = self.rl.train_tasks if split == "train" else self.rl.eval_tasks
        return min(wanted, len(self.tasks[split]))

    def task_ids(self, split: str, iteration: int) -> list[str]:
        ids = [t["id"] for t in self.tasks[split]]
        n = self.tasks_per_iteration(split)
        if split == "eval":
            return ids[:n]  # the same eval set every time, so the curve compares like with like
        return random.Random(f"{self.config.seed}:train:{iteration}").sample(ids, n)

    # -- engine ------------------------------------------------------------------------------

    def checkpoint(self) -> Path:
        """What the policy is now: the published checkpoint, else the base model."""
        current = fsio.read_record(self.layout.current_checkpoint)
        return self.layout.root / current["path"] if current else self.config.model_path

    def engine_start(self, ctx: PhaseContext) -> None:
        if self.config.debug_mode:
            self.client = EngineClient(self.rl.engine_url, timeout_s=600)
            return
        self.client = self.engine.ensure(self.checkpoint(), ctx.cancel)

    def engine_stop(self, ctx: PhaseContext) -> None:
        if not self.config.debug_mode:
            self.engine.stop()
            self.client = None

    def close(self) -> None:
        self.engine.stop()

    # -- rollout and eval ----------------------------------------------------------------------

    def rollout(self, ctx: PhaseContext, split: str, task_ids: list[str]) -> Iterator[list[dict]]:
        if not task_ids:
            return
        if self.client is None:
            self.engine_start(ctx)
        train = split == "train"
        n = self.rl.samples_per_prompt if train else self.rl.eval_samples
        temperature = self.rl.temperature if train else self.rl.eval_temperature
        policy = str(self.checkpoint())
        for start in range(0, len(task_ids), PROMPTS_PER_REQUEST):
            ctx.cancel.check()
            batch = [self.by_id[t] for t in task_ids[start : start + PROMPTS_PER_REQUEST]]
            seed = random.Random(f"{self.config.seed}:{split}:{ctx.iteration}:{batch[0]['id']}").randrange(2**31)
            began = time.monotonic()
            groups = self.client.complete([t["prompt"] for t in batch], n=n, temperature=temperature, top_p=self.rl.top_p,
                                          max_tokens=self.rl.max_tokens, seed=seed, logprobs=0)
            seconds = (time.monotonic() - began) / len(batch)
            yield [self._record(ctx, split, task, group, policy, seconds) for task, group in zip(batch, groups)]

    def _record(self, ctx: PhaseContext, split: str, task: dict, group, policy: str, seconds: float) -> dict:
        return {
            "task_id": task["id"],
            "split": split,
            "iteration": ctx.iteration,
            "rank": ctx.rank,
            "attempt": ctx.attempt_id,
            "policy": policy,
            "prompt": task["prompt"],
            "answer": task["answer"],
            "seconds": seconds,
            "samples": [
                {
                    "text": c.text,
                    "reward": float(self.reward(task, c.text)),
                    "finish_reason": c.finish_reason,
                    "logprobs": c.token_logprobs,
                }
                for c in group
            ],
        }

    def metrics(self, ctx: PhaseContext, eval_records: Path) -> dict:
        rewards_all, best, lengths, tokens, seconds = [], [], [], 0, 0.0
        with open(eval_records, "rb") as f:
            for line in f:
                rec = json.loads(line)
                rs = [s["reward"] for s in rec["samples"]]
                rewards_all += rs
                best.append(max(rs))
                for s in rec["samples"]:
                    n_tok = len(s["logprobs"]) if s.get("logprobs") is not None else len(s["text"])
                    lengths.append(n_tok)
                    tokens += n_tok
                seconds += rec.get("seconds", 0.0)
        if not rewards_all:
            return {"accuracy": 0.0, "mean_reward": 0.0, "pass_at_k": 0.0, "response_length": 0.0, "tokens_per_s": 0.0}
        mean = sum(rewards_all) / len(rewards_all)
        return {
            "accuracy": sum(1.0 for r in rewards_all if r >= 1.0) / len(rewards_all),
            "mean_reward": mean,
            "pass_at_k": sum(1.0 for b in best if b >= 1.0) / len(best),
            "k": self.rl.eval_samples,
            "response_length": sum(lengths) / len(lengths),
            "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
            "tasks": len(best),
        }

    # -- training ------------------------------------------------------------------------------

    def train(self, ctx: PhaseContext, train_config: dict, checkpoint_dir: Path | None) -> None:
        rdv = rendezvous.publish_or_read(ctx)
        attempt = ctx.coordinator.attempt
        config_path, log_path = attempt.trainer_config(ctx.rank), attempt.trainer_log(ctx.rank)
        config_path.parent.mkdir(parents=True, exist_ok=True)
        config = {
            "iteration": ctx.iteration,
            "data": str(self.config.log_path / train_config["data"]),
            "init_checkpoint": str(self.checkpoint()),
            "reference_checkpoint": str(self.config.model_path) if self.rl.kl_coef > 0 else None,
            "output": str(checkpoint_dir if checkpoint_dir is not None else attempt.trainer_scratch(ctx.rank)),
            "seed": self.config.seed + ctx.iteration,
            "lr": self.rl.lr,
            "epochs": self.rl.epochs,
            "micro_batch": self.rl.micro_batch,
            "clip_eps": self.rl.clip_eps,
            "kl_coef": self.rl.kl_coef,
            "max_grad_norm": self.rl.max_grad_norm,
        }
        config_path.write_text(json.dumps(config, indent=2))
        env = {
            **os.environ,
            "MASTER_ADDR": rdv["addr"],
            "MASTER_PORT": str(rdv["port"]),
            "WORLD_SIZE": str(self.config.num_nodes),
            "RANK": str(ctx.rank),
            "TRAIN_TIMEOUT_S": str(self.rl.train_timeout_s),
        }
        log.info("training iteration %d: rank %d of %d, rendezvous %s:%d", ctx.iteration, ctx.rank, self.config.num_nodes, rdv["addr"], rdv["port"])
        with open(log_path, "ab") as out:
            proc = self.children.start([sys.executable, "-m", "orchestrator.train.worker", "--train-config", str(config_path)],
                                       env=env, stdout=out, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            ctx.cancel.sleep(0.2)
        self.children.stop(proc)
        if proc.returncode != 0:
            tail = log_path.read_text(errors="replace")[-3000:]
            raise TrainerFailed(f"the trainer of rank {ctx.rank} exited with code {proc.returncode}; {log_path} ends:\n{tail}")

