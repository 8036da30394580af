"""A real Slurm cluster on this machine: munged, slurmctld and one slurmd per node, each node
a name on 127.0.0.1 with its own port (Slurm's "multiple slurmd" mode, which Debian's
slurm-wlm build has). Every daemon runs in the foreground as a child of the test, with its
state, spool, logs and munge key under a temp directory, so nothing outside it changes and
:meth:`SlurmCluster.close` stops them all.

``srun``/``sbatch`` talk to it through ``SLURM_CONF`` (:attr:`SlurmCluster.env`).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from orchestrator.node.ports import free_port

START_DEADLINE_S = 30.0
STOP_GRACE_S = 10.0


def missing_prerequisites() -> list[str]:
    """What this machine lacks to run the cluster; empty when everything is there."""
    missing = [f"{tool} (apt package slurm-wlm)" for tool in ("srun", "sbatch", "sinfo", "slurmctld", "slurmd")
               if shutil.which(tool) is None]
    if shutil.which("munged") is None:
        missing.append("munged (apt package munge)")
    if os.geteuid() != 0:
        missing.append("root (slurmd runs jobs as their user)")
    return missing


class SlurmCluster:
    def __init__(self, root: Path, nodes: int):
        self.root, self.nodes = root, nodes
        self.names = [f"n{i}" for i in range(nodes)]
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    def start(self) -> "SlurmCluster":
        r = self.root
        for d in ("state", "spool", "logs"):
            (r / d).mkdir(parents=True, exist_ok=True)
        key = r / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        sock = r / "munge.sock"
        host = socket.gethostname().split(".")[0]
        ctld_port = free_port(16800)
        ports = []
        for _ in self.names:
            ports.append(free_port((ports[-1] + 1) if ports else ctld_port + 1))
        nodes = "\n".join(f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs={os.cpu_count()} State=UNKNOWN"
                          for name, port in zip(self.names, ports))
        self.conf.write_text(f"""ClusterName=orchtest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
AuthType=auth/munge
AuthInfo=socket={sock}
CredType=cred/munge
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.%n.pid
SlurmctldLogFile={r}/logs/slurmctld.log
SlurmdLogFile={r}/logs/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
SelectType=select/linear
SlurmUser=root
SlurmdUser=root
MpiDefault=none
ReturnToService=2
{nodes}
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")
        self._daemon("munged", ["munged", "-F", "--force", f"--key-file={key}", f"--socket={sock}", f"--pid-file={r}/munged.pid",
                                f"--log-file={r}/logs/munged.log", f"--seed-file={r}/munge.seed"])
        self._wait(sock.exists, "munged's socket")
        self._daemon("slurmctld", ["slurmctld", "-D", "-i"])
        for name in self.names:
            (r / "spool" / name).mkdir(exist_ok=True)
            self._daemon(f"slurmd {name}", ["slurmd", "-D", "-N", name])
        self._wait(self._all_idle, f"{self.nodes} idle Slurm nodes (sinfo)")
        return self

    def _daemon(self, name: str, argv: list[str]) -> None:
        log = open(self.root / "logs" / f"{name.replace(' ', '-')}.out", "wb")
        with log:
            self.procs.append((name, subprocess.Popen(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                                      start_new_session=True)))

    def _all_idle(self) -> bool:
        result = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], env=self.env, capture_output=True, text=True, timeout=10)
        states = dict(line.split() for line in result.stdout.splitlines() if line.strip())
        return all(states.get(name) == "idle" for name in self.names)

    def _wait(self, ready, what: str) -> None:
        deadline = time.monotonic() + START_DEADLINE_S
        while time.monotonic() < deadline:
            dead = [(name, p.returncode) for name, p in self.procs if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{dead[0][0]} exited with code {dead[0][1]} while waiting for {what}: {self.logs()}")
            if ready():
                return
            time.sleep(0.2)
        raise RuntimeError(f"no {what} within {START_DEADLINE_S:g} s: {self.logs()}")

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}" for p in sorted((self.root / "logs").glob("*")))

    def close(self) -> None:
        """Stop every daemon (slurmd first, munged last), SIGKILL after a grace period."""
        for name, p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(timeout=STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait(timeout=STOP_GRACE_S)
        self.procs.clear()
