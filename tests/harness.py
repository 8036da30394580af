"""Running real ranks as separate processes in tests, with deadlines on every wait."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from orchestrator.phase_table import Phase
from orchestrator.protocol import fsio
from orchestrator.protocol.layout import RunLayout

# Fast protocol settings for tests: a dead rank is detected within 3 s.
FAST = [
    "coordination.heartbeat_interval_s=0.25",
    "coordination.node_timeout_s=3",
    "coordination.join_timeout_s=20",
    "coordination.watch_interval_s=0.1",  # ranks on separate mounts (no same-host wake-ups) see releases soon
    "coordination.fan_in=2",  # barriers fan in through group leaders (automatic only from 64 ranks): every fault test covers it
    "rehearsal.work_s=0.05",
    "rehearsal.tasks=12",
    "rehearsal.eval_tasks=6",
]
NODE_TIMEOUT_S = 3.0


def run_flags(log_path: Path, *, num_nodes: int = 3, weights: str = "2,1,1", rl_phase: str = "both",
              eval_interval: int | None = 2, max_iterations: int | None = 3, extra: list[str] = ()) -> list[str]:
    flags = [
        f"--data-path={log_path.parent}",
        f"--log-path={log_path}",
        f"--rl-phase={rl_phase}",
        f"--num-nodes={num_nodes}",
        f"--rank-weights={weights}",
        "--rehearsal",
    ]
    if eval_interval is not None:
        flags.append(f"--eval-interval={eval_interval}")
    if max_iterations is not None:
        flags.append(f"--max-iterations={max_iterations}")
    return flags + FAST + list(extra)


# The real loop on the demo data, small enough for a CPU: a few tasks and samples, one epoch,
# several batches a rank (prompts in flight in requests of 2), a dead rank seen within 5 s.
RL_SMALL = [
    "rl.train_tasks=8",
    "rl.samples_per_prompt=4",
    "rl.eval_tasks=16",
    "rl.eval_samples=2",
    "rl.epochs=1",
    "rl.micro_batch=4",
    "rollout.max_inflight=32",  # 8 prompts in flight, in requests of 2: a rank's share comes back in several batches
    "rollout.prompts_per_request=2",
    "coordination.heartbeat_interval_s=0.5",
    "coordination.node_timeout_s=5",  # 10 beats; the tests that kill a rank wait this long to see it dead (test_tracking: 5 s too)
    "coordination.join_timeout_s=60",
]


def rl_flags(data: Path, log_path: Path, *, num_nodes: int | None = 3, weights: str | None = "2,1,1", rl_phase: str = "both",
             max_iterations: int | None = None, settings: list[str] = RL_SMALL, extra: list[str] = ()) -> list[str]:
    """Flags of `orchestrator run` or `local` for the real loop on ``data``: ``settings``, then
    ``extra`` (a later key wins). A run that rolls out and updates evaluates every iteration;
    ``num_nodes`` or ``weights`` None leaves the flag out (the CLI's default)."""
    flags = [f"--data-path={data}", f"--log-path={log_path}", f"--rl-phase={rl_phase}"]
    if num_nodes is not None:
        flags.append(f"--num-nodes={num_nodes}")
    if weights is not None:
        flags.append(f"--rank-weights={weights}")
    if rl_phase == "both":
        flags.append("--eval-interval=1")
    if max_iterations is not None:
        flags.append(f"--max-iterations={max_iterations}")
    return flags + list(settings) + list(extra)


def run_local(flags: list[str], timeout: float = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    """`orchestrator local` to its end; past ``timeout`` every process it started is killed
    (its ranks and their engines and trainers too), then the timeout is raised."""
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator", "local", *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def require(missing: list[str] | str | None, what: str) -> None:
    """Skip a test whose prerequisites are missing, but fail on CI (CI=true), which installs
    everything with scripts/setup-dev.sh and must not skip silently."""
    if not missing:
        return
    message = f"{what} need: " + ("; ".join(missing) if isinstance(missing, list) else missing) + " (run scripts/setup-dev.sh as root)"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail("CI=true but " + message, pytrace=False)
    pytest.skip(message)


def rank_flag(rank: int) -> str:
    return "--master" if rank == 0 else f"--worker={rank}"


@dataclass
class RankProc:
    rank: int
    proc: subprocess.Popen
    log: Path

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    @property
    def pid(self) -> int:
        return self.proc.pid


@dataclass
class Cluster:
    """Ranks of one run started as `python -m orchestrator run` processes."""

    tmp: Path
    log_path: Path
    procs: list[RankProc] = field(default_factory=list)
    _runs: int = 0

    @property
    def layout(self) -> RunLayout:
        return RunLayout(self.log_path)

    def start(self, rank: int, flags: list[str], env: dict | None = None, cwd: Path | None = None, *,
              with_rank_flag: bool = True) -> RankProc:
        """Rank ``rank`` with ``--master``/``--worker R`` added, unless ``with_rank_flag`` is
        false (the rank then comes from ``env``)."""
        self._runs += 1
        log = self.tmp / f"rank{rank}.run{self._runs}.log"
        full_env = {k: v for k, v in os.environ.items() if k != "ORCHESTRATOR_FAULT"}
        # The ranks share this small machine, as under `orchestrator local`: one thread each,
        # or their trainers' threads outnumber the cores and every collective waits on one.
        full_env.setdefault("OMP_NUM_THREADS", "1")
        full_env.update({"PYTHONUNBUFFERED": "1", **(env or {})})
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "orchestrator", "run", *flags, *([rank_flag(rank)] if with_rank_flag else [])],
                stdout=out, stderr=subprocess.STDOUT, env=full_env, cwd=cwd, start_new_session=True,
            )
        rp = RankProc(rank, proc, log)
        self.procs.append(rp)
        return rp

    def start_all(self, flags: list[str], n: int = 3, env_for: dict[int, dict] | None = None) -> list[RankProc]:
        return [self.start(r, flags, (env_for or {}).get(r)) for r in range(n)]

    def wait_all(self, procs: list[RankProc], timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        return [p.wait(max(0.1, deadline - time.monotonic())) for p in procs]

    def kill_all(self) -> None:
        for rp in self.procs:
            kill_tree(rp.pid)

    def end(self) -> None:
        """Every rank killed and waited for (before the mounts it runs on are torn down)."""
        self.kill_all()
        for rp in self.procs:
            try:
                rp.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


def kill_tree(pid: int) -> None:
    try:
        parent = psutil.Process(pid)
        kids = parent.children(recursive=True)
    except psutil.NoSuchProcess:
        kids = []
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for k in kids:
        try:
            k.kill()
        except psutil.NoSuchProcess:
            pass


def free_port() -> int:
    """A TCP port of 127.0.0.1 free a moment ago, for a process that cannot take port 0 (a
    gloo rendezvous every rank must know in advance) or for a port where nothing listens."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_worker_env(world: int, rank: int, port: int, timeout_s: float) -> dict[str, str]:
    """The environment of ``orchestrator.train.worker`` rank ``rank`` of ``world`` started by a
    test without a rank: a gloo group on 127.0.0.1:``port``, one thread (several workers share
    a small machine), the checkout importable."""
    return {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world), "RANK": str(rank),
            "TRAIN_BACKEND": "gloo", "TRAIN_TIMEOUT_S": f"{timeout_s:g}"}


def descendants(pid: int) -> list[int]:
    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def start_ranks(flags: list[str], n: int, env_for: dict[int, dict] | None = None) -> list[subprocess.Popen]:
    """``orchestrator run`` for ranks 0..n-1, output discarded (tests that only need exit
    codes); ``env_for``: extra environment of some ranks."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return [subprocess.Popen([sys.executable, "-m", "orchestrator", "run", *flags, rank_flag(r)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**env, **(env_for or {}).get(r, {})},
                             start_new_session=True)
            for r in range(n)]


def exit_codes(procs: list[subprocess.Popen], timeout: float = 600) -> list[int]:
    """The ranks' exit codes, each waited for up to ``timeout``; every process tree killed after."""
    try:
        return [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            kill_tree(p.pid)


def hold_after_first_batch(rank: int, iteration: int = 1) -> dict[int, dict]:
    """``env_for`` that holds ``rank`` once its first batch of rollout records in
    ``iteration`` is durable (part-way through a share of at least two batches): wait with
    :func:`wait_held_mid_rollout`."""
    return {rank: {"ORCHESTRATOR_FAULT": f"hold-after-batch@{iteration}:{int(Phase.ROLLOUT)}"}}


def held_mid_rollout(layout: RunLayout, rank: int, iteration: int | None = None) -> bool:
    """Whether ``rank`` is held part-way through its rollout (of ``iteration``, if given)."""
    hb = heartbeat(layout, rank)
    p = (hb and hb.get("state") == "held" and hb.get("phase") == Phase.ROLLOUT.label
         and iteration in (None, hb.get("iteration")) and hb.get("progress"))
    return bool(p) and 0 < p["done"] < p["total"]


def wait_held_mid_rollout(layout: RunLayout, rank: int, timeout: float = 120) -> None:
    wait_for(lambda: held_mid_rollout(layout, rank), timeout, f"rank {rank} to be held part-way through its rollout")


def wait_mid_rollout(layout: RunLayout, rank: int, timeout: float = 120) -> None:
    """Until ``rank`` has rolled out some but not all of its tasks."""
    def mid_rollout():
        hb = heartbeat(layout, rank)
        p = hb and hb.get("phase") == Phase.ROLLOUT.label and hb.get("progress")
        return p and 0 < p["done"] < p["total"]

    wait_for(mid_rollout, timeout, f"rank {rank} to be part-way through its rollout")


def trainer_in_update(log_path: Path, worker: int, iteration: int) -> int | None:
    """The pid of train worker ``worker`` once its log says it began the update of ``iteration``."""
    import re

    for log in log_path.glob(f"attempts/*/train/trainer-w{worker:05d}.log"):
        found = re.search(rf"pid (\d+): update of iteration {iteration}\b", log.read_text(errors="replace"))
        if found:
            return int(found[1])
    return None


def kill_trainer_mid_update(procs: list, log_path: Path, *, worker: int, rank: int, iteration: int, codes: list[int],
                            timeout: float) -> int:
    """SIGKILL train worker ``worker`` (on ``rank``) once it is in the update of ``iteration``;
    check the ranks' exit ``codes`` and that status names the killed trainer as the failure of
    that rank, phase and iteration. Returns the killed pid. ``procs``: the ranks' Popens, all
    killed before returning."""
    try:
        def in_update():
            assert all(p.poll() is None for p in procs), f"a rank exited before the kill: {[p.returncode for p in procs]}"
            return trainer_in_update(log_path, worker, iteration)

        pid = wait_for(in_update, timeout, f"worker {worker}'s update of iteration {iteration}")
        os.kill(pid, signal.SIGKILL)
        got = [p.wait(timeout=NODE_TIMEOUT_S + 90) for p in procs]
        assert got == codes, got
    finally:
        for p in procs:
            kill_tree(p.pid)
    failure = status_json(log_path)["failure"]
    assert failure["rank"] == rank and failure["iteration"] == iteration and failure["phase"] == "10:train", failure
    assert f"train worker {worker} of rank {rank} (pid {pid}) exited with code -9" in failure["error"], failure
    assert not RunLayout(log_path).checkpoint(iteration).exists()
    return pid


def wait_for(predicate, timeout: float, what: str, interval: float = 0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def current_attempt(layout: RunLayout) -> str | None:
    body = fsio.read_record(layout.lease)
    return body["attempt"] if body else None


def heartbeat(layout: RunLayout, rank: int) -> dict | None:
    attempt = current_attempt(layout)
    return fsio.read_record(layout.attempt(attempt).heartbeat(rank)) if attempt else None


def wait_state(layout: RunLayout, rank: int, state: str, timeout: float = 30.0) -> dict:
    return wait_for(lambda: (lambda hb: hb if hb and hb.get("state") == state else None)(heartbeat(layout, rank)),
                    timeout, f"rank {rank} to report state {state!r}")


def status_json(log_path: Path) -> dict:
    out = subprocess.run([sys.executable, "-m", "orchestrator", "status", f"--log-path={log_path}", "--json"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def aggregate_records(layout: RunLayout, iteration: int, split: str = "train") -> list[dict]:
    return [json.loads(line) for line in layout.iteration(iteration).aggregate(split).read_text().splitlines()]


def aggregate_task_ids(layout: RunLayout, iteration: int, split: str = "train") -> list[str]:
    return [r["task_id"] for r in aggregate_records(layout, iteration, split)]


def assert_each_task_once(layout: RunLayout, iterations: int, *, tasks: int, eval_tasks: int = 0) -> None:
    """Iterations 1 to ``iterations`` of a rehearsal each aggregated every one of its ``tasks``
    train tasks, and its ``eval_tasks`` eval tasks (every iteration evaluated), exactly once: by
    id, so that a task lost and another counted twice cannot pass as the right count."""
    for i in range(1, iterations + 1):
        for split, n in (("train", tasks), ("eval", eval_tasks)):
            if n:
                ids = aggregate_task_ids(layout, i, split)
                assert sorted(ids) == [f"{split}-{i:06d}-{k:06d}" for k in range(n)], f"iteration {i} {split}: a task missing or twice"


def rebuilt_sum(checkpoint: Path, scratch: Path, dtype=None) -> str:
    """The sum of the one file a node rebuilds ``checkpoint``'s weights into (publish.delta:
    checkpoints/node_copy.py), from its whole weights (one file or shards; ``master/`` when
    ``dtype`` is given, cast to it), which the engine's log names when it loads them."""
    from orchestrator.checkpoints import sharded, sums

    tensors = sharded.read_all(checkpoint / "master" if dtype is not None else checkpoint)
    tensors = {n: t.to(dtype) for n, t in tensors.items()} if dtype is not None else tensors
    scratch.mkdir(parents=True, exist_ok=True)
    return sums.write_safetensors(scratch / f"rebuilt-{checkpoint.name}.safetensors", tensors, {"format": "pt"}, durable=False).digest


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_addition_aggregate(path: Path, tasks: int, texts, *, tokenizer=None, cut: tuple[int, int] | None = None,
                             **sample_fields) -> None:
    """An aggregate for the trainer alone: ``tasks`` addition tasks (task k: 3k+1 plus 7 - k%5),
    each with a sample for every text ``texts(k, a + b)`` gives, reward 1 for the right sum.
    ``tokenizer``: the prompt's and each sample's token ids too, as an engine returns them (the
    sample's ending with EOS); ``cut``: (task, sample) ended by max_tokens (finish_reason
    length); ``sample_fields``: more keys of every sample."""
    with open(path, "w") as f:
        for k in range(tasks):
            a, b = 3 * k + 1, 7 - k % 5
            right = str(a + b)
            samples = []
            for t in texts(k, a + b):
                sample = {"text": t}
                if tokenizer is not None:
                    sample["token_ids"] = tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                sample.update({"reward": float(t == right), "finish_reason": "stop", **sample_fields})
                samples.append(sample)
            if cut is not None and cut[0] == k:
                samples[cut[1]]["finish_reason"] = "length"
            record = {"task_id": f"t{k}", "prompt": f"{a}+{b}="}
            if tokenizer is not None:
                record["prompt_token_ids"] = tokenizer(f"{a}+{b}=")["input_ids"]
            f.write(json.dumps({**record, "answer": right, "samples": samples}) + "\n")


def assert_default_three_iteration_run(log_path: Path) -> None:
    """What `run_flags`' defaults must produce: 3 ranks at 2:1:1, 3 iterations, eval on 1 and
    3, every one of the 12 tasks of each iteration aggregated exactly once, no failure."""
    status = status_json(log_path)
    assert status["num_nodes"] == 3
    assert status["rl_phase"] == "both"
    assert status["failure"] is None
    assert [r["rank"] for r in status["ranks"]] == [0, 1, 2]
    assert all(not r["alive"] and r["state"] == "done" for r in status["ranks"])
    its = status["iterations"]
    assert [it["iteration"] for it in its] == [1, 2, 3]
    assert [it["evaluated"] for it in its] == [True, False, True]
    assert all(it["tasks_per_rank"] == [6, 3, 3] for it in its)  # 12 tasks at 2:1:1
    assert all(it["trajectories"] == 12 for it in its)
    assert all("accuracy" in it["metrics"] for it in its if it["evaluated"])
    for i in (1, 2, 3):
        ids = aggregate_task_ids(RunLayout(log_path), i)
        assert sorted(ids) == sorted(set(ids)) and len(ids) == 12


def kill_rank_0_mid_rollout_then_rerun(flags: list[str], env: dict, *, tasks: int) -> None:
    """Two ranks of ``flags`` (one iteration, ``tasks`` train tasks, no work stealing): rank 0
    held once its first batch is durable, killed (SIGKILL), rank 1 then exits 3 seeing it
    dead; the same command again on both finishes. Asserts that every task was aggregated
    once and that rank 0's durable records stayed as they were."""
    log_path = next(Path(f.split("=", 1)[1]) for f in flags if f.startswith("--log-path="))
    procs = start_ranks(flags, 2, env_for={r: {**env, **e} for r, e in hold_after_first_batch(0).items()} | {1: env})
    layout = RunLayout(log_path)
    try:
        wait_held_mid_rollout(layout, 0)
        os.kill(procs[0].pid, signal.SIGKILL)
        procs[0].wait(timeout=10)
        assert procs[1].wait(timeout=NODE_TIMEOUT_S + 60) == 3
        partial = layout.iteration(1).shard("train", 0).read_text().splitlines()
        assert 0 < len(partial) < tasks // 2
    finally:
        for p in procs:
            kill_tree(p.pid)
    result = run_local([*flags, "--num-nodes=2"], env=env)
    assert result.returncode == 0, result.stdout[-6000:]
    records = aggregate_records(layout, 1)
    assert len(records) == tasks and len({r["task_id"] for r in records}) == tasks
    kept = [json.loads(line) for line in layout.iteration(1).shard("train", 0).read_text().splitlines()]
    assert kept[: len(partial)] == [json.loads(line) for line in partial], "what was durable stays as it was"


def engine_pid(rank_pid: int, served: str = "policy") -> int:
    """The pid of the embedded engine among the rank's descendants that serves ``served``: the
    policy, or a model beside it (models.<name>: its name)."""
    import psutil

    for p in psutil.Process(rank_pid).children(recursive=True):
        line = " ".join(p.cmdline())
        if "orchestrator.engine.server" in line and f"--served-model-name {served}-" in line:
            return p.pid
    raise AssertionError(f"rank pid {rank_pid} has no engine serving {served}")
