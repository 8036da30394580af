"""What the phases produce on the shared filesystem: trajectory shards (``shards``),
per-iteration summaries (``summary``), the split of tasks over ranks (``splitting``) and
the tasks themselves (``tasks``, ``prompts``). Checkpoints have a package of their own
(``orchestrator.checkpoints``)."""
