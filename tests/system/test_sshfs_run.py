"""Three ranks, each on its own sshfs mount of one directory, complete a run (issue, done-when 9).

Two or more sshfs mounts are independent client caches with default options (20 s
attribute/entry/listing caches), like nodes on NFS: a rank sees its peers' files only by
opening known names, never by trusting a cached listing.
"""

import os

import pytest

from tests.harness import Cluster, assert_default_three_iteration_run, run_flags
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
    c.kill_all()
    for p in c.procs:
        try:
            p.wait(timeout=10)
        except Exception:
            pass


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
