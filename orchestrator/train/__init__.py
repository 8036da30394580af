"""The trainer: one process per node, launched by the orchestrator, forming a
torch.distributed group across nodes and running a GRPO update on the rollouts.

``grpo`` holds the pure pieces (records, advantages, batching, log-probs, the loss,
sharding); ``worker`` is the process entry point (``python -m orchestrator.train.worker``).
"""
