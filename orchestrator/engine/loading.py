"""A Hugging Face model directory loaded for serving: the model, of whichever architecture its
``config.json`` names, in the dtype it names, and its tokenizer; safetensors only, so nothing
is unpickled."""

from __future__ import annotations

from pathlib import Path


def load(directory: Path):
    """(model, tokenizer) from ``directory``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # progress bars are noise in a rank's log
    hf_logging.set_verbosity_error()
    model = AutoModelForCausalLM.from_pretrained(directory, use_safetensors=True)
    return model, AutoTokenizer.from_pretrained(directory)
