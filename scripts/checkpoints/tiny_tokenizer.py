"""A small byte-level BPE tokenizer built locally (no download) for the tiny test checkpoint.

It has the special tokens a Qwen3-style chat needs (``<|im_start|>``, ``<|im_end|>``,
``<|endoftext|>``) and the markup tokens the reasoning and tool-call parsers look for
(``<think>``, ``</think>``, ``<tool_call>``, ``</tool_call>``, ``<tool_response>``,
``</tool_response>``), and ships a chat template (``tiny_chat_template.jinja`` next to this
file) that supports thinking on and off (the ``enable_thinking`` chat-template argument) and
tool definitions, tool calls and tool results.

Training is deterministic: the same corpus (written here) and the same vocabulary size give the
same merges, so two runs write byte-identical ``tokenizer.json`` files.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

CONTROL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Markup tokens stay visible in decoded text (special=False) so that vLLM's reasoning and
# tool-call parsers can find them in the output, as with the real Qwen tokenizers.
MARKUP_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

TEMPLATE_PATH = Path(__file__).with_name("tiny_chat_template.jinja")

# Our own training text: enough variety for a few hundred merges of common English and JSON.
CORPUS = [
    "The weights stay packed in memory and are decoded in registers right before the multiply.",
    "A small model is enough to prove that the loader reads every code and scale unchanged.",
    "Each request asks the server for the log probability of every token in the prompt.",
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun.",
    "Please think step by step, then give a short answer to the question about the weather.",
    "What is the capital of France? The capital of France is Paris, a city on the Seine.",
    "Call the tool get_weather with the city name, then report the temperature in Celsius.",
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    '{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}',
    "You are a helpful assistant. Answer briefly and say when you do not know something.",
    "Numbers like 1, 2, 3, 10, 42, 100 and 2026 appear in dates, counts and prices.",
    "system user assistant tool function arguments parameters required description",
    "In the morning we read the news, in the afternoon we write code, and at night we rest.",
    "Tests must assert something that could be false; a green run proves nothing otherwise.",
    "The route table picks a kernel from the number of rows in the batch for every call.",
]


def _train(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    n_special = len(CONTROL_TOKENS) + len(MARKUP_TOKENS)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - n_special,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    return tok


def build_tokenizer(vocab_size: int):
    """A ``tokenizers.Tokenizer`` whose ids all fit in ``vocab_size``."""
    from tokenizers import AddedToken

    tok = _train(vocab_size)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CONTROL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    size = tok.get_vocab_size(with_added_tokens=True)
    if size > vocab_size:
        raise ValueError(f"tokenizer has {size} ids but the model's vocabulary holds {vocab_size}")
    return tok


def chat_template() -> str:
    return TEMPLATE_PATH.read_text()


def write_tokenizer(out_dir: str | os.PathLike, vocab_size: int, model_max_length: int) -> dict:
    """Write tokenizer.json, tokenizer_config.json and chat_template.jinja; return the ids."""
    out = Path(out_dir)
    tok = build_tokenizer(vocab_size)
    tok.save(str(out / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in CONTROL_TOKENS + MARKUP_TOKENS}
    added = {
        str(ids[t]): {
            "content": t, "lstrip": False, "rstrip": False, "normalized": False,
            "single_word": False, "special": t in CONTROL_TOKENS,
        }
        for t in CONTROL_TOKENS + MARKUP_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "errors": "replace",
        "added_tokens_decoder": added,
        "chat_template": chat_template(),
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "chat_template.jinja").write_text(chat_template())
    return ids
