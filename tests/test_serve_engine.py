"""The engine: HF-identical greedy decoding, hybrid exactness, sampling, stops, streaming, CLI."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from attention.masks import hybrid_mask
from attention.spec import HybridAttentionConfig
from core.tiny import save_tiny, tiny_model, tiny_tokenizer
from serve.engine import Engine
from serve.sampling import SamplingParams
from serve.text import IncrementalDetokenizer, TextStream


def no_eos(model):
    model.generation_config.eos_token_id = None
    model.config.eos_token_id = None
    return model


PROMPTS = [[1, 5, 9, 33, 200], list(range(3, 40)), [7, 8], [1] + list(range(100, 160))]


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_greedy_equals_hf_generate_with_mixed_prompt_lengths(arch):
    model = no_eos(tiny_model(arch, seed=3))
    # max_batch=2 < 4 prompts: rows are freed and reused mid-run (continuous batching).
    engine = Engine(model=model, tokenizer=tiny_tokenizer(), max_batch=2, prefill_chunk=16)
    lengths = [20, 12, 25, 9]
    params = [SamplingParams(max_new_tokens=n) for n in lengths]
    results = engine.generate(PROMPTS, params)
    for p, n, r in zip(PROMPTS, lengths, results):
        ref = model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)[0, len(p):].tolist()
        assert r.token_ids == ref
        assert r.finish_reason == "length" and r.prompt_tokens == len(p)


def test_attention_spans_cut_where_it_saves_reads():
    from serve.model import attention_spans

    # One long row among short ones: it alone, the short neighbours together.
    assert attention_spans([2000, 100, 100, 90], 2000) == [(0, 1, 2000), (1, 4, 100)]
    assert attention_spans([100, 2000, 100, 90], 2000) == [(0, 1, 100), (1, 2, 2000), (2, 4, 100)]
    # Even rows, a single row, or too little to save: all rows together over n_slots.
    assert attention_spans([2000] * 4, 2000) is None and attention_spans([500, 520, 480, 510], 520) is None
    assert attention_spans([10], 10) is None
    # Every span covers its rows' needs, the spans tile the batch in order.
    needs = [4000, 3000, 200, 100, 3900, 50]
    spans = attention_spans(needs, 4000)
    assert [a for a, _, _ in spans] == [0] + [e for _, e, _ in spans[:-1]] and spans[-1][1] == len(needs)
    assert all(n >= max(needs[a:e]) for a, e, n in spans)


def test_decode_over_per_row_spans_equals_the_batched_decode():
    """decode_one_token with row_slots (each row over its own span) == over n_slots for every row, and
    the engine's greedy tokens with very uneven rows equal each prompt decoded alone."""
    model = no_eos(tiny_model("llama", seed=5))
    engine = Engine(model=model, tokenizer=tiny_tokenizer(), max_batch=4, prefill_chunk=64)
    prompts = [list(range(3, 200)), [7, 8, 9], list(range(50, 62)), [4, 5]]
    cache = engine.model.new_cache(4, 256)
    for row, p in enumerate(prompts):
        engine.model.prefill(cache, row, torch.tensor(p), 0, logits=False)
    pos = torch.tensor([len(p) for p in prompts])
    tokens = torch.tensor([11, 12, 13, 14])
    n_slots = cache.used_slots(int(pos.max()))
    row_slots = [cache.used_slots(int(x)) for x in pos]
    from serve.model import attention_spans

    assert attention_spans(row_slots, n_slots) is not None  # the split path is taken
    k0, v0, sp0 = cache.k.clone(), cache.v.clone(), cache.slot_pos.clone()
    batched = engine.model.decode_one_token(cache, tokens, pos, n_slots)
    cache.k.copy_(k0), cache.v.copy_(v0), cache.slot_pos.copy_(sp0)
    split = engine.model.decode_one_token(cache, tokens, pos, n_slots, row_slots)
    torch.testing.assert_close(split, batched, rtol=1e-5, atol=1e-5)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=12))
    for p, out in zip(prompts, outs):
        alone = Engine(model=model, tokenizer=tiny_tokenizer(), max_batch=1).generate([p], SamplingParams(max_new_tokens=12))
        assert out.token_ids == alone[0].token_ids


def greedy_reference(model, prompt: list[int], n: int, spec: HybridAttentionConfig) -> list[int]:
    """Recompute the whole sequence with the hybrid mask at every step (no cache at all)."""
    ids = list(prompt)
    for _ in range(n):
        t = len(ids)
        additive = torch.zeros(t, t).masked_fill(~hybrid_mask(t, spec), float("-inf"))[None, None]
        with torch.no_grad():
            logits = model(torch.tensor([ids]), attention_mask=additive).logits[0, -1]
        ids.append(int(logits.argmax()))
    return ids[len(prompt):]


def test_hybrid_model_dir_decodes_exactly_with_bounded_cache(tmp_path):
    spec = HybridAttentionConfig(sink_tokens=4, window=8, global_every=6, max_globals=3)
    model = no_eos(tiny_model("llama", seed=4))
    model.config.hybrid_attention = spec.to_dict()
    model.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    engine = Engine(tmp_path, max_batch=4, prefill_chunk=5, device="cpu")  # exact: fp32, as the reference
    assert engine.spec == spec
    n = 40  # 40 + prompt wraps the 8-slot ring many times
    results = engine.generate(PROMPTS[:3], SamplingParams(max_new_tokens=n, ignore_eos=True))
    for p, r in zip(PROMPTS[:3], results):
        assert r.token_ids == greedy_reference(model, p, n, spec)
    assert engine.cache.k.shape[3] == 4 + 2 + 8 + 1  # globals at 6, 12 (0 is a sink), ring, trash
    # The same weights decoded densely disagree: the hybrid pattern is really in force.
    dense = Engine(model=model, tokenizer=tiny_tokenizer(), dense=True)
    assert dense.generate(PROMPTS[1:2], SamplingParams(max_new_tokens=n))[0].token_ids != results[1].token_ids


def test_engine_with_per_head_roles_decodes_exactly():
    """A spec with full heads (MixedKVCache) through the whole engine, prefix cache budget left on."""
    import copy

    import attention

    spec = HybridAttentionConfig(sink_tokens=3, window=8, global_every=5, max_globals=4, full_heads={0: [1]},
                                 full_layers=[1])
    model = no_eos(tiny_model("llama", seed=4))
    ref_model = attention.retrofit(copy.deepcopy(model), spec)
    model.config.hybrid_attention = spec.to_dict()
    engine = Engine(model=model, tokenizer=tiny_tokenizer(), max_batch=2, prefill_chunk=5)
    assert engine.spec == spec and engine.prefix_cache is None
    n = 30
    for _ in range(2):  # the second round would hit a prefix cache, were one on
        results = engine.generate(PROMPTS[1:3], SamplingParams(max_new_tokens=n, ignore_eos=True))
        for p, r in zip(PROMPTS[1:3], results):
            assert r.finish_reason == "length"
            ids = list(p)
            for _ in range(n):  # full recompute with the per-head boolean-mask reference
                with torch.no_grad(), attention.use_backend("sdpa"):
                    ids.append(int(ref_model(torch.tensor([ids])).logits[0, -1].argmax()))
            assert r.token_ids == ids[len(p):]


def test_a_live_model_runs_where_it_is_in_its_own_dtype():
    """Engine(model=m) without device/dtype keeps m's device and dtype: moving or casting it (Module.to works in
    place) would change the caller's model, e.g. a CPU fp32 student moved to CUDA bf16 on a GPU machine."""
    model = no_eos(tiny_model("llama", seed=4)).to(torch.bfloat16)
    weight = model.model.embed_tokens.weight
    engine = Engine(model=model, tokenizer=tiny_tokenizer(), max_batch=1, max_seq_len=32, fast_weights=False)
    assert engine.device == torch.device("cpu") and model.dtype == torch.bfloat16
    assert model.model.embed_tokens.weight is weight  # not replaced by a cast copy
    out = engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=4, ignore_eos=True))[0].token_ids
    assert len(out) == 4
    fp32 = Engine(model=no_eos(tiny_model("llama", seed=4)), tokenizer=tiny_tokenizer(), max_batch=1, max_seq_len=32,
                  dtype=torch.bfloat16, fast_weights=False)  # asked for: cast
    assert next(fp32.model.parameters()).dtype == torch.bfloat16


def test_sampling_is_seeded_and_top_k_one_is_greedy():
    model = tiny_model("qwen2", seed=5)
    engine = Engine(model=model, tokenizer=tiny_tokenizer(), max_batch=4)
    sp = SamplingParams(max_new_tokens=15, temperature=1.0, top_p=0.9, seed=123, ignore_eos=True)
    a = engine.generate([PROMPTS[0]], sp)[0].token_ids
    # Same seed, different batch companions: same tokens.
    b = engine.generate([PROMPTS[1], PROMPTS[0]], [SamplingParams(max_new_tokens=5), sp])[1].token_ids
    c = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=15, temperature=1.0, seed=124,
                                                     ignore_eos=True))[0].token_ids
    assert a == b and a != c
    greedy = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=15, ignore_eos=True))[0].token_ids
    top1 = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=15, temperature=5.0, top_k=1, seed=9,
                                                        ignore_eos=True))[0].token_ids
    assert top1 == greedy


def test_top_p_keeps_only_the_nucleus():
    from serve.sampling import sample

    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    g = torch.Generator().manual_seed(0)
    seen = {sample(logits, SamplingParams(temperature=1.0, top_p=0.75), g) for _ in range(300)}
    assert seen == {0, 1}


def test_stop_token_and_stop_string():
    model = tiny_model("llama", seed=6)
    tok = tiny_tokenizer()
    engine = Engine(model=model, tokenizer=tok)
    free = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=30, ignore_eos=True))[0]
    stop_tok = free.token_ids[5]
    r = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=30, stop_token_ids=[stop_tok]))[0]
    assert r.finish_reason == "stop" and r.token_ids == free.token_ids[:free.token_ids.index(stop_tok)]
    text = free.text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    r = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=30, ignore_eos=True, stop=[stop]))[0]
    assert r.finish_reason == "stop" and r.text == text[:text.index(stop)]


def byte_token_ids(tok, text: str) -> list[int]:
    """One token per UTF-8 byte: every multi-byte character is split across tokens."""
    # The byte-level BPE alphabet: printable bytes map to themselves, the others to 256 + k.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return tok.convert_tokens_to_ids([table[b] for b in text.encode("utf-8")])


def test_incremental_detokenizer_never_emits_broken_characters():
    tok = tiny_tokenizer()
    text = "héllo wörld ✓ naïve café, the quick brown fox"
    for ids in (byte_token_ids(tok, text), tok(text)["input_ids"]):
        d = IncrementalDetokenizer(tok)
        deltas = [d.add(i) for i in ids]
        assert all("\ufffd" not in x for x in deltas)
        assert "".join(deltas) + d.flush() == text


def test_text_stream_holds_back_stop_prefixes():
    tok = tiny_tokenizer()
    ids = byte_token_ids(tok, "abc✓de✓STOPxyz")
    s = TextStream(tok, stop=["✓ST", "zz"])
    out = [s.push(i) for i in ids]
    assert "".join(out) + s.finish() == "abc✓de"
    assert s.stopped
    # A partial stop string that never completes is released at the end.
    s = TextStream(tok, stop=["✓STOP!"])
    out = "".join(s.push(i) for i in byte_token_ids(tok, "ab✓STO")) + s.finish()
    assert out == "ab✓STO"


def test_stream_concatenation_equals_generated_text():
    model = tiny_model("llama", seed=7)
    engine = Engine(model=model, tokenizer=tiny_tokenizer())
    sp = SamplingParams(max_new_tokens=40, temperature=1.0, seed=3, ignore_eos=True)
    deltas = list(engine.stream("héllo wörld", sp))
    full = engine.generate(["héllo wörld"], sp)[0]
    assert "".join(deltas) == full.text == tiny_tokenizer().decode(full.token_ids, skip_special_tokens=True)


def test_chunked_prefill_matches_one_shot_prefill():
    model = no_eos(tiny_model("llama", seed=8))
    prompt = list(range(3, 300))
    outs = [Engine(model=model, tokenizer=tiny_tokenizer(), prefill_chunk=c)
            .generate([prompt], SamplingParams(max_new_tokens=8))[0].token_ids for c in (7, 512)]
    assert outs[0] == outs[1]


def test_background_loop_runs_its_forwards_with_its_own_thread_count():
    """Engine(threads=N).start(): every forward on the loop's thread runs with N intra-op threads, whatever
    the starting thread has (the server loads on 1 so that only the loop owns an OpenMP pool); without
    threads=, the count the starting thread had when start() was called."""
    import threading

    before = torch.get_num_threads()
    try:
        for threads, caller in ((2, 1), (None, 1), (1, 2)):
            torch.set_num_threads(caller)
            engine = Engine(model=no_eos(tiny_model("llama", seed=8)), tokenizer=tiny_tokenizer(), threads=threads)
            seen = []
            engine.on_forward = lambda kind, *_, seen=seen: seen.append(
                (kind, torch.get_num_threads(), threading.current_thread().name))
            done = threading.Event()
            engine.start()
            try:
                engine.submit(list(range(3, 40)), SamplingParams(max_new_tokens=3),
                              lambda _d, _t, finish, done=done: done.set() if finish else None)
                assert done.wait(60)
            finally:
                engine.stop()
            assert {k for k, _, _ in seen} == {"prefill", "decode"}
            assert {(n, name) for _, n, name in seen} == {(threads or caller, "engine")}
            assert torch.get_num_threads() == caller  # the caller's own count is left alone
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="threads must be >= 1"):
        Engine(model=tiny_model("llama"), tokenizer=tiny_tokenizer(), threads=0)


def test_background_loop_trims_the_heap_on_its_schedule():
    """trim_every_s: the loop calls glibc's malloc_trim between steps at most that often (never when None),
    and the tokens are the same either way."""
    import threading

    from serve.heap import malloc_trim

    if malloc_trim() is None:
        pytest.skip("not glibc: no malloc_trim (the engine then never trims)")
    outs = {}
    for every in (1e-9, None):
        engine = Engine(model=no_eos(tiny_model("llama", seed=8)), tokenizer=tiny_tokenizer())
        engine.trim_every_s = every
        done, got = threading.Event(), []
        engine.start()
        try:
            engine.submit(list(range(3, 40)), SamplingParams(max_new_tokens=6),
                          lambda _d, tok, finish, got=got, done=done: got.append(tok) if finish is None else done.set())
            assert done.wait(60)
        finally:
            engine.stop()
        outs[every] = (got, engine.trims)
    (trimmed, n_trims), (plain, no_trims) = outs[1e-9], outs[None]
    assert n_trims >= 2 and no_trims == 0 and trimmed == plain


@pytest.mark.parametrize("started", [False, True])
def test_warmup_makes_every_row_and_caches_no_prefix(started):
    """warmup(): the cache holds all max_batch rows at once (no growth, no copy, when requests come), the
    prefix cache is left empty with zeroed counters, and generation afterwards is unchanged."""
    model = no_eos(tiny_model("llama", seed=8))
    engine = Engine(model=model, tokenizer=tiny_tokenizer(), max_batch=3, prefix_block=4)
    if started:
        engine.start()
    try:
        assert engine.warmup() > 0
    finally:
        engine.stop()
    assert engine.cache.rows == 3 and engine.num_active == 0
    st = engine.prefix_cache.stats
    assert (st.bytes, st.blocks, st.lookups, st.hit_tokens, st.prompt_tokens) == (0, 0, 0, 0, 0)
    first = engine.cache
    out = engine.generate([list(range(3, 30)), [5, 6]], SamplingParams(max_new_tokens=5))
    assert engine.cache is first  # no regrowth
    ref = Engine(model=model, tokenizer=tiny_tokenizer(), max_batch=3, prefix_block=4).generate(
        [list(range(3, 30)), [5, 6]], SamplingParams(max_new_tokens=5))
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]


def test_warmup_builds_the_kernels_on_the_loop_thread_and_errors_reach_the_caller():
    """warm_kernels runs on the engine's thread (here when not started),
    for the largest chunk and every decode batch; a call that fails there raises in the caller."""
    import threading

    model = no_eos(tiny_model("llama", seed=8))
    for started in (False, True):
        engine = Engine(model=model, tokenizer=tiny_tokenizer(), max_batch=3, prefill_chunk=8)
        seen = []
        engine.model.warm_kernels = lambda rows, batch, seen=seen: seen.append(
            (rows, batch, threading.current_thread().name))
        if started:
            engine.start()
        try:
            engine.warmup()

            def boom():
                raise RuntimeError("on the loop")

            with pytest.raises(RuntimeError, match="on the loop"):
                engine._on_loop(boom)
        finally:
            engine.stop()
        assert seen == [(8 + 2, 3, "engine" if started else threading.current_thread().name)]


def test_too_long_requests_are_refused_not_truncated():
    engine = Engine(model=tiny_model("llama"), tokenizer=tiny_tokenizer(), max_seq_len=64)
    with pytest.raises(ValueError, match="exceeds the context of 64"):
        engine.generate([list(range(3, 60))], SamplingParams(max_new_tokens=10))
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)


@pytest.mark.parametrize("bad", [-1, 320, 2**40])
def test_a_prompt_token_outside_the_vocabulary_is_refused_at_submit(bad):
    """It used to reach the model's embedding lookup (an IndexError on CPU; on CUDA a device-side assert, after which
    every request fails)."""
    engine = Engine(model=tiny_model("llama"), tokenizer=tiny_tokenizer(), max_batch=2, max_seq_len=64)
    assert engine.model.config.vocab_size == 320
    with pytest.raises(ValueError, match=f"prompt token {bad} is not in the model's vocabulary \\(ids 0 to 319\\)"):
        engine.generate([[5, 6, 7], [5, bad, 6]], SamplingParams(max_new_tokens=3))
    assert engine.generate([[5, 319, 0]], SamplingParams(max_new_tokens=3, ignore_eos=True))[0].finish_reason == "length"


def test_a_refused_generate_call_leaves_nothing_queued():
    """generate() with a prompt refused after others were queued (or on an engine looping in its thread) used to
    leave those queued: they ran for no one, ahead of the next requests."""
    engine = Engine(model=tiny_model("llama"), tokenizer=tiny_tokenizer(), max_batch=1, max_seq_len=64)
    long = SamplingParams(max_new_tokens=50, ignore_eos=True)
    with pytest.raises(ValueError, match="exceeds the context of 64"):
        engine.generate([[5, 6, 7], list(range(3, 60))], long)
    forwards: list[int] = []
    engine.on_forward = lambda _kind, _t0, _t1, _n, ids: forwards.extend(ids)
    got = engine.generate([[9, 9]], SamplingParams(max_new_tokens=2, ignore_eos=True))[0]
    assert len(got.token_ids) == 2 and len(set(forwards)) == 1 and len(forwards) == 2  # its prefill, one decode
    assert engine.num_waiting == engine.num_active == 0
    engine.start()
    try:
        with pytest.raises(RuntimeError, match="background thread"):
            engine.generate([[5, 6, 7]], long)
        assert engine.num_waiting == engine.num_active == 0 and len(forwards) == 2
    finally:
        engine.stop()


@pytest.mark.slow
def test_generate_cli_streams_text(tmp_path):
    save_tiny(tmp_path, arch="qwen2")
    proc = subprocess.run(
        [sys.executable, "-m", "serve.generate", "--model", str(tmp_path), "--prompt", "hello", "--chat",
         "--max-new-tokens", "8", "--temperature", "0"],
        capture_output=True, text=True, timeout=120, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    assert "dense cache" in proc.stderr
    bad = subprocess.run([sys.executable, "-m", "serve.generate", "--model", str(tmp_path / "nope"),
                          "--prompt", "x"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("error:")


def test_max_seq_len_beyond_the_models_positions_is_refused(tmp_path, monkeypatch):
    """Past max_position_embeddings (512 here): positions the model never saw and a KV cache sized for them;
    from a directory, refused from its config before the weights load."""
    import serve.engine

    with pytest.raises(ValueError, match="max_seq_len 513 exceeds the model's max_position_embeddings=512"):
        Engine(model=tiny_model("llama"), tokenizer=tiny_tokenizer(), max_seq_len=513)
    with pytest.raises(ValueError, match="max_seq_len must be >= 2"):
        Engine(model=tiny_model("llama"), tokenizer=tiny_tokenizer(), max_seq_len=1)
    assert Engine(model=tiny_model("llama"), tokenizer=tiny_tokenizer(), max_seq_len=512).max_seq_len == 512
    save_tiny(tmp_path, arch="qwen2")

    def no_load(*_a, **_k):
        raise AssertionError("the weights loaded")

    monkeypatch.setattr(serve.engine, "load_causal_lm", no_load)
    with pytest.raises(ValueError, match="max_seq_len 600 exceeds the model's max_position_embeddings=512"):
        Engine(tmp_path, max_seq_len=600)


@pytest.mark.parametrize("started", [False, True])
def test_a_warmup_whose_request_fails_raises(started):
    """warmup() raises WarmupError naming the cause when a warm-up request fails (it used to return its time as
    if all went well, and the server opened its port to fail every request)."""
    from serve.engine import WarmupError

    engine = Engine(model=no_eos(tiny_model("llama", seed=8)), tokenizer=tiny_tokenizer(), max_batch=2)

    def no_memory(*_a, **_k):
        raise RuntimeError("can't allocate memory: you tried to allocate 184320000000 bytes")

    engine.model.new_cache = no_memory
    if started:
        engine.start()
    try:
        with pytest.raises(WarmupError, match=r"request failed \(RuntimeError: can't allocate memory.*lower "
                                              r"--max-batch or --max-seq-len") as e:
            engine.warmup()
        assert isinstance(e.value.__cause__, RuntimeError) and engine.num_active == 0
    finally:
        engine.stop()


@pytest.mark.parametrize("first_inside", [True, False])
def test_an_engine_works_inside_and_outside_inference_mode_alike(first_inside):
    """The engine's own tensors (KV cache, prefix-cache pool, decode inputs) stay usable whichever grad mode a
    caller is in: an engine first used (or made) under torch.inference_mode() used to fail every later request
    outside it ("Inplace update to inference tensor outside InferenceMode"), and outputs stay the same."""
    import contextlib

    model = no_eos(tiny_model("llama", seed=7))
    sp = SamplingParams(max_new_tokens=6, ignore_eos=True)
    # The second prompt restores the first's prefix blocks and captures new ones into the same pool slab.
    prompts = [list(range(3, 75)), list(range(3, 75)) + list(range(200, 240))]
    ref = [Engine(model=model, tokenizer=tiny_tokenizer(), max_batch=2).generate([p], sp)[0].token_ids
           for p in prompts]
    modes = [torch.inference_mode, contextlib.nullcontext]
    if not first_inside:
        modes.reverse()
    with modes[0]():
        engine = Engine(model=model, tokenizer=tiny_tokenizer(), max_batch=2)
        first = engine.generate([prompts[0]], sp)[0]
    with modes[1]():
        second = engine.generate([prompts[1]], sp)[0]
    assert first.finish_reason == second.finish_reason == "length"
    assert [first.token_ids, second.token_ids] == ref
    assert second.prompt_tokens == len(prompts[1]) and engine.prefix_cache.stats.hit_tokens == 64
    assert engine.prefix_cache.stats.blocks == 3
