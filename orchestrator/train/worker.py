"""The trainer process, one per train worker, launched by the orchestrator:

    python -m orchestrator.train.worker --train-config PATH [--done PATH]   one update, then exit
    python -m orchestrator.train.worker --serve                 one update per request, until stdin ends

The processes form a torch.distributed group over a TCP rendezvous (never ``file://``: see
docs/shared-filesystems.md), run a GRPO update of the init checkpoint with DDP or FSDP2 (train/parallel.py),
cut into steps and micro-batches as train/plan.py says, and write the new checkpoint.

``--serve`` (``train.keep_alive``, the default) forms the group once and keeps the model, the
optimizer, the tokenizer and the KL reference across iterations. Each request is one line
on stdin, ``{"config": PATH, "done": PATH}``; when every rank has passed the update's final
barrier the process writes ``done`` (JSON: the iteration, its pid, the stats and the time
spent in each part) and waits for the next line. It continues from memory when the request's
``init_iteration`` is the update it made last, and loads the init checkpoint (weights and
optimizer state) otherwise, so a resumed run and an uninterrupted one compute the same
update. The end of stdin (its rank ended, or died: the pipe closes with it) ends the process
with 0; a failed update ends it with the exit status below, never with a half-made state
kept for the next request.

Train request (JSON, written by the orchestrator; every key without a default is required,
unknown keys are logged and ignored): see ``TrainRequest`` (train/request.py), whose ``rl``
and ``train`` sections are the run's own keys (train/settings.py).

Environment:
    MASTER_ADDR, MASTER_PORT    the rendezvous (rank 0 listens there)
    WORLD_SIZE, RANK            this process's place in the group
    TRAIN_BACKEND               gloo | nccl (default: nccl when CUDA is available, else gloo)
    TRAIN_TIMEOUT_S             rendezvous and collective timeout in seconds (default 600)
    LOCAL_RANK                  GPU index with nccl (default 0)
    ORCHESTRATOR_ERROR_FILE     where to write this process's error record if it fails
                                (protocol/child_error.py)

The optimizer continues from the init checkpoint's saved AdamW state when it has one
(``optimizer_state``; the base model has none, so the first iteration starts fresh).

What is written into ``output``: ``config.json``, ``generation_config.json``, the weights,
the tokenizer files, the optimizer state, and last ``train_stats.json`` (temp + rename, after
everything else, by rank 0), so ``train_stats.json`` vouches for the rest. With ddp rank 0
writes it all: ``model.safetensors`` and ``optimizer/adamw.safetensors``. With fsdp every
worker writes its shard, ``model-0000i-of-0000n.safetensors`` and
``optimizer/adamw-0000i-of-0000n.safetensors``, and rank 0 the two indexes after them
(checkpoints/sharded.py), so ``output`` must be the same directory for every worker.

Exit status: 0 done (all ranks passed the final barrier); 2 bad config, environment or
trajectory data; 1 anything else (rendezvous failed, a peer died, a collective timed out).
The last line on stderr says which rank failed and why.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from orchestrator.node import collector

if __name__ == "__main__":  # the process's entry, before the heavy imports: orchestrator/node/collector.py
    collector.tune()

from orchestrator.errors import EXIT_ERROR, EXIT_OK
from orchestrator.protocol import child_error
from orchestrator.train.errors import TrainerError
from orchestrator.train.serving import run, serve

log = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m orchestrator.train.worker", description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--train-config", type=Path, help="the train config JSON written by the orchestrator: one update")
    mode.add_argument("--serve", action="store_true", help="one update per request line on stdin, until it ends")
    parser.add_argument("--done", type=Path, help="with --train-config: where to write the answer (iteration, pid, stats, timing)")
    args = parser.parse_args(argv)
    who = f"rank {os.environ.get('RANK', '?')}/{os.environ.get('WORLD_SIZE', '?')}"
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format=f"%(asctime)s trainer {who} %(levelname)s %(name)s: %(message)s", force=True)
    try:
        if args.serve:
            serve(os.environ, sys.stdin)
        else:
            run(args.train_config, os.environ, args.done)
    except TrainerError as e:
        log.error("trainer %s failed: %s", who, e)
        child_error.write(e, program="trainer", exit_code=e.exit_code)
        return e.exit_code
    except Exception as e:
        log.exception("trainer %s failed: %s: %s", who, type(e).__name__, e)
        child_error.write(e, program="trainer", exit_code=EXIT_ERROR)
        return EXIT_ERROR
    return EXIT_OK


if __name__ == "__main__":
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: c10d's C++ threads must not be destroyed under a live group.
    os._exit(code)
