"""The embedded demo: synthetic tasks with a verifiable answer and a tiny Llama-style model
made locally (no download), so the whole RL loop runs on a CPU box. The chat demo
(``demo-data --chat``) asks the same questions as chat messages, of a tiny Qwen2-style model
with a locally trained BPE tokenizer and a chat template. The tool demo (``demo-data --tools``)
has that kind of model work out products over two turns with a calculator
(``orchestrator.demo.calculator:Calculator``, an environment)."""

# Defaults of `orchestrator demo-data`. The warm start stops once greedy accuracy on a
# validation split carved from train is in the band: clearly above zero, clearly short of
# perfect, on any CPU and seed (demo/warm_start.py says why a step count cannot promise that).
DEFAULT_SEED = 0
DEFAULT_ACCURACY_BAND = (0.30, 0.40)
DEFAULT_MAX_WARM_STEPS = 1500
VALIDATION_TASKS = 200

# The chat demo's (demo-data --chat): docs/demo.md says how they were chosen.
CHAT_ACCURACY_BAND = (0.30, 0.40)
CHAT_MAX_WARM_STEPS = 1500

# The tool demo's (demo-data --tools). TOOLS_MAX_TOKENS is its run's rl.max_tokens: a whole
# sample after the prompt, both turns and the calculator's answer (docs/demo.md).
TOOLS_ACCURACY_BAND = (0.30, 0.40)
TOOLS_MAX_WARM_STEPS = 1500
TOOLS_MAX_TOKENS = 64


def defaults(*, chat: bool = False, tools: bool = False) -> tuple[tuple[float, float], int]:
    """(accuracy band, most warm-start steps) of the demo ``chat`` and ``tools`` name."""
    if tools:
        return TOOLS_ACCURACY_BAND, TOOLS_MAX_WARM_STEPS
    if chat:
        return CHAT_ACCURACY_BAND, CHAT_MAX_WARM_STEPS
    return DEFAULT_ACCURACY_BAND, DEFAULT_MAX_WARM_STEPS
