"""How a node that does not serve a model beside the policy finds the engines of those that
do (workloads/rl/aux_models.py): their address records on the shared filesystem, each engine
asked whether it serves the name its record gives, and the nodes out of the run left out. A
real HTTP server (tests/stub_engine.py's) answers for a serving node; tests/system/test_teacher.py
runs the whole of it across two ranks."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from orchestrator.config import AuxModelConfig
from orchestrator.node import placement
from orchestrator.node.ports import free_port
from orchestrator.protocol import fsio
from orchestrator.protocol.layout import RunLayout
from orchestrator.protocol.waiting import CancelToken
from orchestrator.workloads.rl import aux_models
from orchestrator.workloads.rl.aux_models import AuxModels, ModelUnserved
from tests.stub_engine import _Server

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def engine():
    """An engine serving the name judge-abc on a free port."""
    server = _Server(("127.0.0.1", 0), 0.0, "judge-abc")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_a_node_asks_the_engines_whose_records_name_what_they_serve_of_the_nodes_still_in_the_run(tmp_path, engine, monkeypatch):
    layout = RunLayout(tmp_path)
    placed = placement.resolve(num_nodes=3, gpus_per_node=0, train_mapping="", rollout_mapping="",
                               models={"judge": AuxModelConfig(path="/m", nodes="1-2")})
    config = SimpleNamespace(rollout=SimpleNamespace(engine_start_timeout_s=1.0), models={"judge": None})
    aux = AuxModels(None, config, layout)

    def ctx(out=()):
        return SimpleNamespace(rank=0, cancel=CancelToken(), run=SimpleNamespace(placement=placed, out=frozenset(out)))

    def record(node, port, name):
        layout.engine_dir(node).mkdir(parents=True, exist_ok=True)
        fsio.write_record(layout.engine_address(node, 0, "judge"), {"host": "127.0.0.1", "port": port, "name": name})

    record(1, engine, "judge-abc")
    record(2, free_port(20000), "judge-old")  # left by an engine that died: nothing listens there
    # Node 2's engine never serves (or died, which only the master learns mid-phase): a short
    # grace after node 1's answered, node 1's alone, well before rollout.engine_start_timeout_s.
    monkeypatch.setattr(aux_models, "GRACE_S", 0.5)
    config.rollout.engine_start_timeout_s = 20.0
    began = time.monotonic()
    assert [c.base_url for c in aux.remote(ctx(), "judge")] == [f"http://127.0.0.1:{engine}"]
    assert time.monotonic() - began < 10
    config.rollout.engine_start_timeout_s = 1.0
    # Node 2 out of the run (elastic): node 1's at once.
    assert [c.model() for c in aux.remote(ctx(out={2}), "judge")] == ["judge-abc"]
    # A record whose engine serves another name (a later start took the port) is not used.
    record(1, engine, "judge-before")
    with pytest.raises(ModelUnserved, match=r"rank 0 found no engine of models.judge serving within "
                                            r"rollout.engine_start_timeout_s=1 s on the nodes that serve it \(1\); see .*judge-engine0.log"):
        aux.remote(ctx(out={2}), "judge")
    with pytest.raises(ModelUnserved, match=r"every node that serves models.judge \(1,2\) is out of the run, and rank 0 does "
                                            r"not serve it: name other nodes in models.judge.nodes"):
        aux.remote(ctx(out={1, 2}), "judge")
