"""`orchestrator doctor`'s checks on hand-made facts: each fires on a planted difference and
stays quiet when the ranks agree."""

from __future__ import annotations

import copy
import time

import pytest

from orchestrator.node import checks
from orchestrator.node import facts as facts_mod
from orchestrator.node.checks import GIB, Thresholds, quick_problems, run_checks

pytestmark = pytest.mark.timeout(30)

VERSIONS = {"python": "3.11.7", "torch": "2.13.0", "transformers": "4.56.0", "vllm": "0.10.1", "orchestrator": "0.1.0",
            "orchestrator_source": "abc123", "driver": "550.54.15", "nvidia-nccl-cu12": "2.27.3", "nvidia-nccl-cu13": None}


def node(rank: int, *, mtu: int = 1500, env: dict | None = None, iface: str = "eth0", up: bool = True,
         gpus: int = 8, cvd: str | None = None, free_gib: float = 500.0, route: bool = True, fm: dict | None = None,
         host: str | None = None, **versions) -> dict:
    ip = f"10.0.0.{rank + 1}"
    f = {
        "schema": 1, "rank": rank, "num_nodes": 3, "host": host or f"node{rank}", "quick": False,
        "interfaces": {
            "lo": {"up": True, "mtu": 65536, "loopback": True, "addrs": [{"family": "inet", "address": "127.0.0.1", "netmask": "255.0.0.0"}]},
            iface: {"up": up, "mtu": mtu, "loopback": False, "addrs": [{"family": "inet", "address": ip, "netmask": "255.255.255.0"}]},
            "docker0": {"up": False, "mtu": 1500, "loopback": False, "addrs": []},
        },
        "env": dict(env or {}),
        "cuda_visible_devices": cvd,
        "versions": {**VERSIONS, **{k.replace("_", "-") if k.startswith("nvidia") else k: v for k, v in versions.items()}},
        "gpus": {"count": gpus, "names": ["H100"] * gpus, "driver": VERSIONS["driver"], "memory": []},
        "log_path": {"path": "/shared/run", "free_bytes": int(free_gib * GIB), "total_bytes": 1000 * GIB,
                     "fstype": "nfs4", "mountpoint": "/shared", "options": "rw,vers=4.2"},
        "fabric_manager": fm,
        "route_to_master": ({"addr": "10.0.0.1", "dev": iface, "src": ip, "mtu": None} if route and rank else None),
    }
    return f


def cluster(n: int = 3, **per_rank) -> dict[int, dict]:
    """``per_rank``: ``r2={...}`` overrides node() arguments of rank 2."""
    return {r: node(r, **per_rank.get(f"r{r}", {})) for r in range(n)}


def checks_fired(problems: list[dict]) -> set[str]:
    return {p["check"] for p in problems}


def the(problems: list[dict], check: str) -> dict:
    found = [p for p in problems if p["check"] == check]
    assert len(found) == 1, problems
    return found[0]


def test_consistent_cluster_has_no_problems():
    facts = cluster()
    assert run_checks(facts) == []
    assert quick_problems(facts) == []
    fs = {"timeout_s": 60, "per_rank": {"0": {}, "1": {"new_file_s": 0.01, "replaced_file_s": 0.02, "clock_skew_s": 0.3,
                                                     "clock_uncertainty_s": 0.01}}}
    assert run_checks(facts, fs) == []


def test_facts_no_rank_reported_are_not_compared():
    facts = cluster()
    for f in facts.values():
        f["gpus"] = None  # no nvidia-smi anywhere: nothing to compare, not a crash
    assert "gpu_count" not in checks_fired(run_checks(facts))
    assert checks._differs(facts, {}, missing="unknown") is None


def test_problem_shape():
    p = the(run_checks(cluster(r2={"vllm": "9.9.9"})), "versions")
    assert set(p) == {"check", "ranks", "detail", "fix"}
    assert p["ranks"] == [2]
    assert "vllm" in p["detail"] and "9.9.9" in p["detail"] and "node2" in p["detail"] and "0.10.1" in p["detail"]
    assert "vllm==0.10.1" in p["fix"]


@pytest.mark.parametrize("key,value", [("python", "3.10.12"), ("torch", "2.4.0"), ("transformers", "4.40.0"),
                                       ("orchestrator", "0.2.0"), ("driver", "535.104.05"), ("orchestrator_source", "fff")])
def test_version_differences(key, value):
    p = the(run_checks(cluster(r1={key: value})), "versions")
    assert p["ranks"] == [1] and value in p["detail"] and p["detail"].startswith(key)


def test_version_missing_on_one_rank_is_a_difference():
    p = the(run_checks(cluster(r1={"vllm": None})), "versions")
    assert p["ranks"] == [1] and "not installed" in p["detail"]


def test_majority_decides_and_tie_goes_to_the_master():
    # Two ranks of three on the new torch: rank 0 is the odd one.
    p = the(run_checks(cluster(r0={"torch": "2.4.0"}, r1={"torch": "2.4.0"})), "versions")
    assert p["ranks"] == [2]
    # Two ranks, one each: the master's side counts as right.
    p = the(run_checks(cluster(2, r1={"torch": "2.4.0"})), "versions")
    assert p["ranks"] == [1]


def test_nccl_env_differs():
    facts = cluster(r0={"env": {"NCCL_IB_DISABLE": "1"}}, r1={"env": {"NCCL_IB_DISABLE": "1"}})
    p = the(run_checks(facts), "env")
    assert p["ranks"] == [2] and "NCCL_IB_DISABLE" in p["detail"] and "unset" in p["detail"]
    assert run_checks(cluster(**{f"r{r}": {"env": {"NCCL_IB_DISABLE": "1", "GLOO_SOCKET_IFNAME": "eth0"}} for r in range(3)})) == []


def test_cuda_visible_devices_on_some_ranks_only():
    p = the(run_checks(cluster(r2={"cvd": "0,1"})), "cuda_visible_devices")
    assert p["ranks"] == [2] and "'0,1'" in p["detail"]
    # Set everywhere (even to different GPUs): fine.
    assert "cuda_visible_devices" not in checks_fired(run_checks(cluster(**{f"r{r}": {"cvd": str(r)} for r in range(3)})))


@pytest.mark.parametrize("spec,iface,hit", [
    ("eth", "eth0", True), ("eth0", "eth0", True), ("=eth0", "eth0", True), ("=eth", "eth0", False),
    ("ib,eth", "eth0", True), ("eth9", "eth0", False), ("^docker,lo", "eth0", True), ("^eth", "eth0", False),
    ("^=eth0", "eth0", False), ("eth0:5000", "eth0", True), ("ens", "ens5f0", True),
])
def test_nccl_ifname_syntax(spec, iface, hit):
    ifaces = node(0, iface=iface)["interfaces"]
    assert (iface in checks.ifname_matches(spec, ifaces)) is hit


def test_gloo_ifname_is_exact():
    ifaces = node(0)["interfaces"]
    assert checks.ifname_matches("eth", ifaces, nccl=False) == []
    assert checks.ifname_matches("lo,eth0", ifaces, nccl=False) == ["eth0", "lo"]


def test_missing_socket_interface():
    env_ok = {"NCCL_SOCKET_IFNAME": "eth"}
    problems = run_checks(cluster(r0={"env": env_ok}, r1={"env": {"NCCL_SOCKET_IFNAME": "eth9"}}, r2={"env": env_ok}))
    p = the(problems, "socket_ifname")
    assert p["ranks"] == [1] and "eth9" in p["detail"] and "node1" in p["detail"] and "NCCL_SOCKET_IFNAME" in p["fix"]
    assert "env" in checks_fired(problems)  # and the setting differs between ranks


def test_socket_interface_down_or_without_address():
    env = {"GLOO_SOCKET_IFNAME": "eth0"}
    p = the(run_checks(cluster(**{f"r{r}": {"env": env, "up": r != 2} for r in range(3)})), "socket_ifname")
    assert p["ranks"] == [2] and "down" in p["detail"]
    facts = cluster(**{f"r{r}": {"env": env} for r in range(3)})
    facts[1]["interfaces"]["eth0"]["addrs"] = []
    p = the(run_checks(facts), "socket_ifname")
    assert p["ranks"] == [1] and "without an IP address" in p["detail"]


def test_exclusion_spec_leaving_nothing():
    env = {"NCCL_SOCKET_IFNAME": "^eth,docker"}
    p = the(run_checks(cluster(**{f"r{r}": {"env": env} for r in range(3)})), "socket_ifname")
    assert p["ranks"] == [0, 1, 2]


@pytest.mark.parametrize("odd", [0, 2])
def test_path_mtu_mismatch_names_the_node_and_both_mtus(odd):
    p = the(run_checks(cluster(**{f"r{odd}": {"mtu": 9000}})), "path_mtu")
    assert p["ranks"] == [odd]
    assert f"node{odd}" in p["detail"] and "9000" in p["detail"] and "1500" in p["detail"]
    assert "mtu 1500" in p["fix"] and f"node{odd}" in p["fix"]


def test_path_mtu_without_routes_uses_subnets_and_the_socket_ifname():
    # quick facts: no route_to_master, the subnet holding the master's address decides
    facts = cluster(**{f"r{r}": {"route": False, "mtu": 9000 if r == 1 else 1500} for r in range(3)})
    assert the(quick_problems(facts), "path_mtu")["ranks"] == [1]
    # NCCL_SOCKET_IFNAME picks the interface: a second NIC with its own MTU on rank 2
    facts = cluster()
    for f in facts.values():
        f["env"]["NCCL_SOCKET_IFNAME"] = "ib"
        f["interfaces"]["ib0"] = {"up": True, "mtu": 4092, "loopback": False,
                                  "addrs": [{"family": "inet", "address": f"192.168.0.{f['rank']}", "netmask": "255.255.255.0"}]}
    assert "path_mtu" not in checks_fired(run_checks(facts))
    facts[2]["interfaces"]["ib0"]["mtu"] = 2044
    p = the(run_checks(facts), "path_mtu")
    assert p["ranks"] == [2] and "ib0" in p["detail"]
    paths = checks.path_interfaces(facts)
    assert paths[0]["interface"] == "ib0" and paths[2]["mtu"] == 2044


def test_route_mtu_lowers_the_path_mtu():
    facts = cluster()
    facts[1]["route_to_master"]["mtu"] = 1400
    assert the(run_checks(facts), "path_mtu")["ranks"] == [1]


def test_gpu_count_differs():
    p = the(run_checks(cluster(r1={"gpus": 7})), "gpu_count")
    assert p["ranks"] == [1] and "7 GPU(s) on rank 1 (node1)" in p["detail"]


def test_low_free_space():
    p = the(run_checks(cluster(**{f"r{r}": {"free_gib": 3} for r in range(3)})), "disk_space")
    assert p["ranks"] == [0, 1, 2] and "3.0 GiB" in p["detail"]
    assert run_checks(cluster(**{f"r{r}": {"free_gib": 3} for r in range(3)}), thresholds=Thresholds(min_free_bytes=GIB)) == []


def test_fabric_manager():
    on = {"expected": True, "nvswitches": 4, "load_state": "loaded", "active_state": "active", "sub_state": "running", "error": None}
    off = {**on, "active_state": "failed", "sub_state": "failed"}
    absent = {**on, "load_state": "not-found", "active_state": "inactive"}
    assert run_checks(cluster(**{f"r{r}": {"fm": on} for r in range(3)})) == []
    p = the(run_checks(cluster(r0={"fm": on}, r1={"fm": off}, r2={"fm": on})), "fabric_manager")
    assert p["ranks"] == [1] and "failed" in p["detail"] and "systemctl restart nvidia-fabricmanager" in p["fix"]
    assert the(run_checks(cluster(r0={"fm": on}, r1={"fm": on}, r2={"fm": absent})), "fabric_manager")["ranks"] == [2]
    # No NVSwitch and no unit: not expected, not flagged; systemctl unusable (containers): not judged.
    quiet = {**absent, "expected": False, "nvswitches": 0}
    broken = {**off, "error": "System has not been booted with systemd"}
    assert run_checks(cluster(**{f"r{r}": {"fm": quiet if r else broken} for r in range(3)})) == []


def test_duplicate_host_and_num_nodes():
    facts = cluster(r2={"host": "node1"})
    p = the(run_checks(facts), "duplicate_host")
    assert p["ranks"] == [2] and "node1" in p["detail"]
    assert "duplicate_host" not in checks_fired(quick_problems(facts))  # `local` runs all ranks on one host
    facts = cluster()
    facts[2]["num_nodes"] = 4
    assert the(run_checks(facts), "num_nodes")["ranks"] == [2]


def test_filesystem_visibility_and_clock_skew():
    facts = cluster()
    fs = {"timeout_s": 60, "per_rank": {
        "0": {"new_file_s": 0.0, "replaced_file_s": 0.0, "clock_skew_s": 0.0, "clock_uncertainty_s": 0.0},
        "1": {"new_file_s": 50.0, "replaced_file_s": 0.1, "clock_skew_s": -3.5, "clock_uncertainty_s": 0.2},
        "2": {"new_file_s": None, "replaced_file_s": None, "clock_skew_s": 2.5, "clock_uncertainty_s": 1.0},
    }}
    problems = run_checks(facts, fs)
    vis = [p for p in problems if p["check"] == "fs_visibility"]
    assert sorted(p["ranks"] for p in vis) == [[1], [2], [2]]
    assert any("50.00 s" in p["detail"] for p in vis) and all("actimeo" in p["fix"] for p in vis)
    assert "nfs4" in vis[0]["fix"]  # names the mount in use
    skew = the(problems, "clock_skew")
    assert skew["ranks"] == [1] and "-3.50 s" in skew["detail"]  # rank 2's 2.5 s is within its uncertainty
    # A longer node timeout tolerates slower visibility.
    assert not any(p["ranks"] == [1] for p in run_checks(facts, fs, Thresholds(node_timeout_s=600)) if p["check"] == "fs_visibility")


def test_every_problem_has_a_fix_and_known_ranks():
    facts = cluster(r1={"vllm": "9.9.9", "mtu": 9000, "gpus": 4, "cvd": "0", "env": {"NCCL_SOCKET_IFNAME": "eth9"}})
    problems = run_checks(facts)
    assert {"versions", "env", "socket_ifname", "cuda_visible_devices", "gpu_count"} <= checks_fired(problems)
    for p in problems:
        assert p["fix"] and p["detail"] and set(p["ranks"]) <= {0, 1, 2}
        assert checks.describe(p).startswith(f"doctor: {p['check']}")


def test_checks_accept_string_ranks_from_json():
    facts = {str(r): f for r, f in cluster(r2={"torch": "x"}).items()}
    assert the(run_checks(copy.deepcopy(facts)), "versions")["ranks"] == [2]


def test_quick_collect_is_cheap_and_checkable(tmp_path):
    started = time.monotonic()
    f = facts_mod.collect(rank=0, num_nodes=1, log_path=tmp_path, quick=True)
    assert time.monotonic() - started < 0.5
    assert f["quick"] and "route_to_master" not in f and "fabric_manager" not in f
    assert f["versions"]["python"] and f["log_path"]["free_bytes"] > 0 and "lo" in f["interfaces"]
    assert quick_problems({0: f}, Thresholds(min_free_bytes=0)) == []
