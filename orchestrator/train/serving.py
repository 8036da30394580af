"""How the trainer takes its requests: ``run``, one update for the config on its command line,
or ``serve`` (``train.keep_alive``), one update per line on stdin with the policy kept in
memory between them. Either answers a request by writing its ``done`` record once every rank
has passed the update's final barrier."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from orchestrator.protocol import fsio
from orchestrator.train.errors import BadTrainInput
from orchestrator.train.policy import Policy
from orchestrator.train.rendezvous import Rendezvous, join
from orchestrator.train.request import TrainRequest
from orchestrator.train.update import update

log = logging.getLogger(__name__)


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def _startup_seconds() -> float:
    """Since this process was created (its interpreter start and imports included)."""
    import psutil

    return max(0.0, time.time() - psutil.Process().create_time())


def _answer(done: Path, config: TrainRequest, stats: dict, timing: dict, memory: dict) -> None:
    fsio.write_record(done, {"iteration": config.iteration, "pid": os.getpid(), "timing": timing, "memory": memory, "stats": stats}, durable=False)


def run(config_path: Path, env, done: Path | None = None) -> None:
    """Join, make one update (rank 0 writes), and pass the final barrier; then write ``done``
    if given. Raises TrainerError."""
    rdv = Rendezvous.from_env(env)
    config = TrainRequest.read(config_path)
    device = join(rdv)
    _quiet_transformers()
    startup = round(_startup_seconds(), 4)
    stats, timing, memory = update(Policy(rdv, device), config, time.monotonic())
    if done is not None:
        _answer(done, config, stats, {"startup": startup, **timing}, memory)
    # No destroy_process_group(): rank 0 hosts the TCPStore, and when it tears down and exits
    # while a peer is still inside its own teardown, the peer's store thread aborts the process
    # ("terminate called without an active exception", exit -6). Everything durable is
    # written before the barrier, so the process simply ends (see worker.py's __main__).


def _request(line: str) -> tuple[Path, Path]:
    try:
        request = json.loads(line)
        return Path(request["config"]), Path(request["done"])
    except (ValueError, KeyError, TypeError) as e:
        raise BadTrainInput(f"a request on stdin is not {{\"config\": PATH, \"done\": PATH}}: {line[:200]!r} ({e})") from None


def serve(env, requests) -> None:
    """Join once, then one update per request line until ``requests`` ends. Raises TrainerError."""
    rdv = Rendezvous.from_env(env)
    device = join(rdv)
    _quiet_transformers()
    policy = Policy(rdv, device)
    startup = round(_startup_seconds(), 4)
    for line in requests:
        if not line.strip():
            continue
        started = time.monotonic()
        config_path, done = _request(line)
        config = TrainRequest.read(config_path)
        log.info("pid %d: update of iteration %d", os.getpid(), config.iteration)
        stats, timing, memory = update(policy, config, started)
        if startup is not None:
            timing = {"startup": startup, **timing}
            startup = None
        _answer(done, config, stats, timing, memory)
    log.info("stdin ended: no more updates")
