"""`orchestrator doctor` on three "nodes": network namespaces with their own IPs, joined by
veth pairs to a Linux bridge, sharing one directory as the shared filesystem (namespaces
share the mount namespace). Each rank is a real `orchestrator doctor` process run with
`ip netns exec`, and ORCHESTRATOR_HOST=node<K> so that hosts differ.

Needs root and `ip netns`; skipped otherwise, except with CI=true, where it fails instead.
Every namespace, veth and bridge is removed in the fixture's finalizer, also on failure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.netns import SUBNET, Netns, namespaces

REPO = Path(__file__).resolve().parents[2]
DOCTOR_TIMEOUT_S = 30  # doctor's own --timeout for the other ranks
PROCESS_DEADLINE_S = 90.0  # a doctor process that runs longer is a hang: the test fails

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


def doctor_argv() -> list[str]:
    """`python -m orchestrator doctor` once the command is registered in cli/__init__.py;
    the same command through its own module until then."""
    from orchestrator.cli import cli

    if "doctor" in cli.commands:
        return [sys.executable, "-m", "orchestrator", "doctor"]
    return [sys.executable, "-m", "orchestrator.cli.doctor"]



class DoctorNetns(Netns):
    def run_doctor(self, log_path: Path, *, envs: dict[int, dict] | None = None, ranks: list[int] | None = None,
                   timeout_s: float = DOCTOR_TIMEOUT_S) -> dict[int, tuple[int, dict, str]]:
        """Run rank k's doctor in namespace k, all at once; ``{rank: (exit code, JSON, stderr)}``."""
        envs = envs or {}
        ranks = list(range(self.n)) if ranks is None else ranks
        started = {}
        for k in ranks:
            env = {key: v for key, v in os.environ.items()
                   if not key.startswith(("NCCL_", "GLOO_", "TORCH_NCCL_")) and key not in ("CUDA_VISIBLE_DEVICES", "RANK", "NODE_RANK")}
            env.update({"ORCHESTRATOR_HOST": f"node{k}", **envs.get(k, {})})
            out, err = self.tmp / f"doctor-r{k}.out", self.tmp / f"doctor-r{k}.err"
            argv = ["ip", "netns", "exec", self.namespaces[k], *doctor_argv(), f"--log-path={log_path}",
                    f"--num-nodes={self.n}", "--master" if k == 0 else f"--worker={k}", f"--timeout={timeout_s}",
                    "--min-free-gib=0.1", "--json"]
            with open(out, "wb") as fo, open(err, "wb") as fe:
                p = subprocess.Popen(argv, cwd=REPO, env=env, stdout=fo, stderr=fe, stdin=subprocess.DEVNULL)
            self.procs.append(p)
            started[k] = (p, out, err)
        results = {}
        for k, (p, out, err) in started.items():
            try:
                code = p.wait(timeout=PROCESS_DEADLINE_S)
            except subprocess.TimeoutExpired:
                p.kill()
                pytest.fail(f"doctor rank {k} still running after {PROCESS_DEADLINE_S} s (a hang): {err.read_text()[-3000:]}")
            text = out.read_text()
            try:
                doc = json.loads(text)
            except ValueError:
                pytest.fail(f"rank {k} printed no JSON (exit {code}): stdout {text[-2000:]!r} stderr {err.read_text()[-3000:]}")
            results[k] = (code, doc, err.read_text())
        return results




@pytest.fixture
def netns(tmp_path):
    with namespaces(tmp_path, 3, DoctorNetns) as cluster:
        yield cluster


def _master(results) -> dict:
    return results[0][1]


def _only(problems: list[dict], check: str) -> list[dict]:
    return [p for p in problems if p["check"] == check]


def _explain(results) -> str:
    return "\n".join(f"rank {k}: exit {c}\n{json.dumps(d.get('problems'), indent=1)}\n{e[-1500:]}" for k, (c, d, e) in results.items())


def test_consistent_namespaces_exit_0(netns, tmp_path):
    results = netns.run_doctor(tmp_path / "shared")
    assert all(code == 0 for code, _, _ in results.values()), _explain(results)
    for k, (_, doc, _) in results.items():
        assert doc["problems"] == [] and doc["rank"] == k and doc["exit_code"] == 0
    m = _master(results)
    ranks = {s["rank"]: s for s in m["ranks"]}
    assert [ranks[k]["host"] for k in range(3)] == ["node0", "node1", "node2"]
    assert [ranks[k]["addresses"] for k in range(3)] == [[f"{SUBNET}.{k + 1}"] for k in range(3)]
    for k in range(3):
        assert ranks[k]["path"]["interface"] == "eth0" and ranks[k]["path"]["mtu"] == 1500
    for k in (1, 2):
        assert ranks[k]["route_to_master"]["dev"] == "eth0" and ranks[k]["route_to_master"]["addr"] == f"{SUBNET}.1"
        fs = m["filesystem"]["per_rank"][str(k)]
        for key in ("new_file_s", "replaced_file_s", "clock_skew_s"):
            assert fs[key] is not None, fs
        assert abs(fs["clock_skew_s"]) <= fs["clock_uncertainty_s"] + 0.05  # one clock: no skew
    # Every rank printed the master's verdict.
    assert results[1][1]["session"] == results[2][1]["session"] == m["session"]


def test_mtu_mismatch_names_the_node(netns, tmp_path):
    netns.set_mtu(2, 9000)
    results = netns.run_doctor(tmp_path / "shared")
    assert all(code == 1 for code, _, _ in results.values()), _explain(results)
    (p,) = _only(_master(results)["problems"], "path_mtu")
    assert p["ranks"] == [2]
    assert "node2" in p["detail"] and "9000" in p["detail"] and "1500" in p["detail"]
    assert "node0" in p["detail"] and "node1" in p["detail"]
    assert "ip link set dev eth0 mtu 1500" in p["fix"]


def test_missing_socket_interface_names_the_node(netns, tmp_path):
    results = netns.run_doctor(tmp_path / "shared", envs={1: {"NCCL_SOCKET_IFNAME": "eth9"}})
    assert all(code == 1 for code, _, _ in results.values()), _explain(results)
    problems = _master(results)["problems"]
    (p,) = _only(problems, "socket_ifname")
    assert p["ranks"] == [1] and "eth9" in p["detail"] and "node1" in p["detail"]
    assert any(q["ranks"] == [1] and "NCCL_SOCKET_IFNAME" in q["detail"] for q in _only(problems, "env"))
    assert not _only(problems, "path_mtu")


def test_version_mismatch_names_the_rank(netns, tmp_path):
    fake = tmp_path / "fake-site"
    meta = fake / "vllm-9.9.9.dist-info"
    meta.mkdir(parents=True)
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 9.9.9\n")
    pythonpath = os.pathsep.join([str(fake)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    results = netns.run_doctor(tmp_path / "shared", envs={1: {"PYTHONPATH": pythonpath}})
    assert all(code == 1 for code, _, _ in results.values()), _explain(results)
    problems = _master(results)["problems"]
    (p,) = [q for q in _only(problems, "versions") if q["detail"].startswith("vllm")]
    assert p["ranks"] == [1] and "9.9.9" in p["detail"] and "node1" in p["detail"]
    assert [q["check"] for q in problems] == ["versions"], problems


def test_a_rank_that_never_shows_up_is_named(netns, tmp_path):
    results = netns.run_doctor(tmp_path / "shared", ranks=[0, 1], timeout_s=3)
    assert [results[k][0] for k in (0, 1)] == [3, 3], _explain(results)
    for k in (0, 1):
        doc = results[k][1]
        assert doc["missing"] == [2] and "rank(s) 2 never showed up" in doc["error"]
