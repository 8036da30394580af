"""The demo policy: a tiny Llama-architecture model, made locally from a seed.

Llama so that vLLM serves the same checkpoint; head dim 32 because vLLM's CPU attention
needs at least that. Saved in Hugging Face format: ``config.json``, ``model.safetensors``,
``generation_config.json`` and the tokenizer files.
"""

from __future__ import annotations

from pathlib import Path

from orchestrator.demo import tokenizer as demo_tokenizer

HIDDEN = 64
HEADS = 2  # head dim 32
LAYERS = 2
MAX_POSITIONS = 64


def _quiet() -> None:
    """transformers' progress bars are noise in rank logs."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def config():
    from transformers import LlamaConfig

    vocab = demo_tokenizer.build().get_vocab()
    return LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=HIDDEN,
        intermediate_size=4 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=vocab[demo_tokenizer.BOS],
        eos_token_id=vocab[demo_tokenizer.EOS],
        pad_token_id=vocab[demo_tokenizer.PAD],
        tie_word_embeddings=False,
        torch_dtype="float32",
    )


def create(seed: int):
    """A freshly initialised model (deterministic for a seed)."""
    import torch
    from transformers import LlamaForCausalLM

    _quiet()
    torch.manual_seed(seed)
    return LlamaForCausalLM(config())


def save(model, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    demo_tokenizer.save(directory)


def load(directory: Path):
    """Model and tokenizer from a Hugging Face directory (safetensors only: nothing is unpickled)."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    _quiet()
    model = LlamaForCausalLM.from_pretrained(directory, use_safetensors=True)
    return model, AutoTokenizer.from_pretrained(directory)
