"""Under Slurm, one task per node: the rank comes from SLURM_PROCID and the node count from
SLURM_NTASKS, so `srun orchestrator run ...` needs no rank flags (examples/slurm.sbatch).

The first test submits examples/slurm.sbatch to a real Slurm cluster on this machine
(tests/slurm.py: slurmctld and three slurmd); the others set the environment srun gives each
task on real rank processes, for the cases a cluster would refuse to start.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import slurm
from tests.harness import FAST, require, run_flags, status_json

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "slurm.sbatch"


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    require(slurm.missing_prerequisites(), "Slurm tests")
    cluster = slurm.SlurmCluster(tmp_path_factory.mktemp("slurm"), nodes=3)
    try:
        yield cluster.start()
    finally:
        cluster.close()


@pytest.mark.slow
def test_sbatch_of_the_example_runs_three_ranks_without_rank_flags_under_real_slurm(slurm_cluster, tmp_path):
    log_path = tmp_path / "run"
    env = {**slurm_cluster.env, "DATA_PATH": str(tmp_path), "LOG_PATH": str(log_path), "RANK_WEIGHTS": "2,1,1",
           "PYTHON": sys.executable}
    env = {k: v for k, v in env.items() if k not in ("RANK", "NODE_RANK")}
    result = subprocess.run(["sbatch", "--wait", "--nodes=3", f"--chdir={REPO}", f"--output={tmp_path}/job-%j.out", str(EXAMPLE),
                             "--rehearsal", "--max-iterations=2", *FAST], env=env, capture_output=True, text=True, timeout=120)
    output = "".join(p.read_text(errors="replace") for p in tmp_path.glob("job-*.out"))
    assert result.returncode == 0, result.stdout + result.stderr + output[-4000:] + slurm_cluster.logs()
    assert "[rank 2 " in output and "run complete" in output
    status = status_json(log_path)
    assert [it["iteration"] for it in status["iterations"] if it["complete"]] == [1, 2]
    assert len(status["iterations"][0]["tasks_per_rank"]) == 3 and sorted(r["rank"] for r in status["ranks"]) == [0, 1, 2]

pytestmark = pytest.mark.timeout(90)


def slurm_env(procid: int, ntasks: int = 3, nnodes: int | None = None) -> dict:
    """What srun sets for task ``procid`` of a one-task-per-node step (the variables read, and a few beside)."""
    nnodes = ntasks if nnodes is None else nnodes
    return {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": str(procid), "SLURM_NTASKS": str(ntasks),
            "SLURM_NNODES": str(nnodes), "SLURM_NODEID": str(procid % nnodes), "SLURM_LOCALID": "0",
            "SLURM_JOB_NODELIST": f"node[0-{nnodes - 1}]"}


def _without_rank_flags(flags):
    return [f for f in flags if not f.startswith("--num-nodes")]


def test_three_slurm_tasks_with_no_rank_flags_run_two_rehearsal_iterations(cluster):
    assert not {"RANK", "NODE_RANK"} & set(os.environ), "the test needs an environment without a rank"
    flags = _without_rank_flags(run_flags(cluster.log_path, max_iterations=2))
    procs = [cluster.start(r, flags, env=slurm_env(r), with_rank_flag=False) for r in range(3)]
    assert cluster.wait_all(procs, timeout=60) == [0, 0, 0], "\n".join(p.output() for p in procs)
    status = status_json(cluster.log_path)
    assert [it["iteration"] for it in status["iterations"] if it["complete"]] == [1, 2]
    assert [it["tasks_per_rank"] for it in status["iterations"]][0] == [6, 3, 3]  # rehearsal.tasks over --rank-weights 2,1,1
    assert sorted(r["rank"] for r in status["ranks"]) == [0, 1, 2]


@pytest.mark.parametrize("env, message", [
    (slurm_env(1, ntasks=6, nnodes=3), "Slurm runs SLURM_NTASKS=6 tasks on SLURM_NNODES=3 nodes, but every node runs one rank"),
    (slurm_env(3), "rank 3 is out of range"),
    ({**slurm_env(0), "SLURM_NTASKS": "three"}, "SLURM_NTASKS='three'"),
], ids=["two tasks per node", "procid past the tasks", "not a number"])
def test_a_slurm_step_that_does_not_fit_exits_2_before_anything_is_written(cluster, env, message):
    flags = _without_rank_flags(run_flags(cluster.log_path, max_iterations=2))
    proc = cluster.start(0, flags, env=env, with_rank_flag=False)
    assert proc.wait(30) == 2
    assert message in " ".join(proc.output().split())
    assert not cluster.log_path.exists()
