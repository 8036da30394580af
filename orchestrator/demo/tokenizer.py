"""A character-level tokenizer for the demo tasks, built with Hugging Face ``tokenizers``
and saved in the standard files (``tokenizer.json``, ``tokenizer_config.json``), so that
``transformers.AutoTokenizer`` and vLLM load exactly what the engine uses.

Every encoding starts with ``<s>``; generation ends at ``</s>``.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIALS = [PAD, BOS, EOS, UNK]
CHARS = list("0123456789+-*=") + [" "]


def build() -> Tokenizer:
    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, vocab[BOS])])
    tok.add_special_tokens(SPECIALS)
    return tok


def save(directory: Path) -> "PreTrainedTokenizerFast":  # noqa: F821
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=build(), bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK)
    fast.save_pretrained(directory)
    return fast
