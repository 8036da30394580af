"""The training rendezvous's port is held from the moment the master chooses it: another run
on the node cannot take it before train worker 0 serves the group's store on it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from orchestrator.node.ports import free_port, listening_socket
from orchestrator.train.rendezvous import LISTEN_FD_ENV

JOIN = """
import torch.distributed as dist
from orchestrator.train.rendezvous import Rendezvous, join
import os
join(Rendezvous.from_env(os.environ))
t = __import__("torch").ones(1) * (dist.get_rank() + 1)
dist.all_reduce(t)
print("sum", int(t.item()), flush=True)
dist.barrier()
os._exit(0)  # as train/worker.py ends: a store torn down while its peer tears down aborts the peer
"""


def test_a_held_port_is_skipped_by_every_later_choice():
    first = free_port(29700)
    held = listening_socket(first)
    try:
        assert held.getsockname()[1] == first
        again = listening_socket(first)
        try:
            assert again.getsockname()[1] > first and free_port(first) not in (first, again.getsockname()[1])
        finally:
            again.close()
    finally:
        held.close()


@pytest.mark.timeout(120)
def test_two_trainer_processes_form_their_group_on_the_socket_the_launch_held():
    held = listening_socket(free_port(29800))
    port = held.getsockname()[1]
    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "TRAIN_BACKEND": "gloo",
            "TRAIN_TIMEOUT_S": "60"}
    try:
        # Rank 1 first: it connects to the held socket before rank 0's store serves on it.
        one = subprocess.Popen([sys.executable, "-c", JOIN], env={**base, "RANK": "1"}, stdout=subprocess.PIPE, text=True)
        zero = subprocess.Popen([sys.executable, "-c", JOIN], env={**base, "RANK": "0", LISTEN_FD_ENV: str(held.fileno())},
                                pass_fds=(held.fileno(),), stdout=subprocess.PIPE, text=True)
    finally:
        held.close()
    outs = [p.communicate(timeout=100)[0] for p in (zero, one)]
    assert [p.returncode for p in (zero, one)] == [0, 0], outs
    assert all("sum 3" in out for out in outs), outs
