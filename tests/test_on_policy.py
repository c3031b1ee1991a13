"""On-policy distillation: rollouts from serve's engine over the live student, loss on generated tokens."""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from core.config import ConfigError
from core.tiny import tiny_model, tiny_tokenizer
from distill.model import DistillModel, LossConfig
from distill.on_policy import (
    OnPolicy,
    OnPolicyError,
    OnPolicySettings,
    chat_prompts,
    is_on_policy,
    rollout_batch,
)
from serve.engine import Engine

ROOT = Path(__file__).resolve().parents[1]


def _pair(kind="reverse_kl", temperature=1.0, beta=0.5):
    teacher = tiny_model(seed=1, layers=2)
    student = tiny_model(seed=2, layers=1).train()
    # LossConfig has no defaults of its own: every term spelled out.
    cfg = LossConfig(kd_weight=1.0, kd_kind=kind, temperature=temperature, beta=beta, kd_chunk_size=1024, ce_weight=1.0,
                     focal_weight=0.0, focal_alpha=0.25, focal_gamma=2.0, hidden_weight=0.0, hidden_layers=["relative"],
                     hidden_kind="nmse", attn_weight=0.0, attn_layers=[], attn_num_queries=64)
    return teacher, student, DistillModel(student, teacher, cfg)


def _policy(model, fraction=1.0, temperature=1.0, max_new=6, prompt=4, batch=3, seed=0, kd_kind=None, rows=0,
            rollout_rows=0):
    s = OnPolicySettings(fraction=fraction, max_new_tokens=max_new, temperature=temperature, prompt_tokens=prompt,
                         seed=seed, kd_kind=kd_kind, rows=rows, rollout_rows=rollout_rows)
    return OnPolicy(s, model, model, tiny_tokenizer(), batch)


def test_on_policy_share_is_exact_and_spread():
    for fraction in (0.0, 0.25, 0.5, 1 / 3, 1.0):
        picks = [is_on_policy(step, j, 4, fraction) for step in range(30) for j in range(4)]
        assert sum(picks) == round(120 * fraction)
    picks = [is_on_policy(s, 0, 1, 0.5) for s in range(6)]
    assert picks == [False, True] * 3  # evenly spread, not all at the start


def test_rollout_batch_labels_only_generated_tokens():
    batch = rollout_batch([[5, 6, 7], [8]], [[9, 10], []], pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 9, 10], [8, 0, 0, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    assert batch["labels"].tolist() == [[-100, -100, -100, 9, 10], [-100] * 5]


def _hand_loss(student, teacher, prompts, completions, kind, temperature, beta):
    """Per row, unpadded full forwards; the divergence at each position that predicts a generated token."""
    terms = []
    for p, c in zip(prompts, completions):
        if not c:
            continue
        ids = torch.tensor([p + c])
        zs = student(input_ids=ids).logits[0].double() / temperature
        with torch.no_grad():
            zt = teacher(input_ids=ids).logits[0].double() / temperature
        for i in range(len(c)):
            pos = len(p) - 1 + i  # this position predicts c[i]
            log_q, log_p = zs[pos].log_softmax(-1), zt[pos].log_softmax(-1)
            q, p_ = log_q.exp(), log_p.exp()
            if kind == "reverse_kl":
                d = (q * (log_q - log_p)).sum()
            elif kind == "forward_kl":
                d = (p_ * (log_p - log_q)).sum()
            elif kind == "skew_reverse_kl":  # KL(q || beta q + (1 - beta) p)
                m = beta * q + (1 - beta) * p_
                d = (q * (log_q - m.log())).sum()
            else:  # skew_kl: KL(p || beta p + (1 - beta) q)
                m = beta * p_ + (1 - beta) * q
                d = (p_ * (log_p - m.log())).sum()
            terms.append(d * temperature**2)
    return torch.stack(terms).mean()


@pytest.mark.parametrize("kind,temperature,beta,on_kind", [("reverse_kl", 1.0, 0.5, None), ("forward_kl", 2.0, 0.5, None),
                                                           ("skew_kl", 1.0, 0.1, None),
                                                           ("forward_kl", 1.0, 0.1, "skew_reverse_kl"),
                                                           ("forward_kl", 1.0, 0.5, "reverse_kl")])
def test_on_policy_step_equals_hand_computed_loss(kind, temperature, beta, on_kind):
    """``on_kind`` (the recipe's gen_kd_kind): the rollouts' divergence replaces kd_kind on them only."""
    teacher, student, model = _pair(kind, temperature, beta)
    policy = _policy(model, kd_kind=on_kind)
    kind = on_kind or kind
    blocks = torch.randint(3, 320, (3, 16), generator=torch.Generator().manual_seed(0))
    reference = copy.deepcopy(student)
    out = policy.forward(blocks, step=2, micro=1, device=torch.device("cpu"))
    assert model.loss_config.ce_weight == 1.0  # restored after the on-policy forward
    assert model.loss_config.kd_kind != on_kind  # the rollouts' divergence applied to them only
    assert float(out.ce) == 0.0  # the divergence only: no CE on the student's own samples

    # Same weights, same seeds, a stand-alone engine: the same continuations.
    prompts = [row[:4].tolist() for row in blocks]
    engine = Engine(model=reference, tokenizer=tiny_tokenizer(), max_batch=3, max_seq_len=10)
    completions = [c.token_ids for c in engine.generate(prompts, policy.params_for(3, 2, 1))]
    assert out.tokens == sum(len(c) for c in completions) > 0
    reference.train()
    hand = _hand_loss(reference, teacher, prompts, completions, kind, temperature, beta)
    assert out.loss.item() == pytest.approx(hand.item(), rel=1e-4, abs=1e-6)
    out.loss.backward()
    hand.backward()
    for (name, a), b in zip(student.named_parameters(), reference.parameters()):
        assert torch.allclose(a.grad, b.grad.float(), rtol=1e-3, atol=1e-6), name


def test_fewer_rollout_rows_roll_out_the_first_blocks_of_the_micro_batch():
    """gen_batch_size=2 of a 3-row micro-batch: the first two blocks' prompts, the same loss as a 2-row batch."""
    teacher, student, model = _pair("reverse_kl")
    blocks = torch.randint(3, 320, (3, 16), generator=torch.Generator().manual_seed(3))
    reference = copy.deepcopy(student)
    out = _policy(model, rows=2).forward(blocks, step=1, micro=0, device=torch.device("cpu"))
    twin = DistillModel(reference, teacher, model.loss_config)
    whole = _policy(twin, batch=2).forward(blocks[:2], step=1, micro=0, device=torch.device("cpu"))
    assert out.tokens == whole.tokens > 0
    assert out.loss.item() == pytest.approx(whole.loss.item(), rel=1e-6)
    prompts = [row[:4].tolist() for row in blocks[:2]]
    engine = Engine(model=copy.deepcopy(reference).eval(), tokenizer=tiny_tokenizer(), max_batch=2, max_seq_len=10)
    completions = [c.token_ids for c in engine.generate(prompts, _policy(twin).params_for(2, 1, 0))]
    assert out.tokens == sum(len(c) for c in completions)  # two rows rolled out, not three


def test_queued_rollout_rows_feed_the_next_on_policy_micro_batches():
    """gen_rollout_rows=3 with one row per micro-batch: one engine call serves three micro-batches, row by row."""
    _, student, model = _pair("reverse_kl")
    policy = _policy(model, rows=1, rollout_rows=3, temperature=0.9)
    first = torch.randint(3, 320, (3, 16), generator=torch.Generator().manual_seed(4))
    later = torch.randint(3, 320, (3, 16), generator=torch.Generator().manual_seed(5))
    prompts = [row[:4].tolist() for row in first]
    before = copy.deepcopy(student).eval()  # the weights the queued rows were sampled with
    engine = Engine(model=before, tokenizer=tiny_tokenizer(), max_batch=3, max_seq_len=10)
    expected = rollout_batch(prompts, [c.token_ids for c in engine.generate(prompts, policy.params_for(3, 0, 0))], 0)
    opt = torch.optim.AdamW(student.parameters(), lr=0.05)
    for step in range(3):  # micro-batches 1 and 2 train on queued rows although the weights changed (stale by design)
        batch = policy.generate(first if step == 0 else later, step, 0)
        longest = int(expected["attention_mask"][step].sum())
        assert torch.equal(batch["input_ids"][0, :longest], expected["input_ids"][step, :longest])
        assert batch["input_ids"].shape[0] == 1 and int(batch["attention_mask"].sum()) == longest
        assert torch.equal(batch["labels"][0, :longest], expected["labels"][step, :longest])
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
    assert policy.gen_tokens == sum(int((expected["labels"][r] != -100).sum()) for r in range(3))  # one decode call
    assert policy.queue == []
    fourth = policy.generate(later, 3, 0)  # the queue is empty: a fresh rollout from the current weights
    fresh = Engine(model=copy.deepcopy(student).eval(), tokenizer=tiny_tokenizer(), max_batch=3, max_seq_len=10)
    again = [row[:4].tolist() for row in later]
    alone = rollout_batch(again[:1], [fresh.generate(again, policy.params_for(3, 3, 0))[0].token_ids], 0)
    assert torch.equal(fourth["input_ids"], alone["input_ids"])
    assert len(policy.queue) == 2 and policy.stats(1.0)["rollout_calls"] == 2 and policy.micro_batches == 4


def test_rollouts_follow_weights_that_fused_adamw_updates_without_a_version_bump():
    """AdamW(fused=True) writes parameters without bumping Tensor._version: a new optimizer step must still
    rebuild the decode copies, or the rollouts come from the old weights."""
    _, student, model = _pair("forward_kl")
    blocks = torch.randint(3, 320, (3, 16), generator=torch.Generator().manual_seed(2))
    policy = _policy(model, temperature=0.8, max_new=8, prompt=8)
    opt = torch.optim.AdamW(student.parameters(), lr=0.05, fused=True)
    policy.generate(blocks, 0, 0)
    versions = [q._version for q in student.parameters()]
    policy.forward(blocks, 0, 1, torch.device("cpu")).loss.backward()
    opt.step()
    opt.zero_grad()
    assert [q._version for q in student.parameters()] == versions  # what made the version check blind
    during = policy.generate(blocks, 1, 0)
    prompts = [row[:8].tolist() for row in blocks]
    fresh = Engine(model=copy.deepcopy(student), tokenizer=tiny_tokenizer(), max_batch=3, max_seq_len=16)
    alone = rollout_batch(prompts, [c.token_ids for c in fresh.generate(prompts, policy.params_for(3, 1, 0))], 0)
    assert torch.equal(during["input_ids"], alone["input_ids"])


def test_rollouts_during_training_follow_the_live_weights():
    """After optimizer steps the training engine's rollouts equal a fresh engine's on a copy of the weights."""
    _, student, model = _pair("forward_kl")
    # Prompts longer than a prefix-cache block sharing their first 32 tokens: a prompt-prefix cache kept
    # across updates would restore keys/values of the old weights here (Rollouts turns it off).
    blocks = torch.randint(3, 320, (3, 48), generator=torch.Generator().manual_seed(1))
    blocks[:, :32] = blocks[0, :32]
    policy = _policy(model, temperature=0.8, max_new=8, prompt=40)
    rollouts = policy.rollouts
    opt = torch.optim.AdamW(student.parameters(), lr=0.05)
    before = policy.generate(blocks, 0, 0)
    policy.generate(blocks, 0, 1)
    assert rollouts.syncs == 1  # built for step 0's weights once; the same step does not rebuild them
    for step in range(2):
        policy.forward(blocks, step, 0, torch.device("cpu")).loss.backward()
        opt.step()
        opt.zero_grad()
    assert student.training  # rollouts leave the student in train mode
    during = policy.generate(blocks, 5, 0)
    assert rollouts.syncs == 3  # once per step that rolled out: 0, 1 (inside forward) and 5
    prompts = [row[:40].tolist() for row in blocks]
    fresh = Engine(model=copy.deepcopy(student), tokenizer=tiny_tokenizer(), max_batch=3, max_seq_len=48)
    alone = rollout_batch(prompts, [c.token_ids for c in fresh.generate(prompts, policy.params_for(3, 5, 0))], 0)
    assert torch.equal(during["input_ids"], alone["input_ids"])
    assert not torch.equal(before["input_ids"], during["input_ids"])  # the updates changed what is sampled
    # The engine decodes from the very module the optimizer updates (prefill reads its weights in place);
    # on CPU its fused decode copies exist and were refreshed; no prefix cache.
    engine = rollouts.engine
    assert engine.model.hf is student and engine.prefix_cache is None
    assert engine.model.lm_head.weight.data_ptr() == student.lm_head.weight.data_ptr()
    assert engine.model.fast_weight_bytes() > 0
    assert policy.stats(1.0)["rollout_tokens"] > 0


def test_stale_decode_copies_would_change_rollouts():
    """The refresh is what keeps rollouts right: skip it after an update and they differ from a fresh engine."""
    _, student, model = _pair("forward_kl")
    policy = _policy(model, temperature=0.8, max_new=8)
    blocks = torch.randint(3, 320, (3, 16), generator=torch.Generator().manual_seed(2))
    policy.generate(blocks, 0, 0)
    with torch.no_grad():
        for q in student.parameters():
            q.add_(torch.randn_like(q) * 0.5)
    policy.rollouts._synced = policy.rollouts._weights_version()  # pretend nothing changed (the same step)
    stale = policy.generate(blocks, 0, 1)
    prompts = [row[:4].tolist() for row in blocks]
    fresh = Engine(model=copy.deepcopy(student), tokenizer=tiny_tokenizer(), max_batch=3, max_seq_len=12)
    alone = rollout_batch(prompts, [c.token_ids for c in fresh.generate(prompts, policy.params_for(3, 0, 1))], 0)
    assert not torch.equal(stale["input_ids"], alone["input_ids"])
    policy.rollouts._synced = ()  # now let it see the change
    assert torch.equal(policy.generate(blocks, 0, 1)["input_ids"], alone["input_ids"])


def test_a_rollout_that_stops_keeps_its_stop_token_as_a_trained_target():
    """The student's decision to stop is a position the teacher judges too: a rollout that samples its EOS
    carries it as its last label (an engine completion leaves it out of token_ids)."""
    from serve.sampling import SamplingParams

    _, student, model = _pair("forward_kl")
    blocks = torch.randint(3, 320, (1, 8), generator=torch.Generator().manual_seed(4))
    prompt = blocks[0, :4].tolist()
    free = Engine(model=copy.deepcopy(student).eval(), tokenizer=tiny_tokenizer(), max_batch=1, max_seq_len=12)
    greedy = free.generate([prompt], [SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)])[0]
    first, second = greedy.token_ids[:2]
    assert first != second  # so the stop comes at the second token, not the first
    student.generation_config.eos_token_id = second  # the student's own second token now ends its turn
    student.config.eos_token_id = second
    policy = _policy(model, temperature=0.0, max_new=4, batch=1)
    batch = policy.generate(blocks, 0, 0)
    assert batch["input_ids"][0].tolist() == prompt + [first, second]
    assert batch["labels"][0].tolist() == [-100] * 4 + [first, second]
    assert int(policy.forward(blocks, 1, 0, torch.device("cpu")).tokens) == 2  # both targets count


def test_a_rollout_row_the_engine_failed_on_stops_the_step_in_one_line():
    """Non-finite logits make the engine finish a row with "error": that must not become an empty rollout."""
    _, student, model = _pair("forward_kl")
    policy = _policy(model, temperature=1.0, max_new=4)
    blocks = torch.randint(3, 320, (3, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        student.get_output_embeddings().weight[5] = float("nan")
    with pytest.raises(OnPolicyError, match=r"the engine failed on rollout rows \[0, 1, 2\]"):
        policy.generate(blocks, 0, 0)


def test_settings_errors_are_one_line_and_early():
    from distill.config import DistillConfig

    cases = [
        (dict(on_policy_fraction=1.5), "on_policy_fraction must be in [0, 1]"),
        (dict(on_policy_fraction=-0.1), "on_policy_fraction must be in [0, 1]"),
        (dict(on_policy_fraction=0.5, seq_len=64, gen_prompt_tokens=32, gen_max_new_tokens=64), "exceeds seq_len 64"),
        (dict(on_policy_fraction=0.5, teacher_cache="x", hidden_weight=0, attn_weight=0), "live teacher"),
        (dict(on_policy_fraction=0.5, kd_weight=0), "kd_weight > 0"),
        (dict(on_policy_fraction=0.5, micro_batch_size=2, gen_batch_size=3), "gen_batch_size must be in [0, "
         "micro_batch_size=2]"),
        (dict(on_policy_fraction=0.5, micro_batch_size=4, gen_batch_size=2, gen_rollout_rows=3),
         "gen_rollout_rows must be 0 or a multiple of gen_batch_size (2) no larger than micro_batch_size=4"),
        (dict(on_policy_fraction=0.5, micro_batch_size=4, gen_batch_size=2, gen_rollout_rows=6), "got 6"),
        (dict(on_policy_fraction=0.5, gen_prompts="files"), "gen_prompts must be one of prefix, chat, got 'files'"),
        (dict(on_policy_fraction=0.5, gen_kd_kind="l2"), "gen_kd_kind must be one of forward_kl"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ConfigError, match=re.escape(match)) as err:
            DistillConfig(**kwargs)
        assert "\n" not in str(err.value)
    DistillConfig(on_policy_fraction=0.5)  # the defaults fit in the default seq_len


def test_chat_prompts_take_first_user_turn_and_refuse_unusable_data(tmp_path):
    tok = tiny_tokenizer()
    chat = tmp_path / "chat.jsonl"
    chat.write_text("\n".join(json.dumps(r) for r in [
        {"messages": [{"role": "user", "content": "the fox"}, {"role": "assistant", "content": "jumps"}]},
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the dog"}]},
        {"messages": [{"role": "assistant", "content": "no user here"}]},
    ]))
    prompts = chat_prompts(str(chat), tok, 64)
    assert len(prompts) == 2
    assert tok.decode(prompts[0]).endswith("assistant\n") and "jumps" not in tok.decode(prompts[0])
    assert "be brief" in tok.decode(prompts[1])
    with pytest.raises(OnPolicyError, match="no user turn fits"):
        chat_prompts(str(chat), tok, 2)
    text = tmp_path / "text.jsonl"
    text.write_text(json.dumps({"text": "plain"}))
    with pytest.raises(OnPolicyError, match="no chat records"):
        chat_prompts(str(text), tok, 64)


def test_chat_prompts_come_from_the_chat_sources_of_a_datasets_mixture(tmp_path):
    from types import SimpleNamespace

    from distill.config import DistillConfig
    from distill.on_policy import build

    tok = tiny_tokenizer()
    chat, text = tmp_path / "chat.jsonl", tmp_path / "text.jsonl"
    chat.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"item {i}"}]}) for i in range(5)))
    text.write_text(json.dumps({"text": "plain"}))
    cfg = DistillConfig(datasets=[{"source": str(text), "weight": 2}, {"source": str(chat)}], on_policy_fraction=0.5,
                        gen_prompts="chat")  # `dataset` stays the built-in corpus, which has no chat records
    _, _, model = _pair()
    accelerator = SimpleNamespace(unwrap_model=lambda m: m, process_index=0, state=SimpleNamespace())
    policy = build(cfg, accelerator, model, tok)
    assert policy.pool == chat_prompts(str(chat), tok, cfg.gen_prompt_tokens) and len(policy.pool) == 5
    with pytest.raises(OnPolicyError, match="text.jsonl has no chat records"):
        build(dataclasses.replace(cfg, datasets=[str(text)]), accelerator, model, tok)


def test_a_large_chat_set_gives_a_bounded_seeded_pool(tmp_path):
    """More records than gen_prompt_pool: a seeded sample of them, the same for the same seed (every rank)."""
    tok = tiny_tokenizer()
    chat = tmp_path / "chat.jsonl"
    chat.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"item {i}"}]}) for i in range(30)))
    every = chat_prompts(str(chat), tok, 64)
    a, b = chat_prompts(str(chat), tok, 64, max_records=10, seed=3), chat_prompts(str(chat), tok, 64, 10, seed=3)
    other = chat_prompts(str(chat), tok, 64, max_records=10, seed=4)
    assert len(every) == 30 and len(a) == 10 and a == b and a != other
    assert all(p in every for p in a) and len({tuple(p) for p in a}) == 10
    assert [every.index(p) for p in a] == sorted(every.index(p) for p in a)  # in dataset order
    assert chat_prompts(str(chat), tok, 64, max_records=100) == every


@pytest.mark.slow
def test_recipe_on_policy_run(tmp_path):
    out = tmp_path / "op"
    proc = subprocess.run([sys.executable, "recipes/distill.py", "--config", "recipes/configs/tiny.yaml",
                           f"output_dir={out}", "max_steps=3", "save_every=0", "compare_ce_only=false",
                           "on_policy_fraction=0.5", "grad_accum=2", "gen_max_new_tokens=8", "gen_prompt_tokens=8"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["on_policy"]["rollout_tokens"] > 0 and 0 < summary["on_policy"]["gen_time_share"] < 1
    # Logged every step: the share so far counts the step in progress (never above 1, even at step 1).
    history = json.loads((out / "checkpoints" / "step-3" / "trainer_state.json").read_text())["history"]
    assert len(history) == 3 and all(0 < h["gen_time_share"] < 1 and h["rollout_tok_s"] > 0 for h in history)
    assert summary["student_ppl_final"] is not None
    bad = subprocess.run([sys.executable, "recipes/distill.py", "--config", "recipes/configs/tiny.yaml",
                          f"output_dir={tmp_path / 'bad'}", "on_policy_fraction=2"], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert bad.returncode == 2 and "on_policy_fraction must be in [0, 1]" in bad.stderr
    assert "Traceback" not in bad.stderr


@pytest.mark.distributed
@pytest.mark.slow
def test_recipe_on_policy_under_two_process_ddp(tmp_path):
    """Both ranks pick the same on-policy micro-batches (no DDP hang) and train to a final student."""
    from tests.test_distributed import _launch

    out = tmp_path / "ddp"
    _launch("cpu_ddp_2proc.yaml", [str(ROOT / "recipes" / "distill.py"), "--config", "recipes/configs/tiny.yaml",
                                   f"output_dir={out}", "max_steps=2", "save_every=0", "eval_every=0",
                                   "compare_ce_only=false", "on_policy_fraction=0.5", "grad_accum=2",
                                   "gen_max_new_tokens=8", "gen_prompt_tokens=8", "gen_batch_size=1",
                                   "gen_rollout_rows=2"], cpu_ddp=True, timeout=600)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_processes"] == 2 and summary["on_policy"]["rollout_tokens"] > 0
    # Two on-policy micro-batches of one row each, served by one two-row rollout on every rank.
    assert summary["on_policy"]["on_policy_micro_batches"] == 2 and summary["on_policy"]["rollout_calls"] == 1
    assert (out / "final" / "model.safetensors").exists()


def test_sharded_rollouts_decode_from_a_replica_refreshed_per_step():
    """The ZeRO-3 path (a replica synced once per step) rolls out what the live-weight path rolls out."""
    _, student, model = _pair("forward_kl")
    live = _policy(model, temperature=0.8, max_new=8)
    s = live.s
    sharded = OnPolicy(s, model, model, tiny_tokenizer(), 3, sharded=True)
    replica = sharded.rollouts.replica
    assert replica is not student and replica.lm_head.weight.data_ptr() != student.lm_head.weight.data_ptr()
    blocks = torch.randint(3, 320, (3, 16), generator=torch.Generator().manual_seed(1))
    assert torch.equal(live.generate(blocks, 0, 0)["input_ids"], sharded.generate(blocks, 0, 0)["input_ids"])
    opt = torch.optim.SGD(student.parameters(), lr=0.5)
    live.forward(blocks, 0, 0, torch.device("cpu")).loss.backward()
    opt.step()
    opt.zero_grad()
    step0 = {k: v.clone() for k, v in replica.state_dict().items()}
    assert any(not torch.equal(step0[k], v) for k, v in student.state_dict().items())  # the step moved the student
    sharded.generate(blocks, 0, 1)  # same step: the replica is not refreshed
    assert all(torch.equal(step0[k], v) for k, v in replica.state_dict().items())
    fresh = sharded.generate(blocks, 1, 0)  # next step: refreshed from the updated weights
    assert torch.equal(fresh["input_ids"], live.generate(blocks, 1, 0)["input_ids"])
    for (name, a), b in zip(student.named_parameters(), replica.parameters()):
        assert torch.equal(a, b), name
    assert not any(p.requires_grad for p in replica.parameters())


@pytest.mark.parametrize("tied", [False, True])
def test_gathered_replica_copies_weights_buffers_and_ties(tied):
    from distill.distributed import gathered_replica

    model = tiny_model(seed=3, layers=2, tie_word_embeddings=tied)
    replica = gathered_replica(model)
    assert (replica.lm_head.weight is replica.model.embed_tokens.weight) == tied
    ids = torch.randint(3, 320, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, replica.eval()(ids).logits)
        model.lm_head.weight.add_(1.0)
    assert gathered_replica(model, replica) is replica  # refreshed in place
    assert torch.equal(replica.lm_head.weight, model.lm_head.weight)


@pytest.mark.parametrize("temperature", [1e-4, 5e-4])
def test_a_rollout_temperature_the_engine_cannot_sample_at_is_refused_before_training(temperature):
    """gen_temperature in (0, serve's MIN_TEMPERATURE) passed the settings check and only failed at the first
    on-policy micro-batch, with SamplingParams' ValueError (a traceback, after the models loaded and maybe
    many steps). It must be a one-line OnPolicyError from the check, like every other gen_* setting."""
    from distill.config import DistillConfig
    from serve.sampling import SamplingParams

    with pytest.raises(ValueError):  # what the engine would say at the first rollout
        SamplingParams(max_new_tokens=4, temperature=temperature)
    s = OnPolicySettings(fraction=0.5, temperature=temperature, prompt_tokens=4, max_new_tokens=4)
    with pytest.raises(OnPolicyError, match="gen_temperature") as err:
        s.check(16, kd_weight=1.0, cached_teacher=False, micro_batch_size=2)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="gen_temperature"):
        DistillConfig(on_policy_fraction=0.5, gen_temperature=temperature)
    # What the engine accepts still passes: greedy and the smallest sampling temperature.
    for ok in (0.0, 1e-3, 1.0):
        OnPolicySettings(fraction=0.5, temperature=ok, prompt_tokens=4, max_new_tokens=4).check(
            16, kd_weight=1.0, cached_teacher=False, micro_batch_size=2)
        if ok:
            SamplingParams(max_new_tokens=4, temperature=ok)


def test_chat_prompts_pass_over_the_built_in_corpus_in_a_mixture(tmp_path):
    """datasets=[built-in corpus, chat file] with gen_prompts=chat: the built-in corpus has no chat records and is
    passed over like any text source (loading it through ``datasets`` failed the run: 'cannot load dataset')."""
    from types import SimpleNamespace

    from core.corpus import BUILTIN
    from distill.config import DistillConfig
    from distill.on_policy import build

    tok = tiny_tokenizer()
    chat = tmp_path / "chat.jsonl"
    chat.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"item {i}"}]}) for i in range(4)))
    cfg = DistillConfig(datasets=[{"source": BUILTIN, "weight": 2}, {"source": str(chat)}], on_policy_fraction=0.5,
                        gen_prompts="chat")
    _, _, model = _pair()
    accelerator = SimpleNamespace(unwrap_model=lambda m: m, process_index=0, state=SimpleNamespace())
    policy = build(cfg, accelerator, model, tok)
    assert policy.pool == chat_prompts(str(chat), tok, cfg.gen_prompt_tokens) and len(policy.pool) == 4
    with pytest.raises(OnPolicyError, match="has no chat records"):
        chat_prompts(BUILTIN, tok, 64)
