"""Overtaking: a short prompt that arrives during a forward is prefilled between its layers, exactly."""

from __future__ import annotations

import copy

import pytest
import torch

import attention
from attention.masks import hybrid_mask
from attention.spec import HybridAttentionConfig
from core.tiny import tiny_model, tiny_tokenizer
from serve.engine import Engine
from serve.sampling import SamplingParams

LONG = [1] + list(range(100, 160))  # 61 tokens
SHORT = [7, 8, 9, 10, 11]


def no_eos(model):
    model.generation_config.eos_token_id = None
    model.config.eos_token_id = None
    return model


def reference(model, prompt: list[int], n: int, kind: str, spec: HybridAttentionConfig | None) -> list[int]:
    """Greedy continuation by full recompute, no cache: dense causal, the hybrid mask, or per-head roles."""
    ids = list(prompt)
    for _ in range(n):
        with torch.no_grad():
            if kind == "dense":
                logits = model(torch.tensor([ids])).logits[0, -1]
            elif kind == "hybrid":
                t = len(ids)
                additive = torch.zeros(t, t).masked_fill(~hybrid_mask(t, spec), float("-inf"))[None, None]
                logits = model(torch.tensor([ids]), attention_mask=additive).logits[0, -1]
            else:  # a retrofitted copy: full heads causal, the rest under the pattern
                with attention.use_backend("sdpa"):
                    logits = model(torch.tensor([ids])).logits[0, -1]
        ids.append(int(logits.argmax()))
    return ids[len(prompt):]


def make_engine(kind: str, all_rows: bool = True, **kw):
    """An engine over a tiny model of the given kind and the reference model for its outputs.
    ``all_rows``: the cache is made with every row at once, as after :meth:`Engine.warmup`."""
    model = no_eos(tiny_model("llama", seed=21, layers=3))
    spec = None
    ref = model
    if kind == "hybrid":
        spec = HybridAttentionConfig(sink_tokens=4, window=8, global_every=6, max_globals=3)
        model.config.hybrid_attention = spec.to_dict()
    elif kind == "roles":
        spec = HybridAttentionConfig(sink_tokens=3, window=8, global_every=5, max_globals=4, full_heads={0: [1]})
        ref = attention.retrofit(copy.deepcopy(model), spec)
        model.config.hybrid_attention = spec.to_dict()
    engine = Engine(model=model, tokenizer=tiny_tokenizer(), max_batch=4, prefill_chunk=16,
                    prefix_cache_bytes=0, **kw)
    if all_rows:
        engine._min_rows = engine.max_batch
    return engine, ref, spec


def arrive_at(engine: Engine, call: int, prompt: list[int], n: int, **params) -> list:
    """Submit ``prompt`` from inside the ``call``-th between-layers check of the forwards to come."""
    real, seen, box = engine.overtake, [0], []

    def overtake(first_row=0):
        seen[0] += 1
        if seen[0] == call:
            box.append(engine.submit(prompt, SamplingParams(max_new_tokens=n, **params)))
        return real(first_row)

    engine.overtake = overtake
    return box


@pytest.mark.parametrize("kind", ["dense", "hybrid", "roles"])
def test_a_short_prompt_arriving_mid_decode_gets_its_first_token_inside_that_step_exactly(kind):
    engine, ref, spec = make_engine(kind)
    forwards: list[tuple[str, float, float, list[int]]] = []
    engine.on_forward = lambda k, t0, t1, n, ids: forwards.append((k, t0, t1, ids))
    long = engine.submit(LONG, SamplingParams(max_new_tokens=12))
    engine.step()  # the long prompt's prefill (4 forwards of 16) and its first decode step
    assert len(long.out_ids) == 2
    forwards.clear()
    box = arrive_at(engine, 2, SHORT, 10)  # after the decode step's second layer (3 layers: 2 checks)
    engine.step()
    short = box[0]
    # Inside the one decode step: the short prompt was prefilled and sent its first token; the long
    # request got its next one from the same (paused) decode forward.
    assert engine.overtakes == 1 and len(short.out_ids) == 1 and len(long.out_ids) == 3
    (k1, s1, e1, ids1), (k2, s2, e2, ids2) = forwards
    assert (k1, ids1, k2, ids2) == ("prefill", [short.id], "decode", [long.id])
    assert s2 < s1 < e1 < e2  # the prefill ran within the decode forward
    assert short.row >= 1  # never a row of the paused decode
    while not (long.done and short.done):
        engine.step()
    assert engine.overtakes == 1  # nothing else was waiting at later checks
    for req, n in ((long, 12), (short, 10)):
        assert req.out_ids == reference(ref, req.prompt_ids, n, kind, spec)


def test_a_short_prompt_overtakes_a_long_prompts_chunk_between_its_layers():
    engine, ref, spec = make_engine("dense", chunk_by_cost=False)
    order: list[tuple[str, int, int]] = []  # ("start" | "end", row, tokens) of every prefill forward
    real_prefill = engine.model.prefill

    def prefill(cache, row, ids, start, logits=True, between=None):
        order.append(("start", row, ids.shape[0]))
        out = real_prefill(cache, row, ids, start, logits, between)
        order.append(("end", row, ids.shape[0]))
        return out

    engine.model.prefill = prefill
    box = arrive_at(engine, 1, SHORT, 6)  # during the long prompt's first chunk
    long = engine.submit(LONG, SamplingParams(max_new_tokens=6))
    engine.step()
    short = box[0]
    assert order[:4] == [("start", long.row, 16), ("start", short.row, 5), ("end", short.row, 5),
                         ("end", long.row, 16)]
    assert len(short.out_ids) == 2  # its first token from the nested prefill, its second from this step's decode
    while not (long.done and short.done):
        engine.step()
    for req, n in ((long, 6), (short, 6)):
        assert req.out_ids == reference(ref, req.prompt_ids, n, "dense", None)


def test_seeded_sampling_is_the_same_with_and_without_overtaking():
    engine, _, _ = make_engine("dense")
    long = engine.submit(LONG, SamplingParams(max_new_tokens=10, temperature=0.9, seed=3))
    engine.step()
    box = arrive_at(engine, 1, SHORT, 8, temperature=0.8, seed=5)
    engine.step()
    assert engine.overtakes == 1
    while not (long.done and box[0].done):
        engine.step()
    alone, _, _ = make_engine("dense", overtake_tokens=0)  # each request on its own, nothing to overtake
    assert alone.generate([LONG], SamplingParams(max_new_tokens=10, temperature=0.9, seed=3))[0].token_ids == long.out_ids
    assert alone.generate([SHORT], SamplingParams(max_new_tokens=8, temperature=0.8, seed=5))[0].token_ids == box[0].out_ids


def test_what_does_not_overtake():
    # Longer than overtake_tokens: it waits for the forward in flight (admitted at the next step).
    engine, _, _ = make_engine("dense", overtake_tokens=4)
    engine.submit(LONG, SamplingParams(max_new_tokens=8))
    engine.step()
    box = arrive_at(engine, 1, SHORT, 3)  # 5 tokens > 4
    engine.step()
    assert engine.overtakes == 0 and box[0].row == -1 and not box[0].out_ids
    engine.step()
    assert box[0].row >= 0 and box[0].out_ids
    # A cancelled arrival is skipped; overtake_tokens=0 turns overtaking off.
    engine, _, _ = make_engine("dense")
    engine.submit(LONG, SamplingParams(max_new_tokens=8))
    engine.step()
    real, gone = engine.overtake, []

    def cancelled_arrival(first_row=0):
        gone.append(engine.submit(SHORT, SamplingParams(max_new_tokens=3)))
        engine.cancel(gone[0])
        engine.overtake = real
        return real(first_row)

    engine.overtake = cancelled_arrival
    engine.step()
    assert engine.overtakes == 0 and gone[0].row == -1 and not gone[0].out_ids
    engine, _, _ = make_engine("dense", overtake_tokens=0)
    assert engine._overtake_hook(0) is None
    with pytest.raises(ValueError, match="overtake_tokens must be >= 0"):
        make_engine("dense", overtake_tokens=-1)


def test_no_overtaking_into_a_row_of_the_paused_decode_or_a_grown_cache():
    engine, _, _ = make_engine("dense", all_rows=False)
    a = engine.submit(LONG, SamplingParams(max_new_tokens=20))
    b = engine.submit(SHORT, SamplingParams(max_new_tokens=2))
    engine.step()
    engine.step()
    assert b.done and engine._rows[b.row if b.row >= 0 else 1] is None  # row 1 is free again
    c = engine.submit(LONG[:30], SamplingParams(max_new_tokens=20))
    engine.step()  # c takes row 1; the cache has 2 rows (grown by doubling), both in the decode
    assert (a.row, c.row, engine.cache.rows) == (0, 1, 2)
    box = arrive_at(engine, 1, SHORT, 3)
    engine.step()
    assert engine.overtakes == 0 and box[0].row == -1  # no free row >= 2 without growing the cache
    engine.step()
    assert box[0].row == 2 and box[0].out_ids  # admitted between steps, the cache grown then


def test_an_overtaking_request_that_fails_fails_alone():
    engine, ref, _ = make_engine("dense")
    long = engine.submit(LONG, SamplingParams(max_new_tokens=8))
    engine.step()
    finals = []

    def on_event(_delta, token, finish):
        if token is not None:
            raise RuntimeError("client callback failed")
        finals.append(finish)

    real = engine.overtake

    def arrival(first_row=0):
        engine.submit(SHORT, SamplingParams(max_new_tokens=4), on_event=on_event)
        engine.overtake = real
        return real(first_row)

    engine.overtake = arrival
    engine.step()
    assert finals == ["error"] and engine.overtakes == 1
    while not long.done:
        engine.step()
    assert long.finish_reason == "length" and long.out_ids == reference(ref, LONG, 8, "dense", None)


def test_a_free_row_outside_the_paused_decode_comes_first():
    """Row 1 is free but inside the decode block (rows 0-2), row 3 outside it: the arrival takes row 3."""
    engine, ref, _ = make_engine("dense")
    a = engine.submit(LONG, SamplingParams(max_new_tokens=12))
    b = engine.submit(SHORT, SamplingParams(max_new_tokens=2))
    c = engine.submit(LONG[:30], SamplingParams(max_new_tokens=12))
    engine.step()
    assert b.done and (a.row, c.row) == (0, 2) and engine._rows[1] is None
    box = arrive_at(engine, 1, SHORT[:3], 8)
    engine.step()
    short = box[0]
    assert engine.overtakes == 1 and short.row == 3
    while not all(r.done for r in (a, c, short)):
        engine.step()
    for req, n in ((a, 12), (c, 12), (short, 8)):
        assert req.out_ids == reference(ref, req.prompt_ids, n, "dense", None)


@pytest.mark.parametrize("kind", ["dense", "hybrid", "roles"])
def test_a_free_row_inside_the_paused_decode_is_taken_exactly(kind):
    """Rows 0, 2 and 3 decode, row 1 is free inside their block and no row is free outside it. The
    arrival takes row 1 mid-step; the step's remaining layers write their throw-away token into that row
    (at the position and window it had when the step began, inside the new prompt here) and its sampled
    token over the new request's first: both are put back when the step ends, so every output equals a
    full recompute. A second arrival in the same step finds no row: row 1 is taken once per step."""
    engine, ref, spec = make_engine(kind)
    a = engine.submit(LONG, SamplingParams(max_new_tokens=14))
    b = engine.submit(SHORT, SamplingParams(max_new_tokens=2))
    c = engine.submit(LONG[:30], SamplingParams(max_new_tokens=14))
    d = engine.submit(LONG[:20], SamplingParams(max_new_tokens=14))
    engine.step()
    assert b.done and [r.row for r in (a, c, d)] == [0, 2, 3] and engine._rows[1] is None
    stale = int(engine._pos[1])
    prompt = [1] + list(range(300, 311))  # 12 tokens: covers the stale position the step writes at
    assert stale < len(prompt) <= engine.overtake_tokens
    box = arrive_at(engine, 1, prompt, 8)  # after the first of three layers
    second = arrive_at(engine, 2, SHORT[:2], 3)  # the next check of the same step
    engine.step()
    short = box[0]
    assert engine.overtakes == 1 and short.row == 1 and len(short.out_ids) == 1
    assert second[0].row == -1  # no other free row in this step, and row 1 was not taken twice
    while not all(r.done for r in (a, c, d, short, second[0])):
        engine.step()
    for req, n in ((a, 14), (c, 14), (d, 14), (short, 8), (second[0], 3)):
        assert req.out_ids == reference(ref, req.prompt_ids, n, kind, spec)


def test_a_short_prompts_own_prefill_is_not_overtaken():
    """A prompt that could itself overtake finishes its prefill first (its forward offers no check
    between layers: an arrival then waits for it, and the slower first token of the two is lower); a
    longer prompt's chunks are still overtakable."""
    engine, ref, _ = make_engine("dense")
    offered: list[tuple[int, bool]] = []  # (prompt length, whether the prefill forward had a check)
    real = engine.model.prefill

    def prefill(cache, row, ids, start, logits=True, between=None):
        offered.append((len(engine._rows[row].prompt_ids), between is not None))
        return real(cache, row, ids, start, logits=logits, between=between)

    engine.model.prefill = prefill
    short_prompt = [1] + list(range(200, 218))  # 19 tokens: one forward, within overtake_tokens (20)
    assert len(short_prompt) <= engine.overtake_tokens < len(LONG)
    reqs = [engine.submit(p, SamplingParams(max_new_tokens=4)) for p in (short_prompt, LONG)]
    while not all(r.done for r in reqs):
        engine.step()
    assert set(offered) == {(len(short_prompt), False), (len(LONG), True)}
    for req in reqs:
        assert req.out_ids == reference(ref, req.prompt_ids, 4, "dense", None)
