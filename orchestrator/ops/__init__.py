"""Operator tools that read a run's files: ``status``, ``report``, ``recovery`` (``orchestrator
recover``) and ``doctor`` (the cross-node checks session)."""
