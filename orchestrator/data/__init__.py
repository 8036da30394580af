"""What the phases produce on the shared filesystem: trajectory shards (``shards``),
checkpoint manifests (``checkpoints``), per-iteration summaries (``summary``) and the
split of tasks over ranks (``splitting``)."""
