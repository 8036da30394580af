"""GPU placement arithmetic (issue 4): device mappings, engines per node, node-local GPU ids
and ports, and `orchestrator plan`, including property tests of the invariants."""

import json
import re
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.protocol import records
from orchestrator.errors import ConfigError
from orchestrator.node import gpus, placement
from tests.fake_gpus import fake_nvidia_smi, gpu_env


def resolve(nodes, gpn, train, rollout, gpe=1, port=8000):
    return placement.resolve(num_nodes=nodes, gpus_per_node=gpn, train_mapping=train, rollout_mapping=rollout,
                             gpus_per_engine=gpe, engine_port=port)


def plan(*args):
    return subprocess.run([sys.executable, "-m", "orchestrator", "plan", *args], capture_output=True, text=True, timeout=60)


# -- parsing ------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, gpus", [
    ("0-3", (0, 1, 2, 3)),
    ("0,1,2,3", (0, 1, 2, 3)),
    (" 0-1, 4 ,6-7 ", (0, 1, 4, 6, 7)),
    ("list(range(0,16))", tuple(range(16))),
    ("range(4, 8)", (4, 5, 6, 7)),
    ("", ()),
    ("5", (5,)),
])
def test_mappings_parse_without_eval(text, gpus):
    assert placement.parse_mapping(text) == gpus


@pytest.mark.parametrize("text, says", [
    ("0-3,2", "lists GPU 2 twice"),
    ("3-1", "runs backwards"),
    ("0;1", "not a GPU rank"),
    ("__import__('os')", "not a GPU rank"),
    ("-1", "not a GPU rank"),
    ("range(4,4)", "is empty"),
])
def test_bad_mappings_are_refused_by_name(text, says):
    with pytest.raises(ConfigError, match=says):
        placement.parse_mapping(text, "train.device_mapping")


# -- the done-when examples ---------------------------------------------------------------------

def test_two_nodes_of_four_colocated_two_gpus_per_engine():
    p = resolve(2, 4, "0-7", "0-7", gpe=2)
    assert p.colocated
    assert [(e.engine, e.node, e.gpus, e.port) for e in p.engines] == [
        (0, 0, (0, 1), 8000), (1, 0, (2, 3), 8001), (2, 1, (0, 1), 8000), (3, 1, (2, 3), 8001)]
    assert [(w.rank, w.node, w.gpu) for w in p.train_workers] == [(r, r // 4, r % 4) for r in range(8)]


def test_two_nodes_of_eight_put_four_engines_on_each():
    p = resolve(2, 8, "0-15", "0-15", gpe=2)
    assert [len(p.engines_on(n)) for n in (0, 1)] == [4, 4]
    assert [e.gpus for e in p.engines_on(1)] == [(0, 1), (2, 3), (4, 5), (6, 7)]


def test_the_roll_example():
    """ROLL's resource doc: train 0-15, rollout 0-11 with 2 GPUs per engine, 8 GPUs per node."""
    p = resolve(2, 8, "list(range(0,16))", "list(range(0,12))", gpe=2)
    assert len(p.train_workers) == 16
    assert [(w.node, w.gpu) for w in p.train_workers[8:]] == [(1, g) for g in range(8)]
    assert len(p.engines) == 6
    assert [(e.node, e.gpus) for e in p.engines] == [(0, (0, 1)), (0, (2, 3)), (0, (4, 5)), (0, (6, 7)), (1, (0, 1)), (1, (2, 3))]
    assert p.colocated


def test_disaggregated_layout_has_disjoint_gpus():
    p = resolve(1, 8, "0-3", "4-7")
    assert not p.colocated
    train = {(w.node, w.gpu) for w in p.train_workers}
    rollout = {(e.node, g) for e in p.engines for g in e.gpus}
    assert train == {(0, g) for g in range(4)} and rollout == {(0, g) for g in range(4, 8)}
    assert not train & rollout


def test_a_mapping_that_does_not_divide_names_the_numbers():
    with pytest.raises(ConfigError, match=r"rollout.device_mapping has 7 GPUs.*gpus_per_engine=2 does not divide.*3 engines would use 6 and 1"):
        resolve(2, 4, "0-7", "0-6", gpe=2)


def test_an_engine_straddling_two_nodes_names_them():
    with pytest.raises(ConfigError, match=r"engine 1 would straddle nodes 0 and 1: its GPUs 2,3 \(rollout.gpus_per_engine=2, 2 node\(s\) x 3 GPUs per node\)"):
        resolve(2, 3, "0-5", "0-5", gpe=2)


def test_a_mapping_beyond_the_cluster_names_the_counts():
    with pytest.raises(ConfigError, match=r"train.device_mapping uses GPU 15, but 2 node\(s\) x 4 GPUs per node have GPUs 0-7"):
        resolve(2, 4, "0-15", "0-7")


def test_one_mapping_without_the_other_is_refused():
    with pytest.raises(ConfigError, match="rollout.device_mapping is empty"):
        resolve(1, 8, "0-7", "")


def test_no_mapping_is_the_cpu_placement():
    p = resolve(3, 0, "", "")
    assert [(w.rank, w.node, w.gpu) for w in p.train_workers] == [(0, 0, None), (1, 1, None), (2, 2, None)]
    assert [(e.node, e.gpus) for e in p.engines] == [(0, ()), (1, ()), (2, ())]
    assert not p.on_gpu


def test_cpu_roles_go_to_the_nodes_train_nodes_and_rollout_nodes_name():
    p = placement.resolve(num_nodes=3, gpus_per_node=0, train_mapping="", rollout_mapping="", train_nodes="0",
                          rollout_nodes="1-2")
    assert [(w.rank, w.node, w.gpu) for w in p.train_workers] == [(0, 0, None)]
    assert [(e.engine, e.node) for e in p.engines] == [(0, 1), (1, 2)]
    assert not p.colocated and p.checkpoint_node == 0
    assert placement.rollout_weights(p, None) == (0.0, 1.0, 1.0)  # auto: node 0 has no engine
    both = placement.resolve(num_nodes=2, gpus_per_node=0, train_mapping="", rollout_mapping="", rollout_nodes="1")
    assert [w.node for w in both.train_workers] == [0, 1] and [e.node for e in both.engines] == [1] and both.colocated


def _models(**sections):
    from orchestrator.config import AuxModelConfig

    return {name: AuxModelConfig(path="/m", **values) for name, values in sections.items()}


def test_models_beside_the_policy_are_served_where_their_nodes_or_gpus_say():
    cpu = lambda **kw: placement.resolve(num_nodes=3, gpus_per_node=0, train_mapping="", rollout_mapping="", **kw)  # noqa: E731
    every = cpu(models=_models(judge={}))  # by default on every node that rolls out
    assert every.serving("judge") == (0, 1, 2) and every.aux_on("judge", 1).gpus == ()
    chosen = cpu(rollout_nodes="1-2", models=_models(judge={"nodes": "2"}, teacher={}))
    assert chosen.serving("judge") == (2,) and chosen.serving("teacher") == (1, 2) and chosen.aux_on("judge", 1) is None
    alone = cpu(train_nodes="0", rollout_nodes="1", models=_models(judge={"nodes": "2"}))  # node 2 only serves the judge
    assert alone.serving("judge") == (2,) and not alone.engines_on(2) and not alone.train_workers_on(2)
    with pytest.raises(ConfigError, match="node 2 would neither train nor roll out"):
        cpu(train_nodes="0", rollout_nodes="1")
    # On GPUs: one engine on each node over its GPUs of the mapping, node-local ids; a node may only serve one.
    gpu = placement.resolve(num_nodes=3, gpus_per_node=4, train_mapping="0-2", rollout_mapping="4-7", gpus_per_engine=2,
                            models=_models(judge={"device_mapping": "3,10-11"}))
    assert [(e.node, e.gpus) for e in gpu.aux["judge"]] == [(0, (3,)), (2, (2, 3))]
    assert roundtrip(gpu) == gpu
    with pytest.raises(ConfigError, match=re.escape("models.judge.device_mapping uses GPU 12, but 3 node(s) x 4 GPUs per node")):
        placement.resolve(num_nodes=3, gpus_per_node=4, train_mapping="0-3", rollout_mapping="4-7", models=_models(judge={"device_mapping": "12"}))
    assert placement.resolve(num_nodes=1, gpus_per_node=2, train_mapping="0", rollout_mapping="0").aux == {}
    shown = plan("--json", "--num-nodes=2", "--gpus-per-node=8", "train.device_mapping=0-5", "rollout.device_mapping=6,8-14",
                 "models.judge.path=/m", "models.judge.device_mapping=7,15")
    assert shown.returncode == 0, shown.stderr
    assert [(e["node"], e["gpus"]) for e in json.loads(shown.stdout)["aux"]["judge"]] == [(0, [7]), (1, [7])]


def roundtrip(record):
    return records.from_dict(json.loads(json.dumps(records.to_dict(record))), type(record))


@pytest.mark.parametrize("train, rollout, nodes, gpu, says", [
    ("0", "0", 2, False, "node 1 would neither train nor roll out"),
    ("0", "2", 2, False, "rollout.nodes names node 2, but the run has 2 node(s)"),
    ("0,0", "", 2, False, "lists node 0 twice"),
    ("0", "1", 2, True, "with device mappings the mappings place them"),
])
def test_role_nodes_that_do_not_fit_are_refused(train, rollout, nodes, gpu, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        placement.check_role_nodes(train, rollout, nodes, gpu=gpu)


def test_on_cpu_the_weights_follow_the_nodes_that_roll_out():
    placement.check_cpu_weights((0, 1), (1,))
    with pytest.raises(ConfigError, match="gives node 0 weight 1, but rollout.nodes does not name it"):
        placement.check_cpu_weights((1, 1), (1,))
    with pytest.raises(ConfigError, match="gives node 1 weight 0, but it runs an engine and rolls out"):
        placement.check_cpu_weights((1, 0), (0, 1))


def test_plan_shows_a_disaggregated_cpu_run():
    r = plan("--num-nodes", "2", "--rank-weights", "auto", "train.nodes=0", "rollout.nodes=1", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["colocated"] is False and out["rollout_weights"] == [0.0, 1.0]
    assert [w["node"] for w in out["train_workers"]] == [0] and [e["node"] for e in out["engines"]] == [1]


def test_rollout_follows_the_engines_a_node_without_them_weighs_zero():
    p = resolve(2, 4, "0-3", "4-7")  # node 0 trains, node 1 rolls out
    assert placement.rollout_weights(p, None) == (0.0, 4.0)
    assert placement.rollout_weights(p, (0, 2)) == (0, 2)
    with pytest.raises(ConfigError, match=r"gives node 0 \(a\) weight 1, but it runs no rollout engine"):
        placement.rollout_weights(p, (1, 1), ["a", "b"])
    with pytest.raises(ConfigError, match=r"gives node 1 \(b\) weight 0, but it runs 4 rollout engine\(s\)"):
        placement.rollout_weights(p, (0, 0), ["a", "b"])


def test_a_node_that_neither_trains_nor_rolls_out_is_refused():
    with pytest.raises(ConfigError, match=r"node 1 would neither train nor roll out"):
        resolve(3, 4, "0-3", "8-11")


def test_auto_weighs_nodes_by_their_engines_gpus():
    p = resolve(2, 8, "0-15", "0-11", gpe=2)  # ROLL's example: 8 + 4 rollout GPUs
    assert placement.rollout_weights(p, None) == (8.0, 4.0)
    assert placement.rollout_weights(resolve(3, 0, "", ""), None) == (1.0, 1.0, 1.0)  # CPU: one engine each


def test_uneven_nodes_count_global_ranks_node_by_node():
    """One 8-GPU and two 4-GPU nodes: node 1 holds global GPUs 8-11, node 2 12-15."""
    p = resolve(3, (8, 4, 4), "0-7", "8-15", gpe=2)
    assert p.gpus_per_node == (8, 4, 4) and not p.colocated
    assert [(w.node, w.gpu) for w in p.train_workers] == [(0, g) for g in range(8)]
    assert [(e.node, e.gpus, e.port) for e in p.engines] == [
        (1, (0, 1), 8000), (1, (2, 3), 8001), (2, (0, 1), 8000), (2, (2, 3), 8001)]
    with pytest.raises(ConfigError, match=r"uses GPU 16, but 3 nodes of 8,4,4 GPUs have GPUs 0-15"):
        resolve(3, (8, 4, 4), "0-7", "8-16")
    with pytest.raises(ConfigError, match=r"engine 0 would straddle nodes 0 and 1: its GPUs 6,7,8,9"):
        resolve(3, (8, 4, 4), "0-5", "6-9", gpe=4)
    assert placement.cluster_gpus({1: {"count": 4}, 0: {"count": 8}, 2: {"count": 4}}) == (8, 4, 4)


def test_placement_round_trips_through_json():
    p = resolve(2, 8, "0-15", "0-11", gpe=2)
    assert records.from_dict(json.loads(json.dumps(records.to_dict(p))), placement.Placement) == p


# -- properties -----------------------------------------------------------------------------------

@st.composite
def clusters(draw):
    counts = draw(st.lists(st.sampled_from([1, 2, 3, 4, 8]), min_size=1, max_size=4))
    if draw(st.booleans()):
        counts = [counts[0]] * len(counts)  # uniform clusters, the common case
    total = sum(counts)
    train = draw(st.lists(st.integers(0, total + 1), min_size=1, max_size=total + 2, unique=True))
    rollout = draw(st.lists(st.integers(0, total + 1), min_size=1, max_size=total + 2, unique=True))
    gpe = draw(st.integers(1, 4))
    return counts, train, rollout, gpe


@settings(max_examples=400, deadline=None)
@given(clusters())
def test_placement_invariants(cluster):
    counts, train, rollout, gpe = cluster
    nodes = len(counts)
    offset = [sum(counts[:n]) for n in range(nodes)]
    node_of = [n for n, c in enumerate(counts) for _ in range(c)]
    try:
        p = resolve(nodes, tuple(counts), ",".join(map(str, train)), ",".join(map(str, rollout)), gpe=gpe, port=9000)
    except ConfigError as e:
        # Refused only for a reason the inputs really have.
        beyond = max(train + rollout) >= sum(counts)
        undivided = len(rollout) % gpe != 0
        chunks = [rollout[i:i + gpe] for i in range(0, len(rollout) - len(rollout) % gpe, gpe)]
        straddles = not beyond and any(len({node_of[g] for g in c}) > 1 for c in chunks)
        idle = not beyond and set(range(nodes)) - {node_of[g] for g in train + rollout}
        assert beyond or undivided or straddles or idle, str(e)
        return
    # Counts add up.
    assert len(p.train_workers) == len(train)
    assert len(p.engines) * gpe == len(rollout)
    # Every GPU at most once per role, and exactly the mapped ones.
    train_gpus = [offset[w.node] + w.gpu for w in p.train_workers]
    engine_gpus = [offset[e.node] + g for e in p.engines for g in e.gpus]
    assert sorted(train_gpus) == sorted(train) and len(set(train_gpus)) == len(train_gpus)
    assert sorted(engine_gpus) == sorted(rollout) and len(set(engine_gpus)) == len(engine_gpus)
    # Every node has a part; auto weights are the engines' GPUs, and sum to the rollout's.
    assert all(p.train_workers_on(n) or p.engines_on(n) for n in range(nodes))
    assert sum(placement.rollout_weights(p, None)) == len(rollout)
    # Engines never straddle nodes; ids are node-local; ports are distinct on a node.
    for e in p.engines:
        assert len(e.gpus) == gpe and all(0 <= g < counts[e.node] for g in e.gpus)
    for n in range(nodes):
        ports = [e.port for e in p.engines_on(n)]
        assert ports == list(range(9000, 9000 + len(ports)))
    assert [w.rank for w in p.train_workers] == list(range(len(train)))
    assert p.colocated == bool(set(train) & set(rollout))


# -- `orchestrator plan` ---------------------------------------------------------------------------

def test_plan_json_for_two_nodes_of_four():
    r = plan("--num-nodes", "2", "--gpus-per-node", "4", "train.device_mapping=0-7", "rollout.device_mapping=0-7",
             "rollout.gpus_per_engine=2", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["colocated"] is True
    assert out["train_workers"] == [{"rank": i, "node": i // 4, "gpu": i % 4} for i in range(8)]
    assert [{k: e[k] for k in ("engine", "node", "gpus")} for e in out["engines"]] == [
        {"engine": 0, "node": 0, "gpus": [0, 1]}, {"engine": 1, "node": 0, "gpus": [2, 3]},
        {"engine": 2, "node": 1, "gpus": [0, 1]}, {"engine": 3, "node": 1, "gpus": [2, 3]}]
    assert [e["port"] for e in out["engines"]] == [8000, 8001, 8000, 8001]


def test_plan_table_shows_nodes_and_engines_within_80_columns():
    r = subprocess.run([sys.executable, "-m", "orchestrator", "plan", "--num-nodes", "2", "--gpus-per-node", "8",
                        "train.device_mapping=0-15", "rollout.device_mapping=0-11", "rollout.gpus_per_engine=2"],
                       capture_output=True, text=True, timeout=60, env={**__import__("os").environ, "NO_COLOR": "1", "COLUMNS": "80"})
    assert r.returncode == 0, r.stderr
    assert [line for line in r.stdout.splitlines() if len(line) > 80] == []
    assert "colocated" in r.stdout and "16 train worker(s)" in r.stdout and "6 engine(s)" in r.stdout
    assert "tensor parallel 2" in r.stdout


@pytest.mark.parametrize("args, says", [
    (["--num-nodes", "2", "--gpus-per-node", "4", "train.device_mapping=0-7", "rollout.device_mapping=0-6", "rollout.gpus_per_engine=2"],
     "has 7 GPUs, which rollout.gpus_per_engine=2 does not divide"),
    (["--num-nodes", "2", "--gpus-per-node", "3", "train.device_mapping=0-5", "rollout.device_mapping=0-5", "rollout.gpus_per_engine=2"],
     "engine 1 would straddle nodes 0 and 1"),
    (["--num-nodes", "1", "--gpus-per-node", "4", "train.device_mapping=0-7", "rollout.device_mapping=0-3"],
     "uses GPU 7, but 1 node(s) x 4 GPUs per node"),
    (["train.device_mapping=0-x", "rollout.device_mapping=0"], "not a GPU rank"),
])
def test_plan_refuses_with_exit_2(args, says):
    r = plan(*args)
    assert r.returncode == 2, r.stdout
    assert says in r.stderr.replace("\n", " ")


def test_plan_uses_the_gpus_this_node_detects(tmp_path):
    env = {**__import__("os").environ, **gpu_env(fake_nvidia_smi(tmp_path / "bin"), 4)}
    r = subprocess.run([sys.executable, "-m", "orchestrator", "plan", "train.device_mapping=0-3", "rollout.device_mapping=0-3",
                        "rollout.gpus_per_engine=2", "--json"], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["gpus_per_node"] == [4] and len(out["engines"]) == 2 and out["rollout_weights"] == [4.0]
    assert "nvidia-smi" in out["cluster_source"]


# -- detection --------------------------------------------------------------------------------------

def test_detection_counts_what_cuda_visible_devices_leaves(tmp_path, monkeypatch):
    env = gpu_env(fake_nvidia_smi(tmp_path / "bin"), 8)
    monkeypatch.setenv("PATH", env["PATH"])
    monkeypatch.setenv("FAKE_GPUS", "8")
    assert gpus.detect({})["count"] == 8
    assert gpus.detect({"CUDA_VISIBLE_DEVICES": "4,5,6"})["count"] == 3
    assert gpus.detect({"CUDA_VISIBLE_DEVICES": "GPU-fake-2,1"})["count"] == 2
    assert gpus.detect({"CUDA_VISIBLE_DEVICES": "0,9,1"})["count"] == 1  # CUDA stops at the first invalid entry
    assert gpus.detect({"CUDA_VISIBLE_DEVICES": ""})["count"] == 0
    monkeypatch.setenv("FAKE_GPU_MEMORY_MIB", "5000")
    assert gpus.memory_used_mib([0, 1], {"CUDA_VISIBLE_DEVICES": "6,7"}) == {0: 5000, 1: 5000}


def test_detection_without_nvidia_smi_reports_no_gpus(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    report = gpus.detect({})
    assert report["count"] == 0 and "not found" in report["source"]


def test_children_get_the_devices_their_local_ids_name_in_this_process():
    assert gpus.child_visible_devices([0, 1], {}) == "0,1"
    assert gpus.child_visible_devices([1, 2], {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}) == "5,6"
    assert gpus.child_visible_devices([0], {"CUDA_VISIBLE_DEVICES": "GPU-abc, GPU-def"}) == "GPU-abc"


def test_engine_port_0_leaves_every_engine_to_pick_a_free_port():
    p = resolve(1, 4, "0-3", "0-3", port=0)
    assert [e.port for e in p.engines] == [0, 0, 0, 0]


# -- colocated: training waits until the engines' GPU memory is released ----------------------------

def _rollout(**kw):
    from orchestrator.config import RolloutConfig

    return RolloutConfig(**kw)


def test_training_waits_until_gpu_memory_is_released(tmp_path, monkeypatch):
    import threading

    from orchestrator.protocol.waiting import CancelToken
    from orchestrator.workloads.rl.engine_process import wait_memory_released

    env = gpu_env(fake_nvidia_smi(tmp_path / "bin"), 2)
    memory = tmp_path / "used"
    memory.write_text("30000")
    monkeypatch.setenv("PATH", env["PATH"])
    monkeypatch.setenv("FAKE_GPUS", "2")
    monkeypatch.setenv("FAKE_GPU_MEMORY_FILE", str(memory))
    polls = []
    real = gpus.memory_used_mib

    def counted(ids, *a):
        used = real(ids, *a)
        polls.append(used)
        if len(polls) == 3:
            threading.Thread(target=memory.write_text, args=("500",)).start()  # the engine's memory goes
        return used

    monkeypatch.setattr(gpus, "memory_used_mib", counted)
    wait_memory_released([0, 1], _rollout(memory_release_timeout_s=30), CancelToken())
    assert polls[0] == {0: 30000, 1: 30000} and polls[-1] == {0: 500, 1: 500}


def test_memory_never_released_fails_within_the_bound_naming_the_gpu(tmp_path, monkeypatch):
    import time

    from orchestrator.errors import DeadlineExceeded
    from orchestrator.protocol.waiting import CancelToken
    from orchestrator.workloads.rl.engine_process import wait_memory_released

    env = gpu_env(fake_nvidia_smi(tmp_path / "bin"), 2)
    monkeypatch.setenv("PATH", env["PATH"])
    monkeypatch.setenv("FAKE_GPUS", "2")
    monkeypatch.setenv("FAKE_GPU_MEMORY_MIB", "30000")
    began = time.monotonic()
    with pytest.raises(DeadlineExceeded, match=r"GPU 1 uses 30000 MiB \(limit rollout.memory_released_mib=2048\)"):
        wait_memory_released([1], _rollout(memory_release_timeout_s=1), CancelToken())
    assert time.monotonic() - began < 10
