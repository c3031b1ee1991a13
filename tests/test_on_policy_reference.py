"""On-policy rollouts of a hybrid (per-head roles) student against naive references: a stand-alone engine on a copy
of the weights after each optimizer step, and a per-row, unpadded teacher–student forward for the loss."""

from __future__ import annotations

import copy

import pytest
import torch

import attention
from core.tiny import tiny_model, tiny_tokenizer
from distill.model import DistillModel, LossConfig
from distill.on_policy import OnPolicy, OnPolicyError, OnPolicySettings
from serve.engine import Engine

VOCAB = 40  # small: EOS (id 2) is sampled now and then, so rows end at different lengths (padding after the stop)
PROMPT, NEW, ROWS = 12, 16, 3


def _hand_forward_kl(student, teacher, prompts: list[list[int]], completions: list[list[int]]) -> torch.Tensor:
    """Mean over generated tokens of KL(teacher || student) at the position predicting each, one unpadded row at a
    time (``[prompt + completion]`` per forward)."""
    terms = []
    for p, c in zip(prompts, completions):
        ids = torch.tensor([p + c])
        log_q = student(input_ids=ids).logits[0].double().log_softmax(-1)  # [len, vocab]
        with torch.no_grad():
            log_p = teacher(input_ids=ids).logits[0].double().log_softmax(-1)
        for i in range(len(c)):
            pos = len(p) - 1 + i  # predicts c[i]
            terms.append((log_p[pos].exp() * (log_p[pos] - log_q[pos])).sum())
    return torch.stack(terms).mean()


def test_hybrid_student_rollouts_masks_and_loss_match_references_across_steps():
    teacher = tiny_model(seed=1, layers=2, vocab=VOCAB)
    student = tiny_model(seed=2, layers=2, vocab=VOCAB)
    attention.retrofit(student, attention.HybridAttentionConfig(sink_tokens=2, window=8, global_every=0,
                                                                full_heads={0: [1]}))  # rollouts pass the window
    student.train()
    cfg = LossConfig(kd_weight=1.0, kd_kind="forward_kl", temperature=1.0, beta=0.5, kd_chunk_size=1024,
                     ce_weight=1.0, focal_weight=0.0, focal_alpha=0.25, focal_gamma=2.0, hidden_weight=0.0,
                     hidden_layers=["relative"], hidden_kind="nmse", attn_weight=0.0, attn_layers=[],
                     attn_num_queries=64)
    model = DistillModel(student, teacher, cfg)
    settings = OnPolicySettings(fraction=1.0, max_new_tokens=NEW, temperature=1.0, prompt_tokens=PROMPT, seed=0)
    policy = OnPolicy(settings, model, model, tiny_tokenizer(), ROWS)
    blocks = torch.randint(3, VOCAB, (ROWS, 32), generator=torch.Generator().manual_seed(0))
    prompts = [row[:PROMPT].tolist() for row in blocks]
    opt = torch.optim.AdamW(student.parameters(), lr=0.05)
    generated, lengths = 0, []
    for step in range(2):
        before = copy.deepcopy(student)  # the weights this step's rollouts must come from
        batch = policy.generate(blocks, step, 0)
        alone = Engine(model=copy.deepcopy(before), tokenizer=tiny_tokenizer(), max_batch=ROWS,
                       max_seq_len=PROMPT + NEW).generate(prompts, policy.params_for(ROWS, step, 0))
        completions = [c.token_ids + ([c.stop_token] if c.stop_token is not None else []) for c in alone]
        lengths += [len(c) for c in completions]
        generated += sum(map(len, completions))
        for r, (p, c) in enumerate(zip(prompts, completions)):
            n = len(p) + len(c)
            assert batch["input_ids"][r, :n].tolist() == p + c
            assert batch["attention_mask"][r].tolist() == [1] * n + [0] * (batch["input_ids"].shape[1] - n)
            # labels: exactly the generated tokens (the stop included), not the prompt, not the padding after it
            assert batch["labels"][r].tolist() == [-100] * len(p) + c + [-100] * (batch["input_ids"].shape[1] - n)
        saved, model.loss_config = model.loss_config, policy.loss_config
        try:
            out = model(**batch)
        finally:
            model.loss_config = saved
        before.train()
        hand = _hand_forward_kl(before, teacher, prompts, completions)
        assert out.tokens == sum(map(len, completions))
        assert out.loss.item() == pytest.approx(hand.item(), rel=1e-5, abs=1e-7)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
    assert min(lengths) < NEW == max(lengths)  # some row stopped early: its padding was checked
    assert policy.stats(1.0)["rollout_tokens"] == generated  # generated tokens only, not the prompts


def test_a_student_with_padding_rows_past_the_teachers_vocabulary_samples_the_shared_one():
    """Student vocab 384, teacher and tokenizer 320 (DistillModel compares the first 320 logits): rollouts are drawn
    from the student's softmax over those 320, the distribution the loss uses. Sampling all 384 rows gave ids the
    teacher has no embedding for: 'IndexError: index out of range in self' in the on-policy forward."""
    import warnings

    teacher = tiny_model(seed=1, layers=2, vocab=320)
    student = tiny_model(seed=2, layers=1, vocab=384).train()
    cfg = LossConfig(kd_weight=1.0, kd_kind="reverse_kl", temperature=1.0, beta=0.5, kd_chunk_size=1024,
                     ce_weight=1.0, focal_weight=0.0, focal_alpha=0.25, focal_gamma=2.0, hidden_weight=0.0,
                     hidden_layers=["relative"], hidden_kind="nmse", attn_weight=0.0, attn_layers=[],
                     attn_num_queries=64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "differ only in padding rows"
        model = DistillModel(student, teacher, cfg, tokenizer_size=320)
    settings = OnPolicySettings(fraction=1.0, max_new_tokens=NEW, temperature=1.0, prompt_tokens=4, seed=0)
    policy = OnPolicy(settings, model, model, tiny_tokenizer(), ROWS)
    blocks = torch.randint(3, 320, (ROWS, 24), generator=torch.Generator().manual_seed(0))
    reference = copy.deepcopy(student).eval()
    out = policy.forward(blocks, 0, 0, torch.device("cpu"))
    prompts = [row[:4].tolist() for row in blocks]
    alone = Engine(model=reference, tokenizer=tiny_tokenizer(), max_batch=ROWS, max_seq_len=4 + NEW)
    completions = [c.token_ids + ([c.stop_token] if c.stop_token is not None else [])
                   for c in alone.generate(prompts, policy.params_for(ROWS, 0, 0))]
    assert max(max(c) for c in completions) < 320 and out.tokens == sum(map(len, completions)) > 0
    terms = []  # reverse KL over the shared 320 logits at each generated token, row by row
    for p, c in zip(prompts, completions):
        ids = torch.tensor([p + c])
        with torch.no_grad():
            log_q = reference(input_ids=ids).logits[0, :, :320].double().log_softmax(-1)
            log_p = teacher(input_ids=ids).logits[0].double().log_softmax(-1)
        terms += [(log_q[i].exp() * (log_q[i] - log_p[i])).sum() for i in range(len(p) - 1, len(p) + len(c) - 1)]
    assert out.loss.item() == pytest.approx(torch.stack(terms).mean().item(), rel=1e-5, abs=1e-7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wide = DistillModel(tiny_model(seed=2, layers=1, vocab=640), teacher, cfg, tokenizer_size=320)
    with pytest.raises(OnPolicyError, match="320 vocabulary rows past the 320 it shares with the teacher") as err:
        OnPolicy(settings, wide, wide, tiny_tokenizer(), ROWS)  # more than a request's logit_bias can ban
    assert "\n" not in str(err.value)
