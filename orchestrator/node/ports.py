"""Finding a free TCP port on this node (engines), or holding one (the training rendezvous)."""

from __future__ import annotations

import socket

from orchestrator.errors import OrchestratorError


def free_port(first: int, tries: int = 200, exclude: set[int] | frozenset[int] = frozenset()) -> int:
    """The first port from ``first`` on that nothing listens on (skipping ``exclude``: ports
    promised to servers still starting). Another process can still take it before we bind it:
    users of the port check that they reached their own server."""
    with _bound(first, tries, exclude) as s:
        return s.getsockname()[1]


def listening_socket(first: int, tries: int = 200) -> socket.socket:
    """A socket bound to the first free port from ``first`` and listening there: the port is
    this process's from now on, with no window for another to take it (pass its descriptor to
    the server that is to answer on it)."""
    s = _bound(first, tries, frozenset())
    s.listen(1024)
    return s


def _bound(first: int, tries: int, exclude: set[int] | frozenset[int]) -> socket.socket:
    """A socket bound to the first port from ``first`` that is free and not in ``exclude``."""
    for port in range(first, first + tries):
        if port in exclude:
            continue
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.bind(("", port))
        except OSError:
            s.close()
            continue
        return s
    raise OrchestratorError(f"no free TCP port in {first}..{first + tries - 1}")
