"""Defaults that more than one layer needs, each defined once."""

NODE_TIMEOUT_S = 180.0
"""``coordination.node_timeout_s``: a rank whose heartbeat stands still this long is dead.
The run's config, doctor's checks and doctor's ``--node-timeout`` all start from it."""

WORKER_GRACE_S = 10.0
"""A worker waits this much longer than the master for the same thing (a join, a barrier's
release, a doctor session), so that the master, which knows who is missing, reports it."""
