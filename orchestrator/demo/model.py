"""The demo policy: a tiny Llama-architecture model, made locally from a seed; the chat
demo's is a Qwen2-architecture model of the same size with its own tokenizer.

Standard architectures so that vLLM serves the same checkpoint; head dim 32 because vLLM's
CPU attention needs at least that. Saved in Hugging Face format: ``config.json``,
``model.safetensors``, ``generation_config.json`` and the tokenizer files.
"""

from __future__ import annotations

from pathlib import Path

from orchestrator.demo import tokenizer as demo_tokenizer
from orchestrator.engine.loading import load  # noqa: F401 - demo_model.load: how the engine loads a model

HIDDEN = 64
HEADS = 2  # head dim 32
LAYERS = 2
MAX_POSITIONS = 64
CHAT_MAX_POSITIONS = 128
"""A chat prompt is 24 tokens and its answer at most 8 (rl.max_tokens); the rest is room
for a system prompt (data.system_prompt). Positions are rotary: the room costs nothing."""


def _quiet() -> None:
    """transformers' progress bars are noise in rank logs."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def _size() -> dict:
    """What the two demo models share: their size."""
    return dict(hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                num_key_value_heads=HEADS, tie_word_embeddings=False)


def config():
    from transformers import LlamaConfig

    vocab = demo_tokenizer.build().get_vocab()
    return LlamaConfig(
        vocab_size=len(vocab),
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=vocab[demo_tokenizer.BOS],
        eos_token_id=vocab[demo_tokenizer.EOS],
        pad_token_id=vocab[demo_tokenizer.PAD],
        torch_dtype="float32",
        **_size(),
    )


def create(seed: int):
    """A freshly initialised model (deterministic for a seed)."""
    import torch
    from transformers import LlamaForCausalLM

    _quiet()
    torch.manual_seed(seed)
    return LlamaForCausalLM(config())


def chat_config(tokenizer):
    """The chat demo's Qwen2 configuration for ``tokenizer`` (demo/chat_tokenizer.py)."""
    from transformers import Qwen2Config

    from orchestrator.demo import chat_tokenizer

    vocab = tokenizer.get_vocab()
    return Qwen2Config(
        vocab_size=len(vocab),
        max_position_embeddings=CHAT_MAX_POSITIONS,
        max_window_layers=LAYERS,
        bos_token_id=None,
        eos_token_id=vocab[chat_tokenizer.EOS],
        pad_token_id=vocab[chat_tokenizer.PAD],
        dtype="float32",
        **_size(),
    )


def create_chat(seed: int, tokenizer, initializer_range: float | None = None):
    """A freshly initialised chat model for ``tokenizer`` (deterministic for a seed), its weights
    drawn with ``initializer_range`` as their standard deviation (None: the config's, 0.02). Its
    generation config ends a sample at ``<|im_end|>`` or ``<|endoftext|>``, as Qwen2's do."""
    import torch
    from transformers import GenerationConfig, Qwen2ForCausalLM

    from orchestrator.demo import chat_tokenizer

    _quiet()
    torch.manual_seed(seed)
    config = chat_config(tokenizer)
    if initializer_range is not None:
        config.initializer_range = initializer_range
    model = Qwen2ForCausalLM(config)
    vocab = tokenizer.get_vocab()
    model.generation_config = GenerationConfig(
        bos_token_id=None, eos_token_id=[vocab[chat_tokenizer.IM_END], vocab[chat_tokenizer.ENDOFTEXT]],
        pad_token_id=vocab[chat_tokenizer.PAD])
    return model


def save(model, directory: Path, tokenizer=None) -> None:
    """The model and its tokenizer files: ``tokenizer``'s, or the default demo's when None."""
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    if tokenizer is None:
        demo_tokenizer.save(directory)
    else:
        tokenizer.save_pretrained(directory)
