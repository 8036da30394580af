"""A run's checkpoints, in one package: what a directory holds (``files``), its manifest and
verification (``manifest``; the sums its writers computed as they wrote, ``sums``), staging, rename into place and the current pointer
(``store``), retention and consumer markers (``retention``), export as a plain model
(``export``), and the formats the trainer writes (``sharded`` safetensors,
``optimizer_state``).

The names most callers need are here: ``checkpoints.verify(path)``, ``checkpoints.is_adapter(path)``.
"""

from orchestrator.checkpoints.files import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, MASTER_DIR, adapter_base, adapter_config, has_state, is_adapter,
                                           master_dir, weight_bytes)
from orchestrator.checkpoints.manifest import ALL, MANIFEST, WEIGHTS, CheckpointCorrupt, Verified, seal, verify

__all__ = ["ALL", "WEIGHTS", "MASTER_DIR", "master_dir", "ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "MANIFEST", "CheckpointCorrupt", "Verified", "adapter_base", "adapter_config", "has_state",
           "is_adapter", "seal", "verify", "weight_bytes"]
