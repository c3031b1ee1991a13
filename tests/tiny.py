"""Tiny models built from configs in code (no download), shared by the tests."""

from __future__ import annotations

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

VOCAB = 320


def tiny_config(arch: str = "llama", *, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                vocab: int = VOCAB, max_pos: int = 512, **kw):
    common = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_pos,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
    )
    common.update(kw)
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "mistral":
        return MistralConfig(sliding_window=None, **common)
    if arch == "qwen2":
        return Qwen2Config(use_sliding_window=False, **common)
    raise ValueError(arch)


def tiny_model(arch: str = "llama", seed: int = 0, **kw):
    torch.manual_seed(seed)
    cls = {"llama": LlamaForCausalLM, "mistral": MistralForCausalLM, "qwen2": Qwen2ForCausalLM}[arch]
    return cls(tiny_config(arch, **kw)).eval()


def tiny_tokenizer():
    """A real fast byte-level BPE tokenizer trained in memory on a few sentences (vocab = VOCAB)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    text = ["the quick brown fox jumps over the lazy dog", "héllo wörld ✓ naïve café", "distill the teacher"] * 5
    tok.train_from_iterator(text, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant: {% endif %}"
    )
    return fast


def save_tiny(path, arch: str = "llama", seed: int = 0, **kw):
    """A tiny model + tokenizer written as an HF directory; returns the path."""
    model = tiny_model(arch, seed=seed, **kw)
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path
