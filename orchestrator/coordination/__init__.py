"""A rank's coordination: the threads and executors that read the shared files, call a rule
of protocol/ and carry out the one action it returns. ``coordinator`` (where the rank is,
barriers, membership, how it ended) on ``attendance`` (joining an attempt), ``executor`` (the
one wait loop), ``monitor`` (the watcher thread), ``heartbeat`` (the beating thread),
``wakeup`` (same-host wake-ups), ``startup`` (the master's preflight of the joins)."""
