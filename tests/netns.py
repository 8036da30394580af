"""Several "nodes" on one machine: network namespaces with their own IPs, joined by veth
pairs to a Linux bridge. They share the mount namespace, so one directory is their shared
filesystem. Needs root and `ip netns`: skipped otherwise, except with CI=true, where it
fails instead. Every namespace, veth and bridge is removed at the end, also on failure.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from tests.harness import require

SUBNET = "10.77.0"
IP_TIMEOUT_S = 10.0


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(["ip", *args], check=False, capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    if check and out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({out.returncode}): {out.stderr.strip()}")
    return out


def missing_netns() -> str | None:
    """Why network namespaces cannot be made here, or None."""
    if shutil.which("ip") is None:
        return "the `ip` command (apt package iproute2) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"dprobe{uuid.uuid4().hex[:6]}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()} (a container needs CAP_SYS_ADMIN and CAP_NET_ADMIN)"
    _ip("netns", "del", probe, check=False)
    return None


@dataclass
class Netns:
    """A bridge and ``n`` namespaces ``<ns>0..`` each with ``eth0`` = SUBNET.<k+1>/24."""

    tag: str
    n: int
    tmp: Path
    namespaces: list[str] = field(default_factory=list)
    host_veths: list[str] = field(default_factory=list)
    bridge: str = ""
    procs: list[subprocess.Popen] = field(default_factory=list)

    def setup(self) -> None:
        self.bridge = f"dbr{self.tag}"
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("link", "set", self.bridge, "up")
        for k in range(self.n):
            ns, veth = f"doc{self.tag}{k}", f"dv{self.tag}{k}"
            _ip("netns", "add", ns)
            self.namespaces.append(ns)
            # The namespace's end is created inside it directly, so "eth0" never meets the host's.
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            self.host_veths.append(veth)
            _ip("link", "set", veth, "master", self.bridge)
            _ip("link", "set", veth, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "addr", "add", f"{SUBNET}.{k + 1}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")

    def set_mtu(self, k: int, mtu: int) -> None:
        """Both ends of node k's link."""
        _ip("link", "set", self.host_veths[k], "mtu", str(mtu))
        _ip("-n", self.namespaces[k], "link", "set", "eth0", "mtu", str(mtu))

    def cleanup(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
        for ns in self.namespaces:
            _ip("netns", "del", ns, check=False)  # takes its eth0 and with it the host end
        for veth in self.host_veths:
            if _ip("link", "show", veth, check=False).returncode == 0:
                _ip("link", "del", veth, check=False)
        if self.bridge:
            _ip("link", "del", self.bridge, check=False)

    def set_link(self, k: int, up: bool) -> None:
        """Cut (or restore) node k's link: its veth end on the bridge goes down (or up)."""
        _ip("link", "set", self.host_veths[k], "up" if up else "down")

    def address(self, k: int) -> str:
        return f"{SUBNET}.{k + 1}"

    def popen(self, k: int, argv: list[str], **kwargs) -> subprocess.Popen:
        """A process in node k's namespace (killed at cleanup if still running)."""
        p = subprocess.Popen(["ip", "netns", "exec", self.namespaces[k], *argv], **kwargs)
        self.procs.append(p)
        return p


@contextlib.contextmanager
def namespaces(tmp: Path, n: int, cls=None):
    """``n`` namespaces for a test (skip or, with CI=true, fail where they cannot be made)."""
    require(missing_netns(), "network namespace tests")
    cluster = (cls or Netns)(tag=uuid.uuid4().hex[:4], n=n, tmp=tmp)
    try:
        cluster.setup()
        yield cluster
    finally:
        cluster.cleanup()
