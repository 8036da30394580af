"""Three ranks, each on its own sshfs mount of one directory, complete a run (issue, done-when 9).

Two or more sshfs mounts are independent client caches with default options (20 s
attribute/entry/listing caches), like nodes on NFS: a rank sees its peers' files only by
opening known names, never by trusting a cached listing.
"""

import json
import os

import pytest

from tests.harness import Cluster, assert_default_three_iteration_run, assert_each_task_once, run_flags
from tests.sshfs import is_mounted

pytestmark = [pytest.mark.sshfs, pytest.mark.timeout(180)]


@pytest.fixture
def sshfs_cluster(sshfs_mounts, tmp_path):
    """Three mounts and a Cluster; the ranks are killed before the mounts are torn down."""
    export, mounts = sshfs_mounts(3)
    logs = tmp_path / "rank-logs"
    logs.mkdir()
    c = Cluster(tmp=logs, log_path=export / "run")
    yield c, export, mounts
    c.end()


def test_mounts_are_independent_clients_with_default_caching(sshfs_mounts):
    """The premise: mount B's cached listing misses a file mount A just published, while
    opening it by name through B is fresh (sshfs defaults; with cache=no both are fresh)."""
    _, (a, b) = sshfs_mounts(2)
    assert os.listdir(b) == []  # B caches the (empty) listing
    (a / ".x.tmp").write_text("hello")
    os.replace(a / ".x.tmp", a / "x.json")
    assert "x.json" not in os.listdir(b), "listing through B is fresh: are the mounts using cache=no?"
    assert (b / "x.json").read_text() == "hello"


def test_three_ranks_on_separate_sshfs_mounts_complete_the_run(sshfs_cluster):
    cluster, export, mounts = sshfs_cluster
    assert len({m.resolve() for m in mounts}) == 3 and all(is_mounted(m) for m in mounts)

    procs = [cluster.start(rank, run_flags(mounts[rank] / "run")) for rank in range(3)]
    codes = cluster.wait_all(procs, timeout=150)
    assert codes == [0, 0, 0], "\n".join(f"--- rank {p.rank} ---\n{p.output()}" for p in procs)

    # Read the outcome through the export directory itself: no sshfs cache in the way.
    run = export / "run"
    assert_default_three_iteration_run(run)


@pytest.mark.slow
def test_ranks_on_separate_sshfs_mounts_steal_a_slow_ranks_chunks_once_each(sshfs_cluster):
    """Work stealing across client caches: every chunk is claimed once (O_EXCL decided by the
    server; sshfs reports a lost race as EPERM), rank 2's chunks go to the fast ranks, and
    every task is in the aggregate once."""
    from orchestrator.data import claims
    from orchestrator.protocol import fsio
    from orchestrator.protocol.layout import RunLayout

    cluster, export, mounts = sshfs_cluster
    extra = ["rehearsal.tasks=36", "rehearsal.eval_tasks=9", "rehearsal.task_s=0.03", "rehearsal.slow_ranks=2:4"]
    procs = [cluster.start(rank, run_flags(mounts[rank] / "run", weights="1,1,1", eval_interval=1, max_iterations=2, extra=extra))
             for rank in range(3)]
    codes = cluster.wait_all(procs, timeout=150)
    assert codes == [0, 0, 0], "\n".join(f"--- rank {p.rank} ---\n{p.output()}" for p in procs)

    layout = RunLayout(export / "run")
    assert_each_task_once(layout, 2, tasks=36, eval_tasks=9)
    for i in (1, 2):
        it = layout.iteration(i)
        plan = fsio.read_record(it.plan)
        for split in ("train", "eval"):
            names = sorted(q.name for q in it.claims(split).glob("c*.json"))
            assert names == [f"c{k:05d}.0.json" for k in range(len(claims.chunks_of(plan[split])))]
        summary = fsio.read_record(it.summary)
        assert summary["tasks_taken_per_rank"][2] > 0 and sum(summary["tasks_done_per_rank"]) == 36, summary


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fsdp_workers_on_separate_sshfs_mounts_write_one_sealed_sharded_checkpoint(sshfs_cluster, demo_data):
    """train.strategy=fsdp on two ranks, one train worker each, each rank on its own sshfs
    client: each worker writes its shard through its own mount into the staging directory the
    other node made, the index comes last, and the sealing node (rank 0) lists and hashes a
    shard another client wrote. The same checkpoint read back through the export verifies,
    and the next iteration trains from it."""
    from orchestrator import checkpoints
    from orchestrator.protocol import fsio
    from orchestrator.protocol.layout import RunLayout

    cluster, export, mounts = sshfs_cluster
    flags = [f"--data-path={demo_data}", "--rl-phase=both", "--eval-interval=2", "--max-iterations=2", "--num-nodes=2",
             "--rank-weights=1,1", "train.strategy=fsdp", "rl.train_tasks=8", "rl.samples_per_prompt=4", "rl.eval_tasks=8",
             "rl.eval_samples=2", "rl.epochs=1", "rl.micro_batch=4", "coordination.heartbeat_interval_s=0.5",
             "coordination.node_timeout_s=30", "coordination.join_timeout_s=60"]  # 30 s: past sshfs's 20 s caches
    procs = [cluster.start(rank, [f"--log-path={mounts[rank] / 'run'}", *flags]) for rank in range(2)]
    codes = cluster.wait_all(procs, timeout=240)
    assert codes == [0, 0], "\n".join(f"--- rank {p.rank} ---\n{p.output()[-4000:]}" for p in procs)

    layout = RunLayout(export / "run")
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    for i in (1, 2):
        checkpoint = layout.checkpoint(i)
        checkpoints.verify(checkpoint)  # every file the manifest lists, hashed again here
        weights = "" if (checkpoint / "model.safetensors.index.json").is_file() else "master/"  # a delta: the fp32 master's shards
        index = json.loads((checkpoint / weights / "model.safetensors.index.json").read_text())
        assert sorted(set(index["weight_map"].values())) == shards
        listed = set(fsio.read_record(checkpoint / checkpoints.MANIFEST)["files"])
        assert {f"{weights}{s}" for s in shards} <= listed
    # the training state, at the last iteration (checkpoint.state_every)
    assert {"optimizer/adamw-00001-of-00002.safetensors", "optimizer/adamw-00002-of-00002.safetensors"} <= listed
    stats = json.loads((layout.checkpoint(2) / "train_stats.json").read_text())
    assert (stats["strategy"], stats["world_size"], stats["policy_from"]) == ("fsdp", 2, "memory")
