"""The trainer's own failures, each with the exit status it ends the process with
(worker.py): 2 for input it cannot use, 1 for the rest, so the rank that started it can
tell a bad config from a lost peer."""

from __future__ import annotations

from orchestrator.errors import EXIT_BAD_INPUT, EXIT_ERROR


class TrainerError(Exception):
    """A failure this process can explain; ``exit_code`` is what it exits with."""

    exit_code = EXIT_ERROR


class BadTrainInput(TrainerError):
    """The train config, the environment or the trajectory data is unusable."""

    exit_code = EXIT_BAD_INPUT


class RendezvousFailed(TrainerError):
    """The process group could not be formed (a peer never came, or the address is wrong)."""
