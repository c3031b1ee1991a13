"""Tiny random models built in code, for smoke runs and CI (no download, seconds to train).

``tiny-random`` in a recipe's ``teacher=`` builds a 4-layer, width-64 Llama with grouped-query
attention and a byte-level BPE tokenizer trained in memory on a slice of the built-in corpus.
The same seed gives the same model and tokenizer in every process (DDP/ZeRO ranks agree).
"""

from __future__ import annotations

import torch

TINY = "tiny-random"


def tiny_tokenizer(vocab_size: int = 512):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from distill.data import stdlib_docs

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(stdlib_docs("train")[:200], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
    )
    return fast


def tiny_teacher(seed: int = 0, *, layers: int = 4, hidden: int = 64, vocab_size: int = 512,
                 max_position_embeddings: int = 1024):
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_position_embeddings,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
    )
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    torch.random.set_rng_state(state)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return model
