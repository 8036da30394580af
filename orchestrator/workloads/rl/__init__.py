"""The RL workload: rollout and eval through an inference engine over HTTP, rewards,
and a torch.distributed GRPO update, behind the same seam as the rehearsal."""
