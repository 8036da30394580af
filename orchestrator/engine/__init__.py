"""The embedded inference engine (a vLLM-compatible HTTP server) and the rollout's client for it."""
