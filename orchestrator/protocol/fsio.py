"""Atomic publish and validated reads of small records on a shared filesystem.

Every control file is a JSON object ``{"sha256": <hex>, "body": {...}}`` whose checksum
covers the canonical serialisation of the body. A reader that finds the file missing,
half-written, cut to an older length (sshfs), or stale-handled (NFS ``ESTALE``) gets
``None``: "not there yet". Writers publish with a unique temp name in the same directory,
fsync, then ``os.replace`` (docs/shared-filesystems.md, "Atomicity").
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import socket
import uuid
from pathlib import Path
from typing import Any, Callable

from orchestrator.protocol import waiting

# Errors that mean "the file is not (yet, or any longer) readable by name": retry later.
_NOT_YET = {errno.ENOENT, errno.ESTALE, errno.ENOTDIR}


def canonical(body: Any) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def checksum(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _temp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")


def atomic_write_bytes(path: Path, data: bytes, *, durable: bool = True) -> None:
    """Write ``data`` to ``path`` so that readers see the old file, or all of the new one.

    ``durable=False`` skips the fsync, for files whose loss in a crash does not matter
    (heartbeats): visibility to other clients comes from close() and rename, not fsync.
    """
    tmp = _temp_name(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileNotFoundError:  # the first record of its directory: one mkdir then, not one per write
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        try:
            _write_all(fd, data)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with _suppress_missing():
            os.unlink(tmp)
        raise


PAD_BELOW = 4096
"""Records smaller than this are padded with spaces to the next power of two (at least 512
bytes): a record rewritten often (a heartbeat) then keeps its size. A FUSE client that
caches a file's size (sshfs, 20 s by default) serves a replaced file cut to the old size,
which fails its checksum: "no news" for as long as the size keeps changing, which a
heartbeat's durations and counter would do at every beat."""


def envelope(body: dict) -> bytes:
    data = canonical(body)
    record = b'{"sha256":"' + checksum(data).encode() + b'","body":' + data + b"}"
    if len(record) < PAD_BELOW:
        size = max(512, 1 << len(record).bit_length())
        record = record.ljust(size - 1)
    return record + b"\n"


def write_record(path: Path, body: dict, *, durable: bool = True) -> None:
    """Publish ``body`` atomically with a checksum readers verify."""
    atomic_write_bytes(path, envelope(body), durable=durable)


def create_record_exclusive(path: Path, body: dict, before_write: Callable[[], None] | None = None) -> bool:
    """Create ``path`` only if no file has that name; True when this call created it.

    O_CREAT|O_EXCL decides the race (atomic on NFSv3+, held 50/50 on sshfs); the content
    is written through the same handle, so readers still validate it (a crash between the
    two leaves an empty file). ``before_write``: a test's fault hook between the two.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    except PermissionError:
        # sshfs reports a lost O_EXCL race as EPERM (SFTP's generic failure): lost if the name exists
        if read_bytes(path) is not None:
            return False
        raise
    try:
        if before_write is not None:
            before_write()
        _write_all(fd, envelope(body))
        os.fsync(fd)
    finally:
        os.close(fd)
    return True


def _write_all(fd: int, data: bytes) -> None:
    """Write ``data`` through a descriptor (no ``fstat``, unlike a file object)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def read_bytes(path: Path) -> bytes | None:
    """Open ``path`` by name and read it whole; None when it is not there (or went stale).
    One lookup by name and no other metadata call (no ``fstat``, unlike ``open()``)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        if e.errno in _NOT_YET:
            return None
        raise
    try:
        parts = []
        while chunk := os.read(fd, 1 << 16):
            parts.append(chunk)
        return b"".join(parts)
    except OSError as e:
        if e.errno in _NOT_YET:
            return None
        raise
    finally:
        os.close(fd)


def read_record(path: Path) -> dict | None:
    """The body of a record written by :func:`write_record`, or None if absent or invalid."""
    return parse_record(read_bytes(path))


def parse_record(data: bytes | None) -> dict | None:
    """The body of a record's bytes (see :func:`read_record`), or None if absent or invalid:
    for a reader that must also tell an absent file from an invalid one."""
    if not data:
        return None
    try:
        doc = json.loads(data)
        body = doc["body"]
        if checksum(canonical(body)) != doc["sha256"]:
            return None
    except (ValueError, KeyError, TypeError):
        return None
    return body if isinstance(body, dict) else None


def refresh_dir(path: Path) -> None:
    """Open the directory so an NFS client revalidates its cached entries (close-to-open).

    Cheap, and harmless where it does nothing (sshfs, Lustre, local disks).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        if e.errno in _NOT_YET:
            return
        raise
    os.close(fd)


def fsync_dir(path: Path) -> None:
    """Make a rename or create inside ``path`` durable."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some FUSE filesystems do not implement fsync on directories
    finally:
        os.close(fd)


class _suppress_missing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        return exc_type is not None and issubclass(exc_type, OSError) and getattr(exc, "errno", None) in _NOT_YET


def retry_transient(fn, what: str, *, transient: tuple[type[Exception], ...] = (), attempts: int = 4, first_delay_s: float = 0.1):
    """``fn()``, tried again after a short, growing pause when it fails the way a network
    filesystem sometimes does once: ``ESTALE`` (NFS), or an exception in ``transient`` (for
    example a checksum mismatch of a file served cut short by sshfs). The last failure is raised."""

    def transient_failure(e: Exception) -> bool:
        return (isinstance(e, OSError) and e.errno == errno.ESTALE) or isinstance(e, transient)

    return waiting.retry(fn, what=what, attempts=attempts, backoff=waiting.Backoff(first_delay_s, first_delay_s * 2 ** attempts),
                         retry_on=transient_failure)
