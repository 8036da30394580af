"""Prompts as the engine sees them: each task's prompt rendered (chat messages through the
model's chat template, see :func:`tasks.render`) and its length in tokens; the tasks whose
prompt is longer than ``rl.max_prompt_tokens`` are left out of the run.

Lengths count what the engine's tokenizer makes of the rendered text, special tokens
included (the ``<s>`` a Llama tokenizer adds, for example). They come from the model's
``tokenizer.json`` through Hugging Face ``tokenizers``, which is what a fast tokenizer runs,
so a rank whose prompts need no chat template never imports transformers (and torch) for
this. The preflight measures both splits before anything is written; the workload reuses the
measurement while the task file and the model are unchanged.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from orchestrator.config import RunConfig
from orchestrator.data import tasks
from orchestrator.errors import ConfigError

# Where Hugging Face configs keep the context length, by model family.
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


@dataclass(frozen=True, slots=True)
class Measured:
    """One split's tasks, measured against the prompt limit."""

    tasks: list[dict]
    """The tasks the run uses, in file order: those whose prompt fits the limit."""
    texts: dict[str, str]
    """Task id -> the text the engine continues (every task of the file)."""
    skipped: int
    """Tasks left out because their prompt is longer than ``limit``."""
    total: int
    limit: int | None
    """Most prompt tokens a task may have; None: no limit (no context length known)."""
    shortest: int
    longest: int
    """Tokens in the file's shortest and longest prompt."""


def context_length(model: Path) -> int | None:
    """The model's context length from its ``config.json``; None when it names none."""
    try:
        config = json.loads((model / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    for key in _CONTEXT_KEYS:
        value = config.get(key) if isinstance(config, dict) else None
        if isinstance(value, int) and value > 0:
            return value
    return None


def limit(config: RunConfig) -> int | None:
    """``rl.max_prompt_tokens``, or by default what the context leaves beside ``rl.max_tokens``.

    Raises ConfigError when the two together pass the model's context length."""
    rl, model = config.rl, config.model_path
    context = context_length(model)
    if rl.max_prompt_tokens == 0:
        if context is None:
            return None
        if context <= rl.max_tokens:
            raise ConfigError(f"rl.max_tokens={rl.max_tokens} leaves no room for a prompt in the model's context "
                              f"length of {context} tokens ({model / 'config.json'})")
        return context - rl.max_tokens
    if context is not None and rl.max_prompt_tokens + rl.max_tokens > context:
        raise ConfigError(f"rl.max_prompt_tokens={rl.max_prompt_tokens} plus rl.max_tokens={rl.max_tokens} is more than "
                          f"the model's context length of {context} tokens ({model / 'config.json'}): lower one")
    return rl.max_prompt_tokens


def measure(config: RunConfig, split: str) -> Measured:
    """``split``'s tasks rendered, counted and filtered (ConfigError when none is left)."""
    source = tasks.for_split(config, split)
    tasks.read(source)  # a missing file or a bad row: ConfigError, before the stat below
    mtime_ns, size = (0, 0) if source.generated else (lambda st: (st.st_mtime_ns, st.st_size))(source.path.stat())
    model = config.model_path
    tokenizer_files = tuple((p.name, p.stat().st_mtime_ns) for p in sorted(model.glob("tokenizer*")) if p.is_file())
    m = _measure(source, mtime_ns, size, model, tokenizer_files, config.data.system_prompt, limit(config))
    if not m.tasks:
        what = "the longest rl.max_prompt_tokens allows" if config.rl.max_prompt_tokens else (
            f"the model's context length less rl.max_tokens={config.rl.max_tokens}")
        raise ConfigError(f"every prompt of {source.path} is longer than {m.limit} tokens ({what}); the shortest has "
                          f"{m.shortest} tokens: raise rl.max_prompt_tokens or lower rl.max_tokens")
    return m


@functools.lru_cache(maxsize=4)
def _measure(source: tasks.TaskSource, _mtime_ns: int, _size: int, model: Path, _tokenizer_files: tuple,
             system_prompt: str, most: int | None) -> Measured:
    task_list = tasks.read(source)
    texts = render_all(task_list, model, system_prompt)
    lengths = count_tokens(list(texts.values()), model)
    fits = {t: n <= most for t, n in zip(texts, lengths)} if most is not None else {t: True for t in texts}
    kept = [t for t in task_list if fits[t["id"]]]
    return Measured(kept, texts, len(task_list) - len(kept), len(task_list), most, min(lengths), max(lengths))


def render_all(task_list: list[dict], model: Path, system_prompt: str) -> dict[str, str]:
    """Task id -> rendered prompt; the model's chat template is loaded only when needed."""
    tokenizer = None
    if tasks.needs_chat_template([task_list], system_prompt):
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(model))
        except Exception as e:  # noqa: BLE001 - transformers raises many kinds for a bad directory
            raise ConfigError(f"cannot load the tokenizer of the model {model} for its chat template: {type(e).__name__}: {e}") from None
    return {t["id"]: tasks.render(t["prompt"], tokenizer, system_prompt) for t in task_list}


def count_tokens(texts: list[str], model: Path) -> list[int]:
    """Tokens the engine makes of each text (special tokens included)."""
    path = model / "tokenizer.json"
    try:
        if path.is_file():
            from tokenizers import Tokenizer

            return [len(e.ids) for e in Tokenizer.from_file(str(path)).encode_batch(texts, add_special_tokens=True)]
        from transformers import AutoTokenizer  # a tokenizer without tokenizer.json (sentencepiece only)

        return [len(ids) for ids in AutoTokenizer.from_pretrained(str(model))(texts)["input_ids"]]
    except Exception as e:  # noqa: BLE001 - tokenizers and transformers raise many kinds for a bad directory
        raise ConfigError(f"cannot load the tokenizer of the model {model} to measure the prompts: {type(e).__name__}: {e}") from None
