"""Tests of the real thing: rank processes, the engine over HTTP, torch.distributed trainers,
signals, sshfs and FUSE mounts, network namespaces. Support code is in tests/ itself."""
