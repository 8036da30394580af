"""Where a rank and the node count come from: flags, then RANK, NODE_RANK, then Slurm's task."""

import pytest

from orchestrator.cli.rank import resolve_num_nodes, resolve_rank
from orchestrator.errors import ConfigError

SLURM = {"SLURM_PROCID": "2", "SLURM_NTASKS": "3", "SLURM_NNODES": "3"}


@pytest.mark.parametrize("master, worker, environ, expected", [
    (True, None, SLURM, 0),
    (False, 1, SLURM, 1),
    (False, None, {**SLURM, "RANK": "1"}, 1),
    (False, None, {**SLURM, "NODE_RANK": "0"}, 0),
    (False, None, SLURM, 2),
    (False, None, {}, 0),  # one node: rank 0
])
def test_flags_then_rank_then_node_rank_then_slurm_procid(master, worker, environ, expected):
    assert resolve_rank(master, worker, resolve_num_nodes(None, environ), environ) == expected


def test_the_node_count_is_the_flag_else_slurms_tasks_else_one():
    assert resolve_num_nodes(2, SLURM) == 2
    assert resolve_num_nodes(None, SLURM) == 3
    assert resolve_num_nodes(None, {}) == 1


def test_several_slurm_tasks_on_a_node_are_refused_unless_flags_give_rank_and_count():
    with pytest.raises(ConfigError, match="srun --ntasks-per-node=1"):
        resolve_num_nodes(None, {**SLURM, "SLURM_NTASKS": "6"})
    assert resolve_rank(False, 1, 3, {**SLURM, "SLURM_NTASKS": "6"}) == 1, "explicit flags need no Slurm check"
