"""DuoAttention-style learned gates (attention.gates): the mix, its limits, its gradients and the training."""

from __future__ import annotations

import math

import pytest
import torch

import attention
from attention import HybridAttentionConfig, HybridAttentionError, hybrid_attention
from attention.gates import (
    _decoder,
    _gate_loss,
    _gated,
    _GatedInterface,
    _prepare,
    gated_attention,
    train_gates,
)
from attention.masks import dense_spec, query_key_mask
from core.tiny import tiny_model

SPEC = HybridAttentionConfig(sink_tokens=3, window=8, global_every=11)


def naive(q, k, v, mask):
    """float64 softmax attention with a boolean ``[1, 1, q, k]`` mask (GQA by repetition)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    s = q.double() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ v


def qkv(q_len, k_len, heads=6, kv_heads=3, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda h, n: torch.randn(1, h, n, d, generator=g).requires_grad_()  # noqa: E731
    return mk(heads, q_len), mk(kv_heads, k_len), mk(kv_heads, k_len)


@pytest.mark.parametrize("q_len", [60, 25], ids=["whole", "suffix"])
def test_gated_mix_limits_values_and_grads_match_mask_reference(q_len):
    q, k, v = qkv(q_len, 60)
    full_ref = naive(q, k, v, query_key_mask(q_len, 60, dense_spec(60)))
    stream_ref = naive(q, k, v, query_key_mask(q_len, 60, SPEC))
    with torch.no_grad():  # the limits: α = 1 is dense causal, α = 0 the served streaming pattern
        one = gated_attention(q, k, v, SPEC, torch.ones(3))
        zero = gated_attention(q, k, v, SPEC, torch.zeros(3))
        assert (one.double() - full_ref).abs().max() < 1e-5
        assert (zero.double() - stream_ref).abs().max() < 1e-5
        served = hybrid_attention(q, k, v, SPEC, backend="blocksparse" if q_len == 60 else "sdpa")
        assert (zero - served).abs().max() < 1e-5
    alpha = torch.tensor([0.0, 0.3, 1.0], requires_grad=True)
    a64 = alpha.double().repeat_interleave(2).view(1, 6, 1, 1)
    ref = a64 * full_ref + (1 - a64) * stream_ref
    out = gated_attention(q, k, v, SPEC, alpha)
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    got = torch.autograd.grad(out, (alpha, q, k, v), go)
    want = torch.autograd.grad(ref, (alpha, q, k, v), go.double())
    assert (out.double() - ref).abs().max() < 1e-5
    for a, b in zip(got, want):
        assert (a.double() - b).abs().max() < 1e-4
    # d out / d α is (full − streaming) of that head's query group: nonzero where the patterns differ.
    assert got[0].abs().min() > 1e-3


def test_gates_have_one_entry_per_kv_head():
    q, k, v = qkv(10, 10)
    with pytest.raises(HybridAttentionError, match=r"\[kv_heads\] = \[3\]"):
        gated_attention(q, k, v, SPEC, torch.ones(6))


class CharTokenizer:
    """One token per character (ids 3..): digits tokenize the same in and out of context."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [3 + ord(c) % 300 for c in text]}


def samples(count=2, length=300, keys=1, seed=0):
    from attention.heads import needle_samples

    length = length if keys == 1 else length + 150  # three named needles with a one-token-per-character tokenizer
    hay = torch.randint(3, 300, (4, 500), generator=torch.Generator().manual_seed(seed))
    return needle_samples(CharTokenizer(), hay, count=count, length=length, min_distance=40, min_start=8,
                          seed=seed, keys=keys)


TINY_SPEC = HybridAttentionConfig(sink_tokens=4, window=24, global_every=64)


def hidden(model, ids):
    with torch.no_grad():
        return _decoder(model)(input_ids=ids, use_cache=False).last_hidden_state


def test_gated_model_limits_and_the_prefix_shortcut():
    model = tiny_model("llama", seed=1, layers=2, heads=4, kv_heads=2)
    s = samples(1)[0]
    ids = torch.tensor([s.ids])
    dense = hidden(model, ids)
    stream = hidden(attention.retrofit(tiny_model("llama", seed=1, layers=2, heads=4, kv_heads=2), TINY_SPEC), ids)
    gates = torch.tensor([[0.2, 0.9], [0.6, 0.0]])
    for value, want in ((1.0, dense), (0.0, stream), (None, None)):
        iface = _GatedInterface(TINY_SPEC, gates if value is None else torch.full((2, 2), value))
        with _gated(model, iface):
            got = hidden(model, ids)
            if want is not None:
                assert (got - want).abs().max() < 1e-5
            else:  # the training step runs only the tokens after sink + window, on the stored prefix
                item = _prepare(model, iface, [s], TINY_SPEC, "cpu", progress=False)[0]
                assert item["start"] == 28
                torch.testing.assert_close(item["target"], dense[0, s.question_start:])
                loss = _gate_loss(model, iface, item)
                want_loss = (got[0, s.question_start:] - dense[0, s.question_start:]).pow(2).mean() / item["scale"]
                torch.testing.assert_close(loss, want_loss, atol=1e-6, rtol=1e-4)
    assert model.config._attn_implementation != "hybrid_gates"  # restored


def test_gate_training_moves_gates_with_finite_grads_and_leaves_the_model_alone():
    model = tiny_model("llama", seed=2, layers=2, heads=4, kv_heads=2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    data = samples(2) + samples(2, keys=3, seed=1)
    gates = torch.full((2, 2), 0.5, requires_grad=True)  # a single gradient first: finite, nonzero
    iface = _GatedInterface(TINY_SPEC, gates)
    with _gated(model, iface):
        item = _prepare(model, iface, data[:1], TINY_SPEC, "cpu", progress=False)[0]
        _gate_loss(model, iface, item).backward()
    assert torch.isfinite(gates.grad).all() and gates.grad.abs().sum() > 0
    model.zero_grad(set_to_none=True)
    result = train_gates(model, data, TINY_SPEC, steps=6, lr=0.1, l1=0.05, progress=False)
    assert result.gates.shape == (2, 2) and ((result.gates >= 0) & (result.gates <= 1)).all()
    assert (result.gates != 1).any()  # gates start at 1; the L1 term and the MSE moved them
    assert result.pressure.shape == (2, 2) and torch.isfinite(result.pressure).all()
    assert all(math.isfinite(h["mse"]) for h in result.history) and len(result.history) == 6
    assert result.history[0]["mse"] < 1e-10  # the first step runs at α = 1: full attention, no error
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) and p.requires_grad and p.grad is None
    with pytest.raises(HybridAttentionError, match="steps"):
        train_gates(model, data, TINY_SPEC, steps=0)


def test_dense_context_gates_only_the_question_and_answer():
    """context="dense": the loss equals a reference model in which every query before the question attends
    fully and the question's and answer's queries run the gated mix (naive float64 attention); the step
    runs only those tokens, and its gradient reaches the gates."""
    from attention.integration import attention_swapped

    model = tiny_model("llama", seed=1, layers=2, heads=4, kv_heads=2)
    s = samples(1)[0]
    ids = torch.tensor([s.ids])
    gates = torch.tensor([[0.2, 0.9], [0.6, 0.0]], requires_grad=True)
    qs = s.question_start

    def reference(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        n = query.shape[2]
        full = naive(query, key, value, query_key_mask(n, n, dense_spec(n)))
        stream = naive(query, key, value, query_key_mask(n, n, TINY_SPEC))
        a = gates[module.layer_idx].double().repeat_interleave(2).view(1, 4, 1, 1)
        row = (torch.arange(n) >= qs).view(1, 1, n, 1)
        out = torch.where(row, stream + a * (full - stream), full)
        return out.to(query.dtype).transpose(1, 2).contiguous(), None

    with attention_swapped(model, "gate_reference", reference):
        want = _decoder(model)(input_ids=ids, use_cache=False).last_hidden_state[0, qs:]
    iface = _GatedInterface(TINY_SPEC, gates)
    with _gated(model, iface):
        item = _prepare(model, iface, [s], TINY_SPEC, "cpu", progress=False, context="dense")[0]
        assert item["start"] == qs and item["ids"].shape[1] == len(s.ids) - qs
        loss = _gate_loss(model, iface, item)
    want_loss = (want.float() - item["target"]).pow(2).mean() / item["scale"]
    torch.testing.assert_close(loss, want_loss, atol=1e-6, rtol=1e-4)
    got = torch.autograd.grad(loss, gates)[0]
    ref = torch.autograd.grad(want_loss, gates)[0]
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-3)
    assert got.abs().sum() > 0
    with pytest.raises(HybridAttentionError, match="unknown gate context 'exact'; use one of gated, dense"):
        train_gates(model, [s], TINY_SPEC, steps=1, context="exact")


def test_samples_longer_than_a_block_run_on_into_the_next():
    from attention.heads import needle_samples

    hay = torch.randint(3, 300, (3, 100), generator=torch.Generator().manual_seed(0))
    stream = hay.reshape(-1).tolist()
    (s,) = needle_samples(CharTokenizer(), hay, count=1, length=250, min_distance=40, min_start=8)
    from attention.heads import NEEDLE

    at = s.key_positions[0] - len(" Note: the secret number is")
    text = s.ids[:at] + s.ids[at + len(NEEDLE.format(key="00000")):s.question_start]
    assert len(s.ids) == 250 and len(text) > 100 and text == stream[:len(text)]  # blocks 0 and 1, in order
    with pytest.raises(HybridAttentionError, match="training text has 300"):
        needle_samples(CharTokenizer(), hay, count=1, length=500, min_distance=40, min_start=8)


def test_multikey_samples_ask_for_one_named_key():
    for s in samples(3, keys=3, seed=4):
        assert len(s.ids) == 450 and s.answer_start - s.key_positions[-1] >= 40
        assert [s.ids[p] for p in s.key_positions] == s.ids[s.answer_start:]
        question = "".join(chr((i - 3) % 300) for i in s.ids[s.question_start:s.answer_start])
        assert question.startswith(" Question: what is the secret number of ")
        name = question.split(" of ")[1].split("?")[0]
        text = "".join(chr((i - 3) % 300) for i in s.ids[:s.question_start])
        assert text.count("Note: the secret number of ") == 3 and text.count(f" of {name} is ") == 1


def test_gate_roles_round_trip_through_the_config(tmp_path):
    from attention.heads import find_head_roles

    model = tiny_model("llama", seed=2, layers=2, heads=4, kv_heads=2)
    hay = torch.randint(3, 300, (4, 500), generator=torch.Generator().manual_seed(0))
    spec = find_head_roles(model, CharTokenizer(), TINY_SPEC, hay, share=0.5, method="gates", samples=2, length=450,
                           gate_steps=3, progress=False)
    rec = spec.head_scores
    assert rec["method"] == "gates" and rec["steps"] == 3 and spec.full_head_count(2, 2) == 2
    assert torch.tensor(rec["scores"]).shape == (2, 2)
    attention.retrofit(model, spec).save_pretrained(tmp_path)
    assert HybridAttentionConfig.from_dict(attention.load(tmp_path).config.hybrid_attention) == spec


def test_gate_window_trains_under_its_own_window_and_roles_keep_the_spec(monkeypatch):
    """gate_window: the gates train (and their needles sit) beyond that window; the returned spec is the
    one given, with its own window, and the record says which window trained the gates."""
    import attention.gates as gates
    from attention.heads import find_head_roles

    seen = []
    real = gates.train_gates

    def spy(model, data, spec, **kw):
        seen.append((spec.window, min(d.answer_start - d.key_positions[-1] for d in data)))
        return real(model, data, spec, **kw)

    monkeypatch.setattr(gates, "train_gates", spy)
    model = tiny_model("llama", seed=2, layers=2, heads=4, kv_heads=2)
    hay = torch.randint(3, 300, (4, 500), generator=torch.Generator().manual_seed(0))
    kw = dict(share=0.5, method="gates", samples=2, length=450, gate_steps=2, progress=False)
    plain = find_head_roles(model, CharTokenizer(), TINY_SPEC, hay, **kw)
    small = find_head_roles(model, CharTokenizer(), TINY_SPEC, hay, gate_window=8, **kw)
    assert [w for w, _ in seen] == [24, 8]
    assert seen[0][1] >= 24 + 16 and seen[1][1] >= 8 + 16  # needles beyond each window (+16)
    assert plain.window == small.window == 24 and small.full_head_count(2, 2) == 2
    assert plain.head_scores["window"] == 24 and small.head_scores["window"] == 8


@pytest.mark.parametrize("kw, match", [
    ({"share": 1.5}, r"full_head_share must be in \[0, 1\]"),
    ({"share": -0.1}, r"full_head_share must be in \[0, 1\]"),
    ({"share": 0.5, "method": "duo"}, "unknown head score 'duo'; use one of retrieval, mass, gates"),
])
def test_bad_share_or_method_is_one_line_error(kw, match):
    from attention.heads import find_head_roles

    with pytest.raises(HybridAttentionError, match=match) as err:
        find_head_roles(None, CharTokenizer(), TINY_SPEC, torch.zeros(1, 8, dtype=torch.long), **kw)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("gate_window, want", [(None, 40), (8, 8)])
def test_gate_window_applies_and_is_recorded_under_a_window_policy(monkeypatch, gate_window, want):
    """With a window_policy, the gates train under gate_window when given (else the policy's window for the
    sample length), and head_scores records the window that really trained them."""
    import attention.gates as gates
    from attention.functional import resolve_window
    from attention.heads import find_head_roles

    seen = []

    def spy(model, data, spec, **kw):
        seen.append(({resolve_window(spec, len(d.ids)) for d in data},
                     min(d.answer_start - d.key_positions[-1] for d in data)))
        return gates.GateResult(torch.tensor([[0.9, 0.1], [0.2, 0.8]]), torch.zeros(2, 2),
                                [{"mse": 0.0, "mean_gate": 0.5}])

    monkeypatch.setattr(gates, "train_gates", spy)
    spec = HybridAttentionConfig(sink_tokens=4, window=24, global_every=64, window_policy=[[100, 12], [None, 40]])
    hay = torch.randint(3, 300, (4, 500), generator=torch.Generator().manual_seed(0))
    out = find_head_roles(None, CharTokenizer(), spec, hay, share=0.5, method="gates", samples=2, length=450,
                          gate_steps=2, progress=False, gate_window=gate_window)
    (windows, distance), = seen
    assert windows == {want} and distance >= want + 16
    assert out.head_scores["window"] == want
    assert out.window_policy == spec.window_policy and out.window == 24  # the roles keep the spec's pattern
