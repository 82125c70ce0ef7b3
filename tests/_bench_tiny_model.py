"""A tiny plain Qwen3 model (random weights) with a locally trained tokenizer, for harness tests.

Nothing is downloaded: the tokenizer is a byte-level BPE trained here on a few paragraphs,
the weights are random. The chat template understands ``enable_thinking`` (thinking off
pre-fills an empty think block, the Qwen3 convention) so that the reasoning parser has
``<think>``/``</think>`` tokens to work with. The model exists to exercise the benchmark
harness against a real vLLM server; its output is noise and its speed says nothing.

Usage: python tests/_bench_tiny_model.py OUT_DIR
"""
from __future__ import annotations

import json
import os
import sys

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]

# Qwen3-style template, reduced to what the harness sends (system/user/assistant turns).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)

_TRAINING_TEXT = [
    "The invoice lists three items, a total, a due date and the name of the customer.",
    "2026-01-04 12:00:01 INFO worker 3 started; 2026-01-04 12:00:02 WARN disk at 91 percent.",
    '{"id": 1, "name": "valve", "price": 12.50, "tags": ["brass", "spare"]}',
    "def merge_sort(items):\n    if len(items) <= 1:\n        return items\n",
    "class Node:\n    def __init__(self, key):\n        self.key = key\n        self.left = None\n",
    "How many positive integers below one thousand are multiples of seven? Think step by step.",
    "The lighthouse keeper counted the ships that passed in the fog each night of the winter.",
    "Speculative decoding drafts several tokens and the target model verifies them in one round.",
]


def build_tokenizer(vocab_size: int = 1024):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_TRAINING_TEXT * 20, trainer=trainer)
    return tok


def make_tiny_model(out_dir: str, seed: int = 0) -> str:
    """Write config, random safetensors weights, tokenizer and chat template to out_dir."""
    import torch
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    os.makedirs(out_dir, exist_ok=True)
    tok = build_tokenizer()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)

    torch.manual_seed(seed)
    vocab = tok.get_vocab_size()
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        eos_token_id=tok.token_to_id("<|im_end|>"),
        pad_token_id=tok.token_to_id("<|endoftext|>"),
        bos_token_id=None,
    )
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out_dir, safe_serialization=True)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": config.eos_token_id, "pad_token_id": config.pad_token_id}, f)
    return out_dir


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/_bench_tiny_model.py OUT_DIR")
    print(make_tiny_model(sys.argv[1]))
