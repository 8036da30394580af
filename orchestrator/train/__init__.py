"""The trainer: one process per train worker, started on its node by ``launch`` (the
node's launcher: requests in, ``done`` records out, how a process ends), forming a
torch.distributed group across nodes and running a GRPO update on the rollouts.

``grpo`` holds the pure pieces (records, advantages, batching, log-probs, the loss,
sharding); ``worker`` is the process entry point (``python -m orchestrator.train.worker``),
which ``serving`` answers requests for: ``request`` (what one update is asked, its ``rl``
and ``train`` sections declared in ``settings``), ``rendezvous`` (the process group),
``policy`` (the model in memory: load, offload), ``batches`` (the trajectory and its
log-probs), ``update`` (the optimizer steps) and ``checkpoint_writer``.
"""
