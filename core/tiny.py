"""Tiny random models built in code, for smoke runs, tests and CI (no download, seconds to train).

* :func:`tiny_model` / :func:`tiny_config`: 2-layer, width-64 Llama / Mistral / Qwen2 models with
  grouped-query attention, for unit tests.
* ``tiny-random`` in a recipe's ``teacher=`` (:data:`TINY`): :func:`tiny_teacher` (4 layers, width
  64, vocab 512) with :func:`tiny_teacher_tokenizer`, a byte-level BPE trained in memory on a slice
  of the built-in corpus. The same seed gives the same model and tokenizer in every process, so
  DDP/ZeRO ranks agree.
"""

from __future__ import annotations

from pathlib import Path

import torch

from attention import SUPPORTED_MODEL_TYPES

TINY = "tiny-random"
VOCAB = 320
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
_SENTENCES = ["the quick brown fox jumps over the lazy dog", "héllo wörld ✓ naïve café", "distill the teacher"]


def tiny_config(arch: str = "llama", *, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                vocab: int = VOCAB, max_pos: int = 512, **kw):
    """A small config of ``arch`` (``llama``, ``mistral`` or ``qwen2``); ``kw`` overrides any field."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

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
    raise ValueError(f"tiny models exist for {', '.join(SUPPORTED_MODEL_TYPES)}, not {arch!r}")


def tiny_model(arch: str = "llama", seed: int = 0, **kw):
    """A randomly initialised model of :func:`tiny_config` in eval mode (seeds the global RNG)."""
    from transformers import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cls = {"llama": LlamaForCausalLM, "mistral": MistralForCausalLM, "qwen2": Qwen2ForCausalLM}[arch]
    return cls(tiny_config(arch, **kw)).eval()


def tiny_tokenizer(texts: list[str] | None = None, vocab_size: int = VOCAB):
    """A real fast byte-level BPE tokenizer trained in memory on ``texts`` (a few sentences by default)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts if texts is not None else _SENTENCES * 5, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_teacher_tokenizer():
    """The ``tiny-random`` recipe tokenizer: vocab 512, trained on 200 built-in docstrings."""
    from core.corpus import stdlib_docs

    return tiny_tokenizer(stdlib_docs("train")[:200], vocab_size=512)


TINY_TEACHER = dict(layers=4, hidden=64, vocab=512, max_pos=1024)
"""The ``tiny-random`` teacher's shape (:func:`tiny_config` keywords)."""


def tiny_teacher_config():
    """The ``tiny-random`` teacher's config, without building its weights."""
    return tiny_config("llama", **TINY_TEACHER)


def tiny_teacher(seed: int = 0, *, layers: int = TINY_TEACHER["layers"], hidden: int = TINY_TEACHER["hidden"],
                 vocab_size: int = TINY_TEACHER["vocab"], max_position_embeddings: int = TINY_TEACHER["max_pos"]):
    """The ``tiny-random`` recipe teacher (Llama, GQA); leaves the global RNG as it found it."""
    from transformers import GenerationConfig

    with torch.random.fork_rng(devices=[]):
        model = tiny_model("llama", seed, layers=layers, hidden=hidden, vocab=vocab_size,
                           max_pos=max_position_embeddings).train()
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return model


def save_tiny(path: str | Path, arch: str = "llama", seed: int = 0, **kw) -> str | Path:
    """A tiny model + tokenizer written as an HF directory; returns the path."""
    model = tiny_model(arch, seed=seed, **kw)
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path
