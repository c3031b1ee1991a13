"""Prefix caching and interleaved chunked prefill: exact against the uncached engine and a no-cache reference."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import attention
from attention.spec import HybridAttentionConfig
from core.tiny import tiny_model, tiny_tokenizer
from serve.engine import Engine
from serve.prefix_cache import PrefixCache
from serve.sampling import SamplingParams
from tests.test_serve_engine import greedy_reference, no_eos

SYSTEM = list(range(10, 58))  # a 48-token shared header
PROMPTS = [SYSTEM + [200, 201, 7], SYSTEM + [5], SYSTEM[:20] + [99, 98, 97, 96], SYSTEM + [200, 201, 9, 9, 9],
           list(range(100, 130))]


def engines(model, **kw):
    cached = Engine(model=model, tokenizer=tiny_tokenizer(), prefix_block=8, **kw)
    plain = Engine(model=model, tokenizer=tiny_tokenizer(), prefix_cache_bytes=0, **kw)
    return cached, plain


def run_one_by_one(engine, prompts, n):
    # One at a time so later prompts can hit what earlier ones cached.
    return [engine.generate([p], SamplingParams(max_new_tokens=n))[0].token_ids for p in prompts]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_dense_prefix_cache_equals_uncached_and_hf(arch):
    model = no_eos(tiny_model(arch, seed=11))
    cached, plain = engines(model, max_batch=2, prefill_chunk=16)
    a = run_one_by_one(cached, PROMPTS, 12)
    b = run_one_by_one(plain, PROMPTS, 12)
    assert a == b
    for p, out in zip(PROMPTS, a):
        assert out == model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[0, len(p):].tolist()
    st = cached.prefix_cache.stats
    # prompt 1 hits all 48 (one token is left to prefill), 2 hits 16 (two whole blocks), 3 hits 48
    assert st.hit_tokens == 48 + 16 + 48
    assert plain.prefix_cache is None
    # Concurrent requests (several rows admitted in one step) hit too and stay exact.
    both = cached.generate(PROMPTS, SamplingParams(max_new_tokens=12))
    assert [r.token_ids for r in both] == a


@pytest.mark.parametrize(("window", "chunk", "fully_cacheable"), [(32, 8, True), (8, 12, False)])
def test_hybrid_prefix_cache_is_exact_and_stops_where_the_ring_forgot(window, chunk, fully_cacheable):
    spec = HybridAttentionConfig(sink_tokens=4, window=window, global_every=6, max_globals=3)
    model = no_eos(tiny_model("llama", seed=12))
    model.config.hybrid_attention = spec.to_dict()
    cached, plain = engines(model, max_batch=2, prefill_chunk=chunk)
    assert cached.spec == spec
    a = run_one_by_one(cached, PROMPTS, 10)
    assert a == run_one_by_one(plain, PROMPTS, 10)
    for p, out in zip(PROMPTS, a):
        assert out == greedy_reference(model, p, 10, spec)
    st = cached.prefix_cache.stats
    if fully_cacheable:  # chunk + block <= window: every block is captured while still held
        assert st.hit_tokens == 48 + 16 + 48 and st.uncapturable_blocks == 0
    else:  # a 12-token chunk into an 8-slot ring drops positions 4, 5 before block 0 is seen
        assert st.uncapturable_blocks > 0 and st.hit_tokens < 48 + 16 + 48


def test_a_block_the_ring_lost_counts_once_not_at_every_later_chunk():
    """uncapturable_blocks counts the block where a prompt's chain stops once (it counted again at every later
    chunk: 9 for one 120-token prompt in 12-token chunks, with no more than 15 blocks in it)."""
    spec = HybridAttentionConfig(sink_tokens=4, window=8, global_every=6, max_globals=3)
    model = no_eos(tiny_model("llama", seed=12))
    model.config.hybrid_attention = spec.to_dict()
    cached = Engine(model=model, tokenizer=tiny_tokenizer(), prefix_block=8, prefill_chunk=12, chunk_by_cost=False)
    st = cached.prefix_cache.stats
    for i, prompt in enumerate([list(range(10, 130)), list(range(10, 130)), list(range(20, 140))]):
        cached.generate([prompt], SamplingParams(max_new_tokens=1))
        # block 0 (sinks + ring) is cached after the first chunk; block 1 has left the ring by the second
        assert st.uncapturable_blocks == i + 1 and st.blocks == (1 if i < 2 else 2)


def test_lru_byte_budget_evicts_leaves_and_stays_exact():
    model = no_eos(tiny_model("llama", seed=13))
    probe = Engine(model=model, tokenizer=tiny_tokenizer(), prefix_block=8)
    probe.generate([SYSTEM + [1]], SamplingParams(max_new_tokens=1))
    block_bytes = probe.prefix_cache.stats.bytes // probe.prefix_cache.stats.blocks
    cached = Engine(model=model, tokenizer=tiny_tokenizer(), prefix_block=8, prefix_cache_bytes=3 * block_bytes)
    plain = Engine(model=model, tokenizer=tiny_tokenizer(), prefix_cache_bytes=0)
    prompts = [[s] + SYSTEM[:30] for s in (3, 4, 5)] + [[3] + SYSTEM[:30], SYSTEM + [1]]
    assert run_one_by_one(cached, prompts, 6) == run_one_by_one(plain, prompts, 6)
    pc = cached.prefix_cache
    assert pc.stats.bytes <= 3 * block_bytes and pc.stats.blocks == 3 and pc.stats.evicted_blocks > 0
    ids = {b.id for b in pc._blocks.values()}
    assert all(b.parent is None or b.parent.id in ids for b in pc._blocks.values())  # no stranded children
    # The most recent prompt's first three blocks are what is left.
    assert pc._chain(SYSTEM + [1], int(cached.cache.window[0]), len(SYSTEM)) != []


@pytest.mark.parametrize("hybrid", [False, True])
def test_pool_reserves_slabs_up_to_the_budget_and_reuses_slots(hybrid):
    """Blocks live in pool slots: slabs are reserved as the cache fills, never past the budget; churn
    (eviction, clear) only frees slots, so the reserved bytes stop moving once full; still exact."""
    model = no_eos(tiny_model("llama", seed=14))
    if hybrid:
        model.config.hybrid_attention = HybridAttentionConfig(sink_tokens=4, window=32, global_every=6,
                                                              max_globals=3).to_dict()
    probe = Engine(model=model, tokenizer=tiny_tokenizer(), prefix_block=8, prefill_chunk=8)
    probe.generate([SYSTEM + [1]], SamplingParams(max_new_tokens=1))
    block_bytes = probe.prefix_cache.stats.bytes // probe.prefix_cache.stats.blocks
    cached = Engine(model=model, tokenizer=tiny_tokenizer(), prefix_block=8, prefix_cache_bytes=7 * block_bytes,
                    prefill_chunk=8)
    cached.prefix_cache.slab_blocks = 3
    plain = Engine(model=model, tokenizer=tiny_tokenizer(), prefix_cache_bytes=0, prefill_chunk=8)
    pc = cached.prefix_cache
    assert pc.reserved_bytes() == 0  # nothing before the first capture
    cached.generate([list(range(3, 13))], SamplingParams(max_new_tokens=2))  # one block
    assert pc.reserved_bytes() == 3 * block_bytes  # one slab
    prompts = [[s] + SYSTEM[:30] for s in range(3, 9)] + [SYSTEM + [1], [3] + SYSTEM[:30]]
    assert run_one_by_one(cached, prompts, 4) == run_one_by_one(plain, prompts, 4)
    assert pc.stats.evicted_blocks > 0 and pc.stats.bytes <= 7 * block_bytes
    full = pc.reserved_bytes()
    assert full == 7 * block_bytes  # slabs of 3, 3, then the 1 the budget leaves
    slots = [b.slot for b in pc._blocks.values()]
    assert len(set(slots)) == len(slots) and all(0 <= i < 7 for i in slots)
    pc.clear()
    assert pc.reserved_bytes() == full and pc.stats.bytes == 0
    assert run_one_by_one(cached, prompts, 4) == run_one_by_one(plain, prompts, 4)
    assert pc.reserved_bytes() == full


def test_prefix_cache_refuses_a_second_layout():
    pc = PrefixCache(1 << 20, block=4)
    a = Engine(model=no_eos(tiny_model("llama", seed=1)), tokenizer=tiny_tokenizer(), prefix_block=4)
    a.prefix_cache = pc
    a.generate([list(range(3, 20))], SamplingParams(max_new_tokens=1))
    cache = a.cache
    other = type(cache)(layers=cache.k.shape[0] + 1, rows=1, kv_heads=cache.k.shape[2], head_dim=cache.k.shape[4],
                        max_seq_len=64)
    with pytest.raises(ValueError, match="another cache layout"):
        pc.capture(other, 0, list(range(3, 20)), 8)


def test_prefix_cache_refuses_bad_settings():
    with pytest.raises(ValueError, match="block >= 1"):
        PrefixCache(1 << 20, block=0)


@pytest.mark.parametrize("hybrid", [False, True])
def test_interleaved_prefill_is_exact_with_rows_prefilling_during_decode(hybrid):
    model = no_eos(tiny_model("llama", seed=14))
    spec = HybridAttentionConfig(sink_tokens=4, window=16, global_every=6, max_globals=3)
    if hybrid:
        model.config.hybrid_attention = spec.to_dict()
    prompts = [[1, 5, 9], list(range(3, 90)), [7, 8, 9, 10], list(range(50, 120)), [4] * 6]
    lengths = [30, 8, 25, 12, 20]
    # A budget of 5 tokens a step: the long prompts take many steps while the others decode beside them.
    engine = Engine(model=model, tokenizer=tiny_tokenizer(), max_batch=4, prefill_chunk=4, prefill_budget=5,
                    prefix_cache_bytes=0)
    got = engine.generate(prompts, [SamplingParams(max_new_tokens=n) for n in lengths])
    for p, n, r in zip(prompts, lengths, got):
        ref = (greedy_reference(model, p, n, spec) if hybrid else
               model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)[0, len(p):].tolist())
        assert r.token_ids == ref


def test_short_request_gets_its_first_token_before_a_long_prefill_finishes():
    model = no_eos(tiny_model("llama", seed=15))
    engine = Engine(model=model, tokenizer=tiny_tokenizer(), max_batch=4, prefill_chunk=16, prefill_budget=16,
                    prefix_cache_bytes=0)
    long = engine.submit(list(range(3, 200)), SamplingParams(max_new_tokens=4))
    engine.step()  # the long prompt starts prefilling
    short = engine.submit([1, 2, 3], SamplingParams(max_new_tokens=4))
    engine.step()
    assert len(short.out_ids) >= 1 and long.prefilled < len(long.prompt_ids)
    while not long.done:
        engine.step()
    ref = model.generate(torch.tensor([long.prompt_ids]), max_new_tokens=4, do_sample=False)[0, 197:].tolist()
    assert long.out_ids == ref


def test_request_arriving_mid_step_overtakes_a_long_prefill_at_the_next_chunk(monkeypatch):
    """Arrivals are admitted between a step's prefill chunks; the shortest remaining prompt goes next."""
    model = no_eos(tiny_model("llama", seed=17))
    engine = Engine(model=model, tokenizer=tiny_tokenizer(), max_batch=4, prefill_chunk=16, prefill_budget=64,
                    prefix_cache_bytes=0, chunk_by_cost=False)
    order: list[tuple[int, int]] = []  # (row, chunk length) of every prefill forward
    real_prefill = engine.model.prefill
    arrivals = []

    def prefill(cache, row, ids, start, logits=True, between=None):
        order.append((row, ids.shape[0]))
        if len(order) == 1:  # a short request arrives while the long prompt's first chunk runs
            arrivals.append(engine.submit([1, 2, 3], SamplingParams(max_new_tokens=3)))
        return real_prefill(cache, row, ids, start, logits, between)

    monkeypatch.setattr(engine.model, "prefill", prefill)
    long = engine.submit(list(range(3, 200)), SamplingParams(max_new_tokens=3))
    engine.step()
    short = arrivals[0]
    # One step: a long chunk, the whole short prompt, then the long prompt again up to the budget.
    assert order == [(long.row, 16), (short.row, 3), (long.row, 16), (long.row, 16), (long.row, 13)]
    assert len(short.out_ids) == 2  # its first token from the prefill, the second from this step's decode
    assert long.prefilled == 16 + 16 + 16 + 13 and not long.out_ids
    while not (long.done and short.done):
        engine.step()
    for req in (long, short):
        n = len(req.prompt_ids)
        assert req.out_ids == model.generate(torch.tensor([req.prompt_ids]), max_new_tokens=3,
                                             do_sample=False)[0, n:].tolist()


def test_a_prompt_whose_rest_fits_in_a_chunk_finishes_in_this_step_past_the_budget(monkeypatch):
    """Once per step, a prompt whose remainder fits in one chunk is finished even past the budget, instead
    of waiting a whole decode step for its first token; anything longer stops at the budget as before."""
    model = no_eos(tiny_model("llama", seed=18))
    engine = Engine(model=model, tokenizer=tiny_tokenizer(), max_batch=4, prefill_chunk=16, prefill_budget=40,
                    prefix_cache_bytes=0, chunk_by_cost=False)
    order: list[tuple[int, int]] = []
    real_prefill = engine.model.prefill

    def prefill(cache, row, ids, start, logits=True, between=None):
        order.append((row, ids.shape[0]))
        return real_prefill(cache, row, ids, start, logits, between)

    monkeypatch.setattr(engine.model, "prefill", prefill)
    a = engine.submit(list(range(3, 33)), SamplingParams(max_new_tokens=3))  # 30 tokens: 16 + 14
    b = engine.submit(list(range(40, 52)), SamplingParams(max_new_tokens=3))  # 12 tokens: one chunk
    c = engine.submit(list(range(60, 72)), SamplingParams(max_new_tokens=3))  # 12 tokens: one chunk
    engine.step()
    # Budget 40: b (12) and c (12) first, shortest first, then a gets 16 (budget 0 left). a's rest (14)
    # fits in a chunk: finished now (one overrun), so all three have their first token after one step.
    assert order == [(b.row, 12), (c.row, 12), (a.row, 16), (a.row, 14)]
    assert all(len(r.out_ids) == 2 for r in (a, b, c))  # first token from the prefill, second from the decode
    while not all(r.done for r in (a, b, c)):
        engine.step()
    # A prompt whose rest is longer than a chunk still stops at the budget.
    order.clear()
    d = engine.submit(list(range(80, 150)), SamplingParams(max_new_tokens=3))  # 70 tokens
    engine.step()
    assert order == [(d.row, 16), (d.row, 16), (d.row, 8)] and not d.out_ids  # 30 left: more than a chunk
    engine.step()
    assert order[3:] == [(d.row, 16), (d.row, 14)] and len(d.out_ids) == 2
    while not d.done:
        engine.step()
    for req in (a, b, c, d):
        n = len(req.prompt_ids)
        assert req.out_ids == model.generate(torch.tensor([req.prompt_ids]), max_new_tokens=3,
                                             do_sample=False)[0, n:].tolist()


def test_deeper_prefill_chunks_hold_fewer_tokens_of_equal_cost_and_skip_the_head(monkeypatch):
    """chunk_at: prefill_chunk / (1 + ratio * position), ratio from the model's shapes (attention
    multiply-adds per key over projection ones); only the forward that ends a prompt computes logits;
    the output is the same greedy text as a plain generate."""
    model = no_eos(tiny_model("llama", seed=19))
    engine = Engine(model=model, tokenizer=tiny_tokenizer(), max_batch=2, prefill_chunk=64, prefill_budget=4096,
                    prefix_cache_bytes=0)
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    proj = sum(m.weight.numel() for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear))
    ratio = 2 * cfg.num_attention_heads * head_dim * cfg.num_hidden_layers / proj  # by hand
    for pos in (0, 50, 300, 1000):
        assert engine.chunk_at(pos) == max(16, int(64 / (1 + ratio * pos)))
    assert engine.chunk_at(1000) < engine.chunk_at(0) == 64
    assert Engine(model=model, tokenizer=tiny_tokenizer(), prefill_chunk=64, chunk_by_cost=False).chunk_at(1000) == 64
    calls: list[tuple[int, int, bool]] = []
    real_prefill = engine.model.prefill

    def prefill(cache, row, ids, start, logits=True, between=None):
        calls.append((start, ids.shape[0], logits))
        out = real_prefill(cache, row, ids, start, logits, between)
        assert (out is None) == (not logits)
        return out

    monkeypatch.setattr(engine.model, "prefill", prefill)
    prompt = [3 + (i * 7) % 250 for i in range(300)]
    req = engine.submit(prompt, SamplingParams(max_new_tokens=4))
    while not req.done:
        engine.step()
    assert [s for s, _, _ in calls] == [0] + [s + t for s, t, _ in calls[:-1]] and sum(t for _, t, _ in calls) == 300
    assert all(t == engine.chunk_for(s, 300) for s, t, _ in calls)
    assert [lg for _, _, lg in calls] == [False] * (len(calls) - 1) + [True]
    assert req.out_ids == model.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False)[0, 300:].tolist()


def test_chunk_cost_counts_full_heads_at_the_position_and_streaming_heads_at_their_cap():
    """chunk_at for a hybrid model: a streaming head's context stops at sinks + its largest window (the
    policy's, not only ``window``) + globals; full heads (roles) see the whole position, weighted by
    their share of the (layer, KV head) pairs; the output stays exact."""
    def engine(spec, chunk=1024):
        model = no_eos(tiny_model("llama", seed=23, layers=4))  # 4 layers x 2 KV heads
        if spec is not None:
            model.config.hybrid_attention = spec.to_dict()
        return model, Engine(model=model, tokenizer=tiny_tokenizer(), prefill_chunk=chunk, prefix_cache_bytes=0)

    model, dense = engine(None)
    cfg = model.config
    proj = sum(m.weight.numel() for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear))
    ratio = 2 * cfg.hidden_size * cfg.num_hidden_layers / proj  # heads x head_dim = hidden

    def by_hand(ctx):
        return max(16, int(1024 / (1 + ratio * ctx)))

    policy = HybridAttentionConfig(sink_tokens=4, window=16, global_every=64, window_policy=[[256, 16], [None, 48]])
    cap = 4 + 48 + 8192 // 64
    _, streaming = engine(policy)
    roles = dataclasses.replace(policy, full_heads={0: [0, 1], 2: [1]})  # 3 of 8 pairs full
    _, mixed = engine(roles)
    for pos in (0, 40, 100, 1000, 3000):
        assert dense.chunk_at(pos) == by_hand(pos)
        assert streaming.chunk_at(pos) == by_hand(min(pos, cap))
        assert mixed.chunk_at(pos) == by_hand(3 / 8 * pos + 5 / 8 * min(pos, cap))
    assert dense.chunk_at(3000) < mixed.chunk_at(3000) < streaming.chunk_at(3000)
    # Chunks of 64 down to ~30 tokens along a 400-token prompt through the mixed cache: the same greedy
    # text as a full recompute of a retrofitted copy (full heads causal, the rest under the window 48).
    _, mixed = engine(roles, chunk=64)
    assert mixed.chunk_at(300) < mixed.chunk_at(0) == 64
    ref = attention.retrofit(no_eos(tiny_model("llama", seed=23, layers=4)), roles)
    prompt = [3 + (i * 11) % 250 for i in range(400)]
    ids = list(prompt)
    for _ in range(3):
        with torch.no_grad(), attention.use_backend("sdpa"):
            ids.append(int(ref(torch.tensor([ids])).logits[0, -1].argmax()))
    assert mixed.generate([prompt], SamplingParams(max_new_tokens=3))[0].token_ids == ids[400:]


@pytest.mark.parametrize("hybrid", [False, True])
def test_a_remainder_within_a_quarter_chunk_is_prefilled_in_the_same_forward(monkeypatch, hybrid):
    """chunk_for: 16 + up to 4 tokens go in one forward, 16 + 5 in two; with a bounded cache and the
    prefix cache, never past window - block (blocks must still be in the ring when captured); exact."""
    model = no_eos(tiny_model("llama", seed=21))
    spec = HybridAttentionConfig(sink_tokens=4, window=40, global_every=0)
    if hybrid:
        model.config.hybrid_attention = spec.to_dict()
    engine = Engine(model=model, tokenizer=tiny_tokenizer(), max_batch=2, prefill_chunk=16, prefill_budget=64,
                    prefix_cache_bytes=0, chunk_by_cost=False)
    assert [engine.chunk_for(0, n) for n in (3, 16, 20, 21, 40)] == [3, 16, 20, 16, 16]
    assert engine.chunk_for(16, 21) == 5
    calls: list[int] = []
    real_prefill = engine.model.prefill

    def prefill(cache, row, ids, start, logits=True, between=None):
        calls.append(ids.shape[0])
        return real_prefill(cache, row, ids, start, logits, between)

    monkeypatch.setattr(engine.model, "prefill", prefill)
    for n, expect in ((20, [20]), (21, [16, 5]), (36, [16, 20])):
        calls.clear()
        prompt = [3 + (i * 5) % 200 for i in range(n)]
        out = engine.generate([prompt], SamplingParams(max_new_tokens=4))[0].token_ids
        assert calls == expect
        ref = (greedy_reference(model, prompt, 4, spec) if hybrid else
               model.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False)[0, n:].tolist())
        assert out == ref
    # Prefix cache on a bounded cache: window 40 - block 8 - chunk 16 leaves room for 16 // 4 = 4 more
    # tokens; window 26 leaves 2, window 24 none.
    for window, tail in ((40, 4), (26, 2), (24, 0)):
        m = no_eos(tiny_model("llama", seed=21))
        m.config.hybrid_attention = HybridAttentionConfig(sink_tokens=4, window=window, global_every=0).to_dict()
        e = Engine(model=m, tokenizer=tiny_tokenizer(), prefill_chunk=16, prefix_block=8, chunk_by_cost=False)
        assert e.chunk_for(0, 16 + tail) == 16 + tail and e.chunk_for(0, 17 + tail) == 16


def test_prefill_budget_is_sized_by_measured_time_while_others_decode(monkeypatch):
    """While a request decodes, a long prompt's prefill per step follows prefill_step_s / measured speed."""
    import serve.engine as eng

    model = no_eos(tiny_model("llama", seed=16))
    engine = Engine(model=model, tokenizer=tiny_tokenizer(), max_batch=4, prefill_chunk=64, prefill_budget=64,
                    prefill_step_s=0.0105, min_prefill_tokens=4, prefix_cache_bytes=0, chunk_by_cost=False)
    # A fake clock: every prefill chunk "takes" 1 ms per token, nothing else takes time.
    fake = [0.0]
    chunks: list[int] = []
    real_prefill = engine.model.prefill

    def timed_prefill(cache, row, ids, start, logits=True, between=None):
        chunks.append(ids.shape[0])
        fake[0] += ids.shape[0] * 1e-3
        return real_prefill(cache, row, ids, start, logits, between)

    monkeypatch.setattr(engine.model, "prefill", timed_prefill)
    monkeypatch.setattr(eng.time, "perf_counter", lambda: fake[0])
    first = engine.submit([1, 2, 3, 4] * 5, SamplingParams(max_new_tokens=30))
    engine.step()  # nobody decodes yet: the whole 20-token prompt at the full budget (and 1 ms/token measured)
    assert chunks == [20] and engine.step_prefill_budget() == 10  # 0.0105 s / 1 ms per token
    long = engine.submit(list(range(3, 60)), SamplingParams(max_new_tokens=2))
    engine.step()
    assert chunks[1] == 10 and long.prefilled == 10  # timed while the first request decodes
    while not first.done:
        engine.step()
    while not long.done:  # alone: the rest at the full budget
        engine.step()
    assert long.out_ids == model.generate(torch.tensor([long.prompt_ids]), max_new_tokens=2,
                                          do_sample=False)[0, 57:].tolist()
    fixed = Engine(model=model, tokenizer=tiny_tokenizer(), prefill_budget=64, prefill_step_s=None,
                   prefix_cache_bytes=0)
    fixed._prefill_s_per_token = 1.0
    assert fixed.step_prefill_budget() == 64
    with pytest.raises(ValueError, match="prefill_step_s must be > 0"):
        Engine(model=model, tokenizer=tiny_tokenizer(), prefill_step_s=0)


def test_server_reports_prefix_cache_in_metrics(tmp_path):
    import httpx

    from core.tiny import save_tiny
    from serve.server import ServerThread, create_app
    from tests.test_serve_server import _metric

    path = save_tiny(tmp_path, arch="llama")
    engine = Engine(path, max_batch=2, max_seq_len=256, prefix_block=8, prefix_cache_bytes=1 << 20)
    system = {"role": "system", "content": "the quick brown fox jumps over the lazy dog " * 4}
    with ServerThread(create_app(engine, max_queue=2)) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        outs = []
        for q in ("distill the teacher", "héllo wörld"):
            body = {"messages": [system, {"role": "user", "content": q}], "max_tokens": 4, "temperature": 0}
            outs.append(c.post("/v1/chat/completions", json=body).json())
        assert _metric(c, "hd_serve_prefix_cache_hit_tokens") >= 32  # the second request reused the header
        assert 0 < _metric(c, "hd_serve_prefix_cache_bytes") <= _metric(c, "hd_serve_prefix_cache_budget_bytes")
    assert all(o["choices"][0]["finish_reason"] for o in outs)
