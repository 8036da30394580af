"""Several sshfs clients of one directory on this machine, without an sshd.

Each mount is its own FUSE client with its own attribute, entry and listing caches (sshfs
defaults: 20 s), like nodes on NFS (docs/shared-filesystems.md, "Measured on the test machine").
The recipe: a script that only does ``exec /usr/lib/openssh/sftp-server`` stands in for
ssh, and ``sshfs -o ssh_command=<script> localhost:<export> <mountpoint>`` mounts with
default options otherwise. ``-f`` keeps each sshfs in the foreground so that this module
owns its process (by pid) and can stop it; it changes no caching behaviour.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

SFTP_SERVER = Path("/usr/lib/openssh/sftp-server")
FUSE_DEVICE = Path("/dev/fuse")
MOUNT_DEADLINE_S = 15.0
UNMOUNT_DEADLINE_S = 5.0


def missing_prerequisites() -> list[str]:
    """What this machine lacks to mount sshfs clients; empty when everything is there."""
    missing = []
    for tool, package in (("sshfs", "sshfs"), ("fusermount3", "fuse3")):
        if shutil.which(tool) is None:
            missing.append(f"{tool} (apt package {package})")
    if not (SFTP_SERVER.is_file() and os.access(SFTP_SERVER, os.X_OK)):
        missing.append(f"{SFTP_SERVER} (apt package openssh-sftp-server)")
    if not FUSE_DEVICE.exists():
        missing.append(f"{FUSE_DEVICE} (FUSE device; a container needs --device /dev/fuse)")
    elif not os.access(FUSE_DEVICE, os.R_OK | os.W_OK):
        missing.append(f"read/write access to {FUSE_DEVICE}")
    return missing


def is_mounted(mountpoint: Path) -> bool:
    """Is ``mountpoint`` listed in /proc/self/mounts (does not touch the filesystem itself)."""
    target = os.path.realpath(mountpoint)
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) >= 2 and _unescape(fields[1]) == target:
                    return True
    except OSError:
        return os.path.ismount(mountpoint)
    return False


def _unescape(field: str) -> str:
    return field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


class SshfsMounts:
    """Mount ``n`` sshfs clients of ``export`` under ``base``; :meth:`close` unmounts them all.

    Use as a context manager, or call :meth:`close` in a ``finally``: it always tries every
    mount, falls back to a lazy unmount, stops the sshfs processes it started, and raises at
    the end if anything is still mounted.
    """

    def __init__(self, export: Path, base: Path):
        self.export = Path(export)
        self.base = Path(base)
        self.mountpoints: list[Path] = []
        self._procs: dict[Path, subprocess.Popen] = {}
        self._logs: dict[Path, Path] = {}
        self.base.mkdir(parents=True, exist_ok=True)
        self.export.mkdir(parents=True, exist_ok=True)
        self._ssh_command = self.base / "sftp-server-as-ssh.sh"
        self._ssh_command.write_text(f"#!/bin/sh\nexec {SFTP_SERVER}\n")
        self._ssh_command.chmod(0o755)

    def __enter__(self) -> "SshfsMounts":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def mount(self, n: int) -> list[Path]:
        """Add ``n`` more mounts of the export; returns their mount points, all live."""
        new = []
        for _ in range(n):
            mp = self.base / f"m{len(self.mountpoints)}"
            mp.mkdir()
            log = self.base / f"{mp.name}.sshfs.log"
            self.mountpoints.append(mp)
            self._logs[mp] = log
            with open(log, "wb") as out:
                self._procs[mp] = subprocess.Popen(
                    ["sshfs", "-f", "-o", f"ssh_command={self._ssh_command}", f"localhost:{self.export}", str(mp)],
                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                )
            new.append(mp)
        for mp in new:
            self._wait_live(mp)
        return new

    def _wait_live(self, mp: Path) -> None:
        deadline = time.monotonic() + MOUNT_DEADLINE_S
        proc = self._procs[mp]
        while time.monotonic() < deadline:
            if is_mounted(mp) and os.path.ismount(mp):
                return
            if proc.poll() is not None:
                raise RuntimeError(f"sshfs for {mp} exited with {proc.returncode} before mounting: {self._log(mp)}")
            time.sleep(0.02)
        raise RuntimeError(f"sshfs mount {mp} of {self.export} not live after {MOUNT_DEADLINE_S} s: {self._log(mp)}")

    def _log(self, mp: Path) -> str:
        try:
            return self._logs[mp].read_text(errors="replace").strip() or "(no output)"
        except OSError:
            return "(no log)"

    def close(self) -> None:
        mounted = list(reversed(self.mountpoints))
        # fusermount3 -u fails with EBUSY while a just-killed rank still holds a file open:
        # retry every mount for a while (one deadline for all), then unmount lazily.
        deadline = time.monotonic() + UNMOUNT_DEADLINE_S
        errors: dict[Path, str] = {}
        while True:
            mounted = [mp for mp in mounted if is_mounted(mp)]
            if not mounted or time.monotonic() >= deadline:
                break
            for mp in mounted:
                r = subprocess.run(["fusermount3", "-u", str(mp)], capture_output=True, text=True)
                if r.returncode != 0:
                    errors[mp] = r.stderr.strip()
            time.sleep(0.1)
        for mp in mounted:
            for cmd in (["fusermount3", "-uz", str(mp)], ["umount", "-l", str(mp)]):
                if not is_mounted(mp):
                    break
                r = subprocess.run(cmd, capture_output=True, text=True)
                errors[mp] = r.stderr.strip() or errors.get(mp, "")
        for proc in self._procs.values():
            _stop(proc)
        self._procs.clear()
        problems = [f"{mp} is still mounted ({errors.get(mp, '')})" for mp in self.mountpoints if is_mounted(mp)]
        self.mountpoints.clear()
        if problems:
            raise RuntimeError("sshfs teardown: " + "; ".join(problems))


def _stop(proc: subprocess.Popen) -> None:
    """An sshfs in the foreground exits once unmounted; after a lazy unmount, it may not."""
    try:
        proc.wait(timeout=2)
        return
    except subprocess.TimeoutExpired:
        pass
    proc.terminate()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)
