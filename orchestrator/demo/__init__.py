"""The embedded demo: synthetic tasks with a verifiable answer and a tiny Llama-style model
made locally (no download), so the whole RL loop runs on a CPU box."""

# Defaults of `orchestrator demo-data`. 600 warm-start steps put the demo model at about a
# third of the held-out tasks (34% at seed 0): clearly above zero, clearly short of perfect.
DEFAULT_SEED = 0
DEFAULT_WARM_STEPS = 600
