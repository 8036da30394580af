"""The generic rank: the runner walks the phase table, each phase's work and master
decision live in ``phases/``, and ``context`` holds what they see (``PhaseContext``) and
the ``Workload`` protocol they call. Knows no workload in particular."""
