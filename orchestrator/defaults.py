"""Defaults that more than one layer needs, each defined once."""

NODE_TIMEOUT_S = 180.0
"""``coordination.node_timeout_s``: a rank whose heartbeat stands still this long is dead.
The run's config, doctor's checks and doctor's ``--node-timeout`` all start from it."""

WORKER_GRACE_S = 10.0
"""A worker waits this much longer than the master for the same thing (a join, a barrier's
release, a doctor session), so that the master, which knows who is missing, reports it."""

MASTER_READS_PER_S = 250.0
"""At a barrier the master reads the arrival of every rank still missing at each poll: its polls
are spaced so that it opens at most this many files a second (1,000 missing: one poll every 4 s;
one missing: polls as fast as the backoff allows)."""

FAN_IN_FROM = 64
"""coordination.fan_in automatic: from this many ranks on, barrier arrivals reach the master
through group leaders (below it the master reads every arrival: one hop less, and at 63 files
a round its reads take a quarter second at most)."""
