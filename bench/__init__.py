"""Benchmarks of the orchestrator (run as scripts; see each module docstring)."""
