"""The node's trainers kept alive across iterations (train/launch.py): a later iteration's
update goes to the running processes as one request line each, and the log says so in a
whole sentence."""

from __future__ import annotations

import subprocess
import sys

import pytest

from orchestrator.node.procs import Children
from orchestrator.protocol.waiting import CancelToken
from orchestrator.train import launch

pytestmark = pytest.mark.timeout(30)

# A trainer as `orchestrator.train.worker --serve` answers: one request line in, its done record out.
SERVING = """
import json, os, sys
from pathlib import Path
from orchestrator.protocol import fsio
for line in sys.stdin:
    request = json.loads(line)
    iteration = json.load(open(request["config"]))["iteration"]
    fsio.write_record(Path(request["done"]), {"iteration": iteration, "pid": os.getpid()})
"""


def _step(tmp_path, iteration: int) -> launch.Step:
    files = launch.WorkerFiles(request=tmp_path / f"it{iteration}" / "request.json", done=tmp_path / f"it{iteration}" / "done.json",
                               error=tmp_path / "error.json", log=tmp_path / "trainer.log")
    worker = launch.Worker(rank=0, gpu=None, request={"iteration": iteration}, files=files)
    return launch.Step(iteration=iteration, node=0, workers=(worker,), group=((0, 0),), rendezvous=lambda: {"addr": "127.0.0.1", "port": 0},
                       cancel=CancelToken(), timeout_s=10, peer_verdict_s=1, training=lambda: True)


def test_a_later_iteration_trains_on_the_kept_trainers_and_says_so_in_a_whole_sentence(tmp_path, caplog):
    children = Children()
    trainers = launch.NodeTrainers(children, keep_alive=True)
    first = _step(tmp_path, 1)
    with open(first.workers[0].files.log, "ab") as out:  # where a failed trainer's story is read from
        proc = children.start([sys.executable, "-c", SERVING], stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT)
    trainers.running, trainers.group = [launch._Process(first.workers[0], proc)], first.group  # as iteration 1 left them
    try:
        with caplog.at_level("INFO", logger=launch.__name__):
            done = trainers.update(_step(tmp_path, 2))
        assert done == {0: {"iteration": 2, "pid": proc.pid}}
        assert [r.getMessage() for r in caplog.records] == [
            f"iteration 2 trains on the trainer processes kept from the last training (pids {proc.pid}, train.keep_alive): "
            f"each takes this iteration's request"]
    finally:
        trainers.stop()
        children.stop_all()
