"""The chat demo's tokenizer: a byte-level BPE in the manner of Qwen2's, trained locally with
Hugging Face ``tokenizers`` on the chat-rendered demo prompts and their target completions,
and saved in the standard files (``tokenizer.json``, ``tokenizer_config.json`` and the chat
template), so that ``transformers.AutoTokenizer`` and vLLM load exactly what the engine uses.

- Pre-tokenized by Qwen2's split pattern (digits one per token, ``\\boxed`` one word), then
  mapped to bytes (``ByteLevel``): any text encodes, nothing is unknown.
- Special tokens ``<|endoftext|>`` (padding), ``<|im_start|>``, ``<|im_end|>`` (the end of a
  turn: generation ends there); no BOS is added.
- The ChatML template: ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message, and
  ``<|im_start|>assistant\\n`` when the generation prompt is asked for. ``tools`` (the OpenAI
  API's schemas) come first as a system turn naming each function and its parameters,
  ``Tools: calc(expression)``: the tiny model's context holds no JSON schema. An assistant
  message's ``tool_calls`` are written in the hermes format of Qwen's templates,
  ``<tool_call>{"name": "calc", "arguments": {"expression": "123*45"}}</tool_call>``.
- The tool demo's tokenizer has ``<tool_call>`` and ``</tool_call>`` as tokens of their own
  (added, not special: decoded text keeps them), as Qwen2.5's has.

Deterministic: the same corpus gives a byte-identical ``tokenizer.json``.
"""

from __future__ import annotations

import functools
import re

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIALS = [ENDOFTEXT, IM_START, IM_END]
PAD, EOS = ENDOFTEXT, IM_END
TOOL_TOKENS = ["<tool_call>", "</tool_call>"]
VOCAB_SIZE = 400
"""An upper bound: the demos' corpora run out of pairs to merge before it (256 bytes, 3
special tokens and some dozens of merges)."""
SPLIT_PATTERN = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
"""Qwen2's pre-tokenizer pattern."""
CHAT_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\nTools: ' }}"
    "{%- for tool in tools %}{%- set f = tool.function if tool.function is defined else tool %}"
    "{{- f.name + '(' + (f.parameters.properties if f.parameters is defined and f.parameters.properties is defined else {}) | join(', ') + ')' }}"
    "{%- if not loop.last %}{{- ', ' }}{%- endif %}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') }}"
    "{%- if message['role'] == 'assistant' and message['tool_calls'] %}{%- for call in message['tool_calls'] %}"
    "{%- set f = call.function if call.function is defined else call %}"
    "{{- '<tool_call>{\"name\": \"' + f.name + '\", \"arguments\": ' }}"
    "{{- f.arguments if f.arguments is string else f.arguments | tojson }}{{- '}</tool_call>' }}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def chatml(messages: list[dict], add_generation_prompt: bool = False, tools: list[dict] | None = None) -> str:
    """What :data:`CHAT_TEMPLATE` renders (the corpus is made before there is a tokenizer to
    render it): the template itself, through jinja2 as ``transformers`` runs it."""
    return _template().render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt)


@functools.cache
def _template():
    import json

    import jinja2

    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x: json.dumps(x, ensure_ascii=False)
    return env.from_string(CHAT_TEMPLATE)


def corpus(tasks: list[dict], target) -> list[str]:
    """The texts BPE learns from: each task's conversation, its prompt then ``target(task)``
    as the assistant's turn, cut at the special tokens (they are never merged with text)."""
    return conversations_corpus([[*task["prompt"], {"role": "assistant", "content": target(task)}] for task in tasks])


def conversations_corpus(conversations: list[list[dict]], tools: list[dict] | None = None) -> list[str]:
    """The texts BPE learns from whole conversations (the tool demo's: several turns each,
    with its ``tools``), rendered and cut at the special and tool-call tokens."""
    special = re.compile("|".join(map(re.escape, SPECIALS + TOOL_TOKENS)))
    texts = []
    for messages in conversations:
        texts += [piece for piece in special.split(chatml(messages, tools=tools)) if piece]
    return texts


def build(texts: list[str], added: list[str] = ()) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    return tok


def fast(texts: list[str], *, tools: bool = False) -> "PreTrainedTokenizerFast":  # noqa: F821
    """The trained tokenizer as ``transformers`` uses it: EOS ``<|im_end|>``, padding
    ``<|endoftext|>``, no BOS, the ChatML template; with ``tools``, the tool-call tokens."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=build(texts, TOOL_TOKENS if tools else []), eos_token=EOS, pad_token=PAD,
                                   additional_special_tokens=[IM_START], chat_template=CHAT_TEMPLATE)
