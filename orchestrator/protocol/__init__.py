"""The file protocol: how ranks agree through a shared filesystem and nothing else.

Paths (``layout``), atomic and validated file I/O (``fsio``), every wait (``waiting``,
``clock``), the master lease (``lease``), heartbeats and who is alive (``heartbeat``,
``liveness``, ``monitor``), per-rank events (``events``), test fault points (``faults``),
and one rank's side of joining an attempt and passing barriers (``coordinator``).
docs/protocol.md is the specification. Imports only ``node``, ``config``, ``errors`` and
``phase_table`` besides itself.
"""
