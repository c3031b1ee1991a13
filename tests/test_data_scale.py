"""Prepared, memory-mapped, mixed, resumable and streamed data (distill.data, issue 18)."""

import hashlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from core.corpus import heldout as _heldout
from core.tiny import tiny_model, tiny_tokenizer
from distill import data as D
from distill.data import parallel
from distill.data import prepare as P
from distill.data.order import MixtureOrder, permute
from distill.data.text import DataError, SourceSpec
from tests.helpers import ROOT, child_env

WORDS = "the quick brown fox jumps over the lazy dog distill teacher héllo wörld café naïve".split()


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def _texts(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(5, 60)))) for _ in range(n)]


def _jsonl(path: Path, texts: list[str]) -> str:
    path.write_text("\n".join(json.dumps({"text": t}) for t in texts) + "\n")
    return str(path)


def _chat(path: Path, n: int) -> str:
    rows = []
    for i in range(n):
        rows.append({"messages": [{"role": "user", "content": f"the fox {i} over"},
                                  {"role": "assistant", "content": "the lazy dog " * (1 + i % 3)},
                                  {"role": "user", "content": "distill"},
                                  {"role": "assistant", "content": "café naïve"}]})
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def _reference_pack(texts: list[str], tok, seq_len: int, fraction: float):
    """The pre-issue-18 path: hash-split documents (by their whole text), then data.pack in one process."""
    held = [_heldout(hashlib.sha256(t.encode()).hexdigest(), fraction) for t in texts]
    return (D.pack([t for t, h in zip(texts, held) if not h], tok, seq_len),
            D.pack([t for t, h in zip(texts, held) if h], tok, seq_len))


# -- prepare ---------------------------------------------------------------------------------

def test_prepared_blocks_equal_the_in_memory_reference_and_are_compact(tmp_path, tok):
    texts = _texts(400, 0)
    src = _jsonl(tmp_path / "a.jsonl", texts)
    prep = P.prepare_source(SourceSpec(src), tok, P.PackSettings(16, eval_fraction=0.2),
                            data_cache=str(tmp_path / "c"), progress=False)
    train, held = _reference_pack(texts, tok, 16, 0.2)
    assert isinstance(prep.train, np.memmap) and prep.train.dtype == np.uint16  # vocab 320 fits in 16 bits
    assert np.array_equal(np.asarray(prep.train, dtype=np.int64), train.numpy())
    assert np.array_equal(np.asarray(prep.eval, dtype=np.int64), held.numpy())
    assert (prep.path / "train.bin").stat().st_size == train.numel() * 2
    assert prep.meta["train_blocks"] == train.shape[0] and prep.meta["bytes"] > 0
    assert P.token_dtype(70_000) == np.uint32


def test_prepare_works_with_datasets_before_4_which_has_no_list_feature(tmp_path, tok, monkeypatch):
    import datasets

    monkeypatch.delattr(datasets, "List", raising=False)  # datasets 3.x: variable-length lists are Sequence
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in Path(_chat(tmp_path / "chat.jsonl", 30)).read_text().splitlines()]
    src = str(tmp_path / "chat.parquet")  # parquet goes through datasets.map (jsonl has its own reader)
    pq.write_table(pa.Table.from_pylist(rows), src)
    prep = P.prepare_source(SourceSpec(src), tok, P.PackSettings(32, eval_fraction=0.0), data_cache=str(tmp_path / "c"),
                            progress=False)
    ids, masks = D.text.encode_chat(tok, [rows[0]["messages"]], True)
    n = len(ids[0])
    assert np.asarray(prep.train).reshape(-1)[:n].tolist() == ids[0]
    assert np.asarray(prep.train_mask).reshape(-1)[:n].tolist() == masks[0]


def test_blocks_read_prepared_rows_with_pread_not_through_the_map(tmp_path, tok, monkeypatch):
    from distill.data import corpus as C

    src = _jsonl(tmp_path / "a.jsonl", _texts(400, 7))
    prep = P.prepare_source(SourceSpec(src), tok, P.PackSettings(16), data_cache=str(tmp_path / "c"), progress=False)
    n = prep.train.shape[0]
    calls = []
    real = os.preadv
    monkeypatch.setattr(C.os, "preadv", lambda *a: calls.append(a[2]) or real(*a))
    for view in (prep.train, prep.train[: n - 3], prep.train[5:]):  # views that start at row 0 and later
        idx = torch.tensor([3, 0, len(view) - 1, 3, 7])
        got = C.Blocks([view], [None], 16)[idx]
        assert torch.equal(got, torch.from_numpy(np.asarray(view, dtype=np.int64)[idx.numpy()]))
    assert len(calls) == 15 and calls[-5] == (5 + 0) * 32  # row 0 of the view prep.train[5:], 16 uint16s a row
    plain = C.Blocks([np.asarray(prep.train)], [None], 16)  # an in-memory array is indexed, not read
    assert torch.equal(plain[torch.tensor([1, 2])], C.Blocks([prep.train], [None], 16)[torch.tensor([1, 2])])
    assert len(calls) == 17


def test_direct_encoder_equals_the_tokenizer_call(tok):
    texts = _texts(50, 8) + ["", " ", "the </s> fox <s> café", "\n\n\t dog"]
    assert P._encoder(tok)(texts) == tok(texts, add_special_tokens=False)["input_ids"]
    tok.backend_tokenizer.enable_truncation(4)  # a backend setting the tokenizer call overrides: not used directly
    try:
        assert P._encoder(tok)(texts) == tok(texts, add_special_tokens=False)["input_ids"]
    finally:
        tok.backend_tokenizer.no_truncation()


def test_multiprocess_prepare_equals_single_process(tmp_path, tok, monkeypatch):
    src = _jsonl(tmp_path / "a.jsonl", _texts(300, 1))
    monkeypatch.setattr(P, "_MIN_RECORDS_PER_PROC", 10)
    monkeypatch.setattr(P, "_MIN_BYTES_PER_PROC", 100)
    monkeypatch.setattr(parallel, "_MIN_RANGE", 500)  # many byte ranges, cut mid-file
    one = P.prepare_source(SourceSpec(src), tok, P.PackSettings(16), data_cache=str(tmp_path / "c1"), num_proc=1,
                           progress=False)
    two = P.prepare_source(SourceSpec(src), tok, P.PackSettings(16), data_cache=str(tmp_path / "c2"), num_proc=2,
                           progress=False)
    assert two.meta["num_proc"] == 2 and two.meta["reader"] == "jsonl-ranges"
    assert np.array_equal(one.train, two.train) and np.array_equal(one.eval, two.eval)
    # The datasets reader (what hub / parquet / txt sources use) packs the same file identically.
    monkeypatch.setattr(P, "_jsonl_files", lambda spec: None)
    via = P.prepare_source(SourceSpec(src), tok, P.PackSettings(16), data_cache=str(tmp_path / "c3"), num_proc=2,
                           progress=False)
    assert via.meta["reader"] == "datasets" and via.meta["num_proc"] == 2
    assert np.array_equal(one.train, via.train) and np.array_equal(one.eval, via.eval)


def test_jsonl_reader_skips_blank_lines_like_datasets_and_names_a_bad_line(tmp_path, tok, monkeypatch):
    texts = _texts(120, 4)
    lines = [json.dumps({"text": t}) + ("\n\n   \n" if i % 7 == 0 else "\n") for i, t in enumerate(texts)]
    src = tmp_path / "blank.jsonl"
    src.write_text("".join(lines))
    monkeypatch.setattr(parallel, "_MIN_RANGE", 300)
    direct = P.prepare_source(SourceSpec(str(src)), tok, P.PackSettings(16, eval_fraction=0.2),
                              data_cache=str(tmp_path / "c1"), num_proc=1, progress=False)
    train, held = _reference_pack(texts, tok, 16, 0.2)  # record i = the i-th non-blank line
    assert direct.meta["reader"] == "jsonl-ranges"
    assert np.array_equal(np.asarray(direct.train, dtype=np.int64), train.numpy())
    assert np.array_equal(np.asarray(direct.eval, dtype=np.int64), held.numpy())
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(lines[:50]) + "{not json\n" + "".join(lines[50:]))
    with pytest.raises(DataError, match=r"record 50 is not valid JSON .* fix or remove that line"):
        P.prepare_source(SourceSpec(str(bad)), tok, P.PackSettings(16), data_cache=str(tmp_path / "c2"),
                         num_proc=1, progress=False)
    assert [p for p in (tmp_path / "c2").iterdir()] == []  # nothing left that a later run would trust


def test_cache_is_reused_and_invalidated_by_source_tokenizer_and_seq_len(tmp_path, tok, monkeypatch):
    src = _jsonl(tmp_path / "a.jsonl", _texts(200, 2))
    cache = str(tmp_path / "c")
    first = P.prepare_source(SourceSpec(src), tok, P.PackSettings(16), data_cache=cache, progress=False)

    def boom(*_a, **_k):
        raise AssertionError("a cached source was tokenized again")

    monkeypatch.setattr(P, "_records", boom)
    monkeypatch.setattr(P, "_tokenize_fn", boom)
    again = P.prepare_source(SourceSpec(src), tok, P.PackSettings(16), data_cache=cache, progress=False)
    assert again.path == first.path
    monkeypatch.undo()

    paths = {first.path}
    paths.add(P.prepare_source(SourceSpec(src), tok, P.PackSettings(32), data_cache=cache, progress=False).path)
    other = tiny_tokenizer()
    other.add_tokens(["distill"])  # another vocabulary
    paths.add(P.prepare_source(SourceSpec(src), other, P.PackSettings(16), data_cache=cache, progress=False).path)
    _jsonl(tmp_path / "a.jsonl", _texts(201, 2))  # the source changed
    paths.add(P.prepare_source(SourceSpec(src), tok, P.PackSettings(16), data_cache=cache, progress=False).path)
    assert len(paths) == 4

    # A prepared folder passed as a source is opened only if it matches this run.
    data = D.build_data(tok, dataset=str(first.path), seq_len=16, eval_blocks=2, data_cache=cache)
    assert data.train.shape[1] == 16
    with pytest.raises(DataError, match="prepared with seq_len=16 but this run uses seq_len=32; prepare it again"):
        D.build_data(tok, dataset=str(first.path), seq_len=32, eval_blocks=2, data_cache=cache)
    with pytest.raises(DataError, match="prepared with tokenizer=.* prepare it again"):
        D.build_data(other, dataset=str(first.path), seq_len=16, eval_blocks=2, data_cache=cache)


def test_interrupted_prepare_leaves_nothing_a_later_run_trusts(tmp_path, tok, monkeypatch):
    src = _jsonl(tmp_path / "a.jsonl", _texts(200, 3))
    cache = tmp_path / "c"

    def killed(*_a, **_k):
        raise KeyboardInterrupt

    monkeypatch.setattr(P, "_pack", killed)  # the datasets reader's last stage
    monkeypatch.setattr(parallel, "_tokenize_range", killed)  # the jsonl reader's workers
    with pytest.raises(KeyboardInterrupt):
        P.prepare_source(SourceSpec(src), tok, P.PackSettings(16), data_cache=str(cache), progress=False)
    assert list(cache.iterdir()) == []
    monkeypatch.undo()
    # A torn file in a complete-looking folder is refused, not read.
    prep = P.prepare_source(SourceSpec(src), tok, P.PackSettings(16), data_cache=str(cache), progress=False)
    with open(prep.path / "train.bin", "r+b") as f:
        f.truncate(10)
    with pytest.raises(DataError, match="damaged: delete"):
        P.open_prepared(prep.path)


def test_a_cached_start_imports_neither_datasets_nor_pyarrow(tmp_path, tok):
    a = _jsonl(tmp_path / "a.jsonl", _texts(200, 5))
    b = tmp_path / "b.txt"  # read through datasets when prepared: a cache miss would import it
    b.write_text("\n".join(_texts(200, 6)) + "\n")
    mix = [{"source": a, "weight": 1}, {"source": str(b), "weight": 2}]
    cache = tmp_path / "c"
    D.build_data(tok, datasets=mix, seq_len=16, eval_blocks=2, data_cache=str(cache), progress=False)
    before = sorted(p.name for p in cache.iterdir())
    tok.save_pretrained(tmp_path / "tok")
    code = (f"import sys\nfrom transformers import AutoTokenizer\nfrom distill.data import build_data\n"
            f"tok = AutoTokenizer.from_pretrained({str(tmp_path / 'tok')!r})\n"
            f"d = build_data(tok, datasets={mix!r}, seq_len=16, eval_blocks=2, data_cache={str(cache)!r}, "
            "progress=False)\n"
            "o = d.order(4, 0); next(o.micro_batches(d.train, 0, 0, 1, 2))\n"
            "print(sorted(m for m in ('datasets', 'pyarrow', 'pandas') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True,
                         env=child_env())
    assert sorted(p.name for p in cache.iterdir()) == before  # both sources were cache hits
    assert out.stdout.strip().splitlines()[-1] == "[]"


# -- mixtures and order ------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 1000, 4097])
def test_permute_is_a_keyed_bijection(n):
    a = permute(np.arange(n), n, key=5)
    assert sorted(a.tolist()) == list(range(n))
    if n > 8:
        assert not np.array_equal(a, permute(np.arange(n), n, key=6))
        assert not np.array_equal(a, np.arange(n))


def test_mixture_proportions_epochs_and_sharding():
    sizes, weights, batch = [5000, 700, 60], [0.6, 0.3, 0.1], 32
    order = MixtureOrder(sizes, weights, batch, seed=7)
    steps = 10_016 // batch  # >= 10K blocks
    idx = np.concatenate([order.step_indices(t).numpy() for t in range(steps)])
    src = order.source_of(idx)
    frac = np.bincount(src, minlength=3) / idx.size
    assert np.all(np.abs(frac - np.array(weights)) < 0.01), frac
    # Stratified: after every step the running count is within a few blocks of n·p (slots are shuffled
    # inside a step, so mid-step it may differ by up to a step's share).
    running = np.cumsum(np.eye(3, dtype=int)[src], axis=0)[batch - 1::batch]
    expect = np.arange(1, steps + 1)[:, None] * batch * np.array(weights)
    assert np.abs(running - expect).max() <= 2
    assert np.array_equal(order.draws_before(steps), np.bincount(src, minlength=3))
    # Each source is drawn epoch by epoch: every block recurs equally often (±1), ~17 passes over the
    # small source, ~1.2 over the big one.
    for s, n in enumerate(sizes):
        counts = np.bincount(idx[src == s] - order.offsets[s], minlength=n)
        assert counts.size == n and counts.max() - counts.min() <= 1
    assert order.epochs(steps)[2] > 16 and 1 < order.epochs(steps)[0] < 1.3
    # Ranks split each step without overlap or loss.
    blocks = torch.arange(sum(sizes)).unsqueeze(1)
    got = [i for r in range(4) for i, _ in order.micro_batches(blocks, 5, r, 4, 4)]
    assert sorted(torch.cat(got).tolist()) == sorted(order.step_indices(5).tolist())


def test_resume_after_a_kill_reads_the_same_blocks(tmp_path, tok):
    """A process killed mid-run, and a fresh one started at its step, read exactly the uninterrupted blocks."""
    a = _jsonl(tmp_path / "a.jsonl", _texts(300, 4))
    b = _jsonl(tmp_path / "b.jsonl", _texts(80, 5))
    cache = str(tmp_path / "c")
    mixture = [{"source": a, "weight": 3}, {"source": b, "weight": 1}]
    data = D.build_data(tok, datasets=mixture, seq_len=16, eval_blocks=4, data_cache=cache, progress=False)
    paths = [r.path for r in data.sources]
    # The training process of a resumed run: maps the prepared folders, builds the order, reads its steps.
    script = f"""
import os, sys, json, hashlib
sys.path.insert(0, {str(ROOT)!r})
from distill.data import Blocks, MixtureOrder, open_prepared
parts = [open_prepared(p) for p in {paths!r}]
blocks = Blocks([p.train for p in parts], [p.train_mask for p in parts], 16)
order = MixtureOrder(blocks.sizes, [3, 1], 6, seed=11)
start, kill = int(sys.argv[1]), int(sys.argv[2])
with open(sys.argv[3], 'a') as f:
    for step in range(start, 12):
        for rank in range(2):
            for index, b in order.micro_batches(blocks, step, rank, 2, 3):
                f.write(json.dumps([step, rank, index.tolist(), hashlib.sha1(b.numpy().tobytes()).hexdigest()]) + '\\n')
        f.flush()
        if step + 1 == kill:
            os._exit(137)
"""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    resumed = tmp_path / "resumed.jsonl"
    for args, code in ((["0", "5"], 137), (["5", "0"], 0)):
        r = subprocess.run([sys.executable, "-c", script, *args, str(resumed)], env=env, capture_output=True, text=True)
        assert r.returncode == code, r.stderr[-2000:]
    # The uninterrupted run, in this process through build_data's own order.
    order = data.order(6, seed=11)
    full = []
    for step in range(12):
        for rank in range(2):
            for index, b in order.micro_batches(data.train, step, rank, 2, 3):
                full.append([step, rank, index.tolist(), hashlib.sha1(b.numpy().tobytes()).hexdigest()])
    assert [json.loads(line) for line in resumed.read_text().splitlines()] == full


# -- build_data: mixtures, budget, bad input ---------------------------------------------------

def test_mixture_build_reports_sources_and_splits_heldout_by_weight(tmp_path, tok):
    a = _jsonl(tmp_path / "a.jsonl", _texts(300, 6))
    b = _jsonl(tmp_path / "b.jsonl", _texts(300, 7))
    data = D.build_data(tok, datasets=[{"source": a, "weight": 0.75}, {"source": b, "weight": 0.25}], seq_len=16,
                        eval_blocks=8, data_cache=str(tmp_path / "c"), progress=False)
    assert [r.eval_blocks for r in data.sources] == [6, 2] and data.eval.shape == (8, 16)
    ref_a, _ = _reference_pack(_texts(300, 6), tok, 16, 0.05)
    assert torch.equal(data.train[torch.arange(5)], ref_a[:5])
    n_a = ref_a.shape[0]
    assert data.train.sizes[0] == n_a and data.train.shape[0] == n_a + data.train.sizes[1]
    order = data.order(8, seed=0)
    rows = data.summary(order, 100)
    assert rows["a.jsonl"]["weight"] == 0.75
    assert rows["a.jsonl"]["epochs"] == pytest.approx(600 / n_a, rel=0.02)
    assert D.steps_for_tokens(10_000, 8, 16) == 79  # ceil(10000 / 128)


def test_bad_input_gives_one_line_errors_that_name_the_fix(tmp_path, tok):
    a = _jsonl(tmp_path / "a.jsonl", _texts(30, 8))
    cache = str(tmp_path / "c")
    cases = [
        (dict(datasets=[{"source": str(tmp_path / "missing.jsonl")}]), "does not exist; check the path"),
        (dict(datasets=[{"source": a, "weight": 0}]), r"weights must be > 0 \(remove the source"),
        (dict(datasets=[{"source": a, "weight": -1}]), "weights must be > 0"),
        (dict(datasets=[{"source": a, "wieght": 1}]), "unknown keys"),
        (dict(dataset=a, min_train_blocks=10_000), "add data, lower seq_len, or lower max_steps/batch size"),
    ]
    for kw, msg in cases:
        with pytest.raises(DataError, match=msg) as err:
            D.build_data(tok, seq_len=16, eval_blocks=1, data_cache=cache, progress=False, **kw)
        assert "\n" not in str(err.value)
    with pytest.raises(DataError, match="cannot fill one global batch of 64; add data or lower"):
        MixtureOrder([30, 20], [1, 1], 64, 0)
    from core.config import ConfigError
    from distill.config import DistillConfig

    with pytest.raises(ConfigError, match="teacher_cache indexes prepared blocks.*set streaming=false"):
        DistillConfig(teacher_cache=str(tmp_path), hidden_weight=0, attn_weight=0,
                      datasets=[{"source": a, "streaming": True}, {"source": a}])


# -- completion-only chat ------------------------------------------------------------------------

def test_chat_mask_marks_assistant_tokens_only(tmp_path, tok):
    src = _chat(tmp_path / "chat.jsonl", 60)
    prep = P.prepare_source(SourceSpec(src), tok, P.PackSettings(32, eval_fraction=0.0), data_cache=str(tmp_path / "c"),
                            progress=False)
    assert prep.meta["has_mask"] and prep.train_mask.shape == prep.train.shape
    # Reference: render one conversation and mark the characters of each assistant reply by hand.
    msgs = json.loads(Path(src).read_text().splitlines()[0])["messages"]
    ids, masks = D.text.encode_chat(tok, [msgs], True)
    text = tok.apply_chat_template(msgs, tokenize=False)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    assert ids[0] == enc["input_ids"]
    target = "".join(tok.decode([t]) for t, m in zip(ids[0], masks[0]) if m)
    # Each reply, its end-of-turn token and the template's newline after it (core.tiny.CHAT_TEMPLATE).
    assert target == "the lazy dog </s>\ncafé naïve</s>\n"
    flat_ids = np.asarray(prep.train).reshape(-1)
    flat_mask = np.asarray(prep.train_mask).reshape(-1)
    n = len(ids[0])
    assert flat_ids[:n].tolist() == ids[0] and flat_mask[:n].tolist() == masks[0]
    assert flat_mask[n] == 0  # the joining EOS is context, not a target
    off = P.prepare_source(SourceSpec(src), tok, P.PackSettings(32, eval_fraction=0.0, completion_only=False),
                           data_cache=str(tmp_path / "c"), progress=False)
    assert off.train_mask is None and np.array_equal(off.train, prep.train)


def test_heldout_loss_on_chat_counts_assistant_tokens_only(tmp_path, tok):
    from accelerate import Accelerator

    from distill.training import evaluate
    from eval.metrics import evaluate_lm

    src = _chat(tmp_path / "chat.jsonl", 80)
    data = D.build_data(tok, dataset=src, seq_len=32, eval_blocks=4, eval_fraction=0.3, data_cache=str(tmp_path / "c"),
                        progress=False)
    assert data.eval_mask is not None and 0 < data.eval_mask.float().mean() < 1
    model = tiny_model(vocab=max(len(tok), 320))
    # Naive reference: every position t whose label t+1 is an assistant token, one at a time.
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=data.eval).logits.float(), -1)
    nll, n = 0.0, 0
    for b in range(data.eval.shape[0]):
        for t in range(data.eval.shape[1] - 1):
            if data.eval_mask[b, t + 1]:
                nll -= float(logp[b, t, data.eval[b, t + 1]])
                n += 1
    stats, ref = evaluate(Accelerator(cpu=True), model, data.eval, 3, reference=model, mask=data.eval_mask)
    assert stats.tokens == n == ref.tokens == stats.ref_tokens
    assert stats.loss == pytest.approx(nll / n, rel=1e-5) and ref.loss == pytest.approx(nll / n, rel=1e-5)
    everything = evaluate_lm(model, D.eval_batches(data.eval, 3))[0]
    assert everything.tokens == data.eval.numel() - data.eval.shape[0] > n
    assert everything.loss != pytest.approx(stats.loss, rel=1e-3)


def test_blocks_over_many_raw_files_keep_few_open(tmp_path):
    """Thousands of shard files (a teacher cache) must not exhaust file descriptors: reads stay correct while
    only ``max_open_files`` stay open, the least recently used closed first."""
    from distill.data.corpus import FileArray

    parts, want = [], []
    for i in range(5):
        arr = np.arange(i * 100, i * 100 + 12, dtype=np.int32).reshape(3, 4)
        path = tmp_path / f"f{i}.bin"
        path.write_bytes(b"\0" * 7 + arr.tobytes())  # data from byte 7, after a header
        parts.append(FileArray(str(path), 7, np.dtype(np.int32), (3, 4)))
        want.append(arr)
    blocks = D.Blocks(parts, [None] * 5, 4)
    blocks.max_open_files = 2
    pick = np.array([14, 0, 7, 3, 12, 5])
    got = blocks.rows(pick)
    assert got.dtype == np.int32 and np.array_equal(got, np.concatenate(want)[pick])
    assert len(blocks._fds) == 2 and torch.equal(blocks[torch.tensor([3])], torch.tensor([[100, 101, 102, 103]]))


@pytest.mark.parametrize("n,world,batch", [(5, 2, 2), (7, 4, 1), (3, 4, 2), (9, 2, 4), (8, 2, 2)])
def test_eval_batches_give_every_rank_the_same_number_of_forwards(n, world, batch):
    """ZeRO-3 forwards are collective: a rank one batch short hangs the others (5 blocks, 2 ranks, batch 2 did).

    Summed over ranks the stats equal one process's over all blocks: fillers run the forward and score nothing.
    """
    from eval.metrics import LMStats, evaluate_lm

    blocks = torch.randint(0, 64, (n, 12), generator=torch.Generator().manual_seed(n))
    mask = torch.rand(n, 12, generator=torch.Generator().manual_seed(1)) < 0.7
    ranks = [list(D.eval_batches(blocks, batch, r, world, mask=mask)) for r in range(world)]
    assert len({len(b) for b in ranks}) == 1 and len(ranks[0]) == math.ceil(math.ceil(n / world) / batch)
    model = tiny_model(vocab=64)
    total = LMStats()
    for r in range(world):
        s = evaluate_lm(model, ranks[r])[0]
        total.nll_sum, total.tokens = total.nll_sum + s.nll_sum, total.tokens + s.tokens
    whole = evaluate_lm(model, D.eval_batches(blocks, n, mask=mask))[0]
    assert total.tokens == whole.tokens == int((mask[:, 1:]).sum())
    assert total.nll_sum == pytest.approx(whole.nll_sum, rel=1e-5)


def test_completion_only_mask_reaches_every_loss_term(tmp_path, tok):
    from distill import losses
    from distill.losses import normalized_mse
    from distill.model import DistillModel, LossConfig

    def loss_config(**kw) -> LossConfig:  # LossConfig has no defaults of its own
        base = dict(kd_weight=1.0, kd_kind="forward_kl", temperature=1.0, beta=0.5, kd_chunk_size=None, ce_weight=0.0,
                    focal_weight=0.0, focal_alpha=0.25, focal_gamma=2.0, hidden_weight=0.0, hidden_layers=[],
                    hidden_kind="nmse", attn_weight=0.0, attn_layers=[], attn_num_queries=64)
        return LossConfig(**(base | kw))

    src = _chat(tmp_path / "chat.jsonl", 40)
    data = D.build_data(tok, dataset=src, seq_len=32, eval_blocks=1, data_cache=str(tmp_path / "c"), progress=False)
    index = torch.arange(4)
    ids, mask = data.train[index], data.train.loss_mask(index)
    assert mask is not None and 0 < mask.float().mean() < 1
    student, teacher = tiny_model(seed=0, vocab=len(tok)), tiny_model(seed=1, layers=3, vocab=len(tok))
    cfg = loss_config(kd_weight=1.0, ce_weight=0.5, hidden_weight=0.3, hidden_layers=["0:1"], kd_chunk_size=None,
                      temperature=1.0)
    model = DistillModel(student, teacher, cfg)
    out = model(input_ids=ids, loss_mask=mask)
    out.loss.backward()
    grads = [p.grad.clone() for p in student.parameters()]

    # Naive reference: full logits, terms restricted by hand to positions that predict an assistant token.
    student.zero_grad()
    valid = mask[:, 1:]
    s_out = student(input_ids=ids, output_hidden_states=True)
    with torch.no_grad():
        t_out = teacher(input_ids=ids, output_hidden_states=True)
    kd = losses.kd_loss(s_out.logits[:, :-1], t_out.logits[:, :-1], valid)
    ce = losses.ce_loss(s_out.logits[:, :-1], ids[:, 1:].masked_fill(~valid, -100))
    pos = torch.cat([valid, torch.zeros(4, 1, dtype=torch.bool)], dim=1)
    hid = normalized_mse(s_out.hidden_states[1], t_out.hidden_states[2], pos)  # outputs of layers 0 and 1
    ref = kd + 0.5 * ce + 0.3 * hid
    ref.backward()
    torch.testing.assert_close(out.kd, kd, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.ce, ce, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.hidden, hid, rtol=1e-5, atol=1e-6)
    for g, p in zip(grads, student.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-6)
    # The chunked path (the recipes' default) agrees, and the mask really changes the loss.
    chunked = DistillModel(student, teacher, loss_config(kd_weight=1.0, ce_weight=0.5, kd_chunk_size=8,
                                                         temperature=1.0))
    c = chunked(input_ids=ids, loss_mask=mask)
    torch.testing.assert_close(c.kd, kd, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(c.ce, ce, rtol=1e-5, atol=1e-6)
    assert not torch.isclose(chunked(input_ids=ids).kd, kd)


# -- streaming -----------------------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore:streamed data resumes")
def test_streaming_reads_the_prepared_blocks_in_order_and_resumes(tmp_path, tok):
    texts = _texts(300, 9)
    src = _jsonl(tmp_path / "a.jsonl", texts)
    with pytest.warns(UserWarning, match="resumes by re-reading the stream .* exact only if the source yields"):
        streamed = D.build_data(tok, dataset=src, seq_len=16, eval_blocks=3, streaming=True)
    prepared = D.build_data(tok, dataset=src, seq_len=16, eval_blocks=3, data_cache=str(tmp_path / "c"),
                            progress=False)
    assert torch.equal(streamed.eval, prepared.eval)
    order = streamed.order(4, seed=0)
    run = [torch.cat([b for _, b in order.micro_batches(streamed.train, t, r, 2, 1)]) for t in range(6)
           for r in range(2)]
    assert torch.equal(torch.cat(run), prepared.train[torch.arange(24)])
    # A fresh process resuming at step 4 (rank 1) reads the uninterrupted run's blocks.
    fresh = D.build_data(tok, dataset=src, seq_len=16, eval_blocks=3, streaming=True)
    got = torch.cat([b for _, b in fresh.order(4, seed=0).micro_batches(fresh.train, 4, 1, 2, 1)])
    assert torch.equal(got, prepared.train[torch.arange(18, 20)])
    held = _jsonl(tmp_path / "held.jsonl", _texts(50, 12))
    with_held = D.build_data(tok, dataset=src, eval_dataset=held, seq_len=16, eval_blocks=3, streaming=True,
                             data_cache=str(tmp_path / "c"), progress=False)
    assert torch.equal(with_held.eval, D.pack(_texts(50, 12), tok, 16)[:3])


@pytest.mark.filterwarnings("ignore:streamed data resumes")
@pytest.mark.filterwarnings("error:stream rewound")  # every process must read each stream forward only
def test_a_mixture_with_a_stream_keeps_weights_reads_forward_and_resumes(tmp_path, tok):
    a = _jsonl(tmp_path / "a.jsonl", _texts(400, 20))
    b = _jsonl(tmp_path / "b.jsonl", _texts(300, 21))
    cache = str(tmp_path / "c")
    mix = [{"source": a, "weight": 1, "streaming": True}, {"source": b, "weight": 2}]
    data = D.build_data(tok, datasets=mix, seq_len=16, eval_blocks=6, data_cache=cache, progress=False)
    ref = [D.build_data(tok, dataset=x, seq_len=16, eval_blocks=6, data_cache=cache, progress=False) for x in (a, b)]
    assert data.train.sizes == [None, ref[1].train.shape[0]]
    assert [r.eval_blocks for r in data.sources] == [2, 4]  # held-out shared by weight
    assert torch.equal(data.eval[:2], ref[0].eval[:2]) and torch.equal(data.eval[2:], ref[1].eval[:4])
    order = data.order(6, seed=0)
    seen, run = [], {}
    for t in range(8):
        for r in range(2):
            for index, blocks in order.micro_batches(data.train, t, r, 2, 1):
                run.setdefault((t, r), []).append((int(index), blocks))
                s, local = int(index) % 2, int(index) // 2
                # The stream's k-th block is the prepared source's k-th block, unshuffled.
                assert torch.equal(blocks[0], ref[s].train[local] if s else ref[0].train[local])
                seen.append((t, s, local))
    stream = [k for _, s, k in seen if s == 0]
    assert stream == list(range(16))  # weight 1/3 of 6 blocks a step, read in stream order
    assert all(sum(1 for u, s, _ in seen if u == t and s == 1) == 4 for t in range(8))
    assert len({k for _, s, k in seen if s == 1}) == 32  # the prepared source stays shuffled, no repeats
    # A fresh process resuming at step 5 (rank 1) reads what the uninterrupted run read.
    fresh = D.build_data(tok, datasets=mix, seq_len=16, eval_blocks=6, data_cache=cache, progress=False)
    got = list(fresh.order(6, seed=0).micro_batches(fresh.train, 5, 1, 2, 1))
    assert [int(i) for i, _ in got] == [i for i, _ in run[(5, 1)]]
    assert all(torch.equal(g, w) for (_, g), (_, w) in zip(got, run[(5, 1)]))


@pytest.mark.filterwarnings("ignore:streamed data resumes")
@pytest.mark.filterwarnings("error:stream rewound")  # the recipe reads blocks[index], then loss_mask(index)
def test_streamed_chat_masks_follow_their_blocks_without_rewinding_at_micro_batch_2(tmp_path, tok):
    src = _chat(tmp_path / "chat.jsonl", 120)
    prepared = D.build_data(tok, dataset=src, seq_len=32, eval_blocks=2, data_cache=str(tmp_path / "c"), progress=False)
    b = _jsonl(tmp_path / "b.jsonl", _texts(300, 22))
    mix = [{"source": src, "weight": 1, "streaming": True}, {"source": b, "weight": 1}]
    for data in (D.build_data(tok, dataset=src, seq_len=32, eval_blocks=2, streaming=True),
                 D.build_data(tok, datasets=mix, seq_len=32, eval_blocks=2, data_cache=str(tmp_path / "c"),
                              progress=False)):
        order, parts = data.order(8, seed=0), len(data.train.sizes)
        for t in range(3):
            for r in range(2):
                for index, blocks in order.micro_batches(data.train, t, r, 2, 2):
                    mask = data.train.loss_mask(index)  # None: every token is a target
                    mask = torch.ones_like(blocks, dtype=torch.bool) if mask is None else mask
                    for i, row, m in zip(index.tolist(), blocks, mask):
                        if i % parts == 0:  # the stream's block k is the prepared k-th block, with its mask
                            k = i // parts
                            assert torch.equal(row, prepared.train[k]) and torch.equal(m, prepared.train.loss_mask([k])[0])
                        else:
                            assert m.all()  # a source without a mask: every token is a target


# -- the prepare command -------------------------------------------------------------------------

def test_prepare_command_reads_a_recipe_config_and_reports(tmp_path, capsys):
    from core.config import ConfigError
    from distill.data.__main__ import main

    a = _jsonl(tmp_path / "a.jsonl", _texts(200, 10))
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"teacher: tiny-random\nseq_len: 16\nkd_weight: 1.0\nmax_steps: 3\n"
                   f"datasets:\n  - source: {a}\n    weight: 2\n")
    main(["prepare", "--config", str(cfg), f"data_cache={tmp_path / 'c'}"])
    out = capsys.readouterr().out
    assert "a.jsonl" in out and "tokens in" in out and "blocks of 16" in out
    row = next(line for line in out.splitlines() if line.startswith("a.jsonl"))
    tokens, blocks, nbytes = (int(x.replace(",", "")) for x in row.split()[2:5])
    assert tokens == blocks * 16 and nbytes > tokens * 2  # uint16 train blocks plus held-out blocks
    with pytest.raises(ConfigError, match="unknown config key 'seqlen'"):
        main(["prepare", "--config", str(cfg), "seqlen=8"])


def test_blocks_index_like_the_tensor_they_replace(tmp_path, tok):
    data = D.build_data(tok, dataset=_jsonl(tmp_path / "a.jsonl", _texts(200, 3)), seq_len=16, eval_blocks=2,
                        data_cache=str(tmp_path / "c"), progress=False)
    full = data.train[slice(None)]
    assert torch.equal(data.train[3, :5], full[3, :5])
    assert torch.equal(data.train[1:4, 2:], full[1:4, 2:])
    assert torch.equal(data.train[torch.tensor([5, 0])], full[torch.tensor([5, 0])])
    assert torch.equal(data.train[2], full[2])


# -- streaming with grad_accum: a step's blocks are read again without rewinding -----------------

def _recipe_step(order, train, step: int, rank: int, world: int, micro: int):
    """The recipes' access pattern (recipes/distill.py, recipes/retrofit.py): every micro-batch of the step
    first, then ``loss_mask`` of each in the step's token weights, then again in each micro-batch's forward."""
    batch = list(order.micro_batches(train, step, rank, world, micro))
    weights = [train.loss_mask(index) for index, _ in batch]
    forward = [train.loss_mask(index) for index, _ in batch]
    return batch, weights, forward


@pytest.mark.filterwarnings("ignore:streamed data resumes")
@pytest.mark.filterwarnings("error:stream rewound")  # reading a block of the current step again must not rewind
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("kind", ["text", "chat", "mixture"])  # mixture: a streamed chat source, a prepared text one
def test_grad_accum_reads_each_stream_once_and_matches_prepared_blocks(tmp_path, tok, monkeypatch, kind, world):
    from distill.data.stream import StreamBlocks

    micro, grad_accum, steps = 2, 2, 5
    global_batch = micro * grad_accum * world
    cache = str(tmp_path / "c")
    src = _jsonl(tmp_path / "a.jsonl", _texts(400, 30)) if kind == "text" else _chat(tmp_path / "chat.jsonl", 300)
    other = _jsonl(tmp_path / "b.jsonl", _texts(300, 31))
    refs = [D.build_data(tok, dataset=x, seq_len=16, eval_blocks=2, data_cache=cache, progress=False)
            for x in (src, other)]  # the naive reference: prepared, indexed by block number
    assert steps * global_batch < refs[0].train.shape[0]  # the run is shorter than one pass over the stream
    passes: dict[int, int] = {}
    blocks = StreamBlocks.blocks

    def counting(self, split):
        if split == "train":
            passes[id(self)] = passes.get(id(self), 0) + 1
        return blocks(self, split)

    monkeypatch.setattr(StreamBlocks, "blocks", counting)
    mix = [{"source": src, "weight": 1, "streaming": True}, {"source": other, "weight": 1}]
    # One data object per rank, as each process builds its own.
    ranks = [D.build_data(tok, dataset=src, seq_len=16, eval_blocks=2, streaming=True) if kind != "mixture" else
             D.build_data(tok, datasets=mix, seq_len=16, eval_blocks=2, data_cache=cache, progress=False)
             for _ in range(world)]
    streams = [d.train if kind != "mixture" else d.train.parts[0] for d in ranks]
    parts = 1 if kind != "mixture" else 2
    orders = [d.order(global_batch, seed=0) for d in ranks]
    for t in range(steps):
        for r, (data, order) in enumerate(zip(ranks, orders)):
            batch, weights, forward = _recipe_step(order, data.train, t, r, world, micro)
            assert len(batch) == grad_accum
            for (index, rows), m1, m2 in zip(batch, weights, forward):
                assert (m1 is None) == (m2 is None)  # None: every token (plain text, or no chat row here)
                assert (m1 is None) == (kind == "text") or kind == "mixture"
                for j, i in enumerate(index.tolist()):
                    ref = refs[i % parts]
                    k = i // parts
                    assert torch.equal(rows[j], ref.train[k])
                    want = ref.train.loss_mask([k])
                    want = torch.ones(16, dtype=torch.bool) if want is None else want[0]
                    for m in (m1, m2):
                        assert torch.equal(want, torch.ones(16, dtype=torch.bool) if m is None else m[j])
    assert [passes.get(id(s), 0) for s in streams] == [1] * world  # one pass each, none restarted or rewound
    assert all(s.restarts == 0 for s in streams)
    assert all(len(s._recent) <= micro * grad_accum for s in streams)  # memory: at most one step's blocks


# -- the held-out split, bad records and files, durable caches, the intermediate table, progress ----------

def _docs_of(blocks: np.ndarray, tok) -> list[str]:
    """The whole documents in a packed split (EOS-separated; the cut-off last one is left out)."""
    flat = np.asarray(blocks, dtype=np.int64).ravel().tolist()
    docs, cur = [], []
    for t in flat:
        if t == tok.eos_token_id:
            docs.append(tok.decode(cur))
            cur = []
        else:
            cur.append(t)
    return docs


@pytest.mark.parametrize("reader", ["jsonl", "datasets"])
def test_duplicated_documents_fall_on_one_side_of_the_split(tmp_path, tok, monkeypatch, reader):
    unique = [f"doc {i} " + t for i, t in enumerate(_texts(200, 11))]
    rng = np.random.default_rng(0)
    texts = [unique[i] for i in rng.permutation(np.repeat(np.arange(200), 5))]  # 5 copies each, shuffled
    src = _jsonl(tmp_path / "dup.jsonl", texts)
    if reader == "datasets":
        monkeypatch.setattr(P, "_jsonl_files", lambda spec: None)
    prep = P.prepare_source(SourceSpec(src), tok, P.PackSettings(16, eval_fraction=0.2),
                            data_cache=str(tmp_path / "c"), num_proc=1, progress=False)
    train, held = set(_docs_of(prep.train, tok)), set(_docs_of(prep.eval, tok))
    assert len(held) > 10 and len(train) > 100 and held <= set(unique)
    assert not train & held  # no held-out document is trained on
    # Chat: the same conversation flips alike whatever its key order or the None fields datasets fills in.
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    same = [[{"content": m["content"], "role": m["role"]} for m in conv],
            [{**m, "tool_calls": None} for m in conv]]
    assert len({P.chat_key(c) for c in [conv, *same]}) == 1
    assert P.chat_key(conv) != P.chat_key(conv[:1])
    assert P.FORMAT >= 3  # caches split the old way are rebuilt


def _chat_rows(n: int) -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": "the dog"}]}
            for i in range(n)]


def test_a_malformed_chat_record_is_named_by_file_and_record(tmp_path, tok, monkeypatch):
    rows = _chat_rows(40)
    rows.insert(20, {"text": "a stray text record"})
    src = tmp_path / "chat.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    monkeypatch.setattr(P, "_MIN_BYTES_PER_PROC", 100)
    monkeypatch.setattr(parallel, "_MIN_RANGE", 300)  # several ranges: the bad one is not the first
    for n, proc in enumerate((1, 2)):
        with pytest.raises(DataError, match=rf"^{src}: record 20 has no 'messages' list .*fix or remove that record$"):
            P.prepare_source(SourceSpec(str(src)), tok, P.PackSettings(8), data_cache=str(tmp_path / f"c{n}"),
                             num_proc=proc, progress=False)
    # A directory of files: the record is numbered within its own file.
    d = tmp_path / "dir"
    d.mkdir()
    (d / "a.jsonl").write_text("\n".join(json.dumps(r) for r in _chat_rows(30)) + "\n")
    bad = _chat_rows(10)
    bad[7]["messages"][1].pop("content")
    (d / "b.jsonl").write_text("\n".join(json.dumps(r) for r in bad) + "\n")
    with pytest.raises(DataError, match=r"b\.jsonl: record 7 has message 1 without a 'content'"):
        P.prepare_source(SourceSpec(str(d)), tok, P.PackSettings(8), data_cache=str(tmp_path / "cd"), num_proc=1,
                         progress=False)
    # Through datasets (hub, parquet, json): the source and the record, also from a worker process.
    monkeypatch.setattr(P, "_jsonl_files", lambda spec: None)
    monkeypatch.setattr(P, "_MIN_RECORDS_PER_PROC", 10)
    for n, proc in enumerate((1, 2)):
        with pytest.raises(DataError, match=rf"{src}: record 20 has no 'messages' list"):
            P.prepare_source(SourceSpec(str(src)), tok, P.PackSettings(8), data_cache=str(tmp_path / f"e{n}"),
                             num_proc=proc, progress=False)
    with pytest.raises(DataError, match=r"record 20 has no 'messages' list"):
        D.texts_from(str(src), tok)


def test_a_text_record_that_is_not_a_string_is_named_not_dropped(tmp_path, tok, monkeypatch):
    """A number or a list under text_field is a schema mistake: dropping those records would lose data silently.
    A null stays an empty record, as a blank line is."""
    rows = [{"text": t} for t in _texts(40, 3)]
    rows[5]["text"] = None
    rows[25]["text"] = ["a", "list"]
    src = tmp_path / "mixed.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    monkeypatch.setattr(P, "_MIN_BYTES_PER_PROC", 100)
    monkeypatch.setattr(parallel, "_MIN_RANGE", 300)  # several ranges: the bad record is not in the first
    says = rf"^{src}: record 25 has 'text' of type list, not a string .*fix or remove that record$"
    for n, proc in enumerate((1, 2)):
        with pytest.raises(DataError, match=says):
            P.prepare_source(SourceSpec(str(src)), tok, P.PackSettings(8), data_cache=str(tmp_path / f"c{n}"),
                             num_proc=proc, progress=False)
    with pytest.raises(DataError, match=says):
        D.texts_from(str(src), tok)
    del rows[25]
    src.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert D.texts_from(str(src), tok) == [r["text"] for r in rows if r["text"]]


def test_non_utf8_and_empty_files_are_named(tmp_path, tok, monkeypatch):
    def prepare(path, kind, num_proc=1):
        return P.prepare_source(SourceSpec(str(path)), tok, P.PackSettings(8), data_cache=str(tmp_path / kind),
                                num_proc=num_proc, progress=False)

    latin = tmp_path / "bad.jsonl"
    latin.write_bytes(b'{"text": "hello world the fox"}\n' * 50 + b'{"text": "caf\xe9 latin1"}\n')
    with pytest.raises(DataError, match=rf"^{latin} is not UTF-8 \(record 50, byte 1613: invalid continuation "
                                        r"byte\); re-save it as UTF-8"):
        prepare(latin, "a")
    txt = tmp_path / "bad.txt"
    txt.write_bytes(b"hello world the fox\n" * 50 + b"caf\xe9 latin1\n")
    with pytest.raises(DataError, match=rf"^{txt} is not UTF-8 \(byte 1003: invalid continuation byte\)"):
        prepare(txt, "b")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(DataError, match=rf"^{empty} holds no records; add data or drop the source$"):
        prepare(empty, "c")
    monkeypatch.setattr(P, "_jsonl_files", lambda spec: None)  # the same .jsonl through datasets, 1 or 2 workers
    monkeypatch.setattr(P, "_MIN_RECORDS_PER_PROC", 10)
    for proc in (1, 2):
        with pytest.raises(DataError, match=rf"^{latin} is not UTF-8 \(byte 1613: invalid continuation byte\)"):
            prepare(latin, f"d{proc}", proc)
    # Streamed (datasets=[{source: ..., streaming: true}]): met mid-stream, named the same way.
    from distill.data.stream import StreamBlocks

    for path, where in ((latin, "byte 1613"), (txt, "byte 1003")):
        stream = StreamBlocks(SourceSpec(str(path), streaming=True), tok, P.PackSettings(8))
        with pytest.raises(DataError, match=rf"^{path} is not UTF-8 \({where}: invalid continuation byte\)"):
            list(stream.blocks("train"))
    # The check reads in chunks: a character cut by a chunk edge is still UTF-8, a bad byte there is not.
    from distill.data import text as T

    edge = tmp_path / "edge.txt"
    edge.write_bytes(b"a" * ((1 << 20) - 1) + "é".encode() + b"b")
    assert T.not_utf8(edge) is None
    edge.write_bytes(b"a" * ((1 << 20) - 1) + b"\xc3")
    assert T.not_utf8(edge) == f"byte {(1 << 20) - 1}: unexpected end of data"


def test_the_cache_is_fsynced_before_it_is_named_complete_and_a_torn_meta_is_refused(tmp_path, tok, monkeypatch):
    src = _jsonl(tmp_path / "a.jsonl", _texts(100, 12))
    cache = tmp_path / "c"
    calls = []
    real_tree, real_dir = getattr(P, "fsync_tree", None), getattr(P, "fsync_dir", None)

    def tree(path):
        calls.append(("tree", Path(path).name, (Path(path) / "meta.json").exists(),
                      sorted(p.name for p in cache.iterdir() if not p.name.startswith(".tmp-"))))
        real_tree(path)

    def fdir(path):
        calls.append(("dir", Path(path), sorted(p.name for p in cache.iterdir())))
        real_dir(path)

    monkeypatch.setattr(P, "fsync_tree", tree, raising=False)  # (getattr, raising: fail on the calls, not a name)
    monkeypatch.setattr(P, "fsync_dir", fdir, raising=False)
    prep = P.prepare_source(SourceSpec(src), tok, P.PackSettings(16), data_cache=str(cache), progress=False)
    assert [c[0] for c in calls] == ["tree", "dir"]
    assert calls[0][1].startswith(".tmp-") and calls[0][2] and calls[0][3] == []  # whole, and not yet renamed
    assert calls[1][1] == cache and calls[1][2] == [prep.path.name]  # the rename, then its directory
    text = (prep.path / "meta.json").read_text()
    for torn in (text[: len(text) // 2], "", "[]", json.dumps({"key_fields": {}})):
        (prep.path / "meta.json").write_text(torn)
        for opener in (lambda: P.open_prepared(prep.path),
                       lambda: P.prepare_source(SourceSpec(src), tok, P.PackSettings(16), data_cache=str(cache),
                                                progress=False)):
            with pytest.raises(DataError, match=r"meta\.json is unreadable .* damaged: delete .* and prepare again"):
                opener()


def test_the_datasets_intermediate_table_stores_the_final_dtypes(tmp_path, tok, monkeypatch):
    src = _chat(tmp_path / "chat.jsonl", 60)
    direct = P.prepare_source(SourceSpec(src), tok, P.PackSettings(16, eval_fraction=0.2),
                              data_cache=str(tmp_path / "c1"), progress=False)
    seen = {}
    real_pack = P._pack

    def pack(mapped, *a, **k):
        seen.update({name: f.feature.dtype if hasattr(f, "feature") else f.dtype
                     for name, f in mapped.features.items()})
        return real_pack(mapped, *a, **k)

    monkeypatch.setattr(P, "_pack", pack)
    monkeypatch.setattr(P, "_jsonl_files", lambda spec: None)
    via = P.prepare_source(SourceSpec(src), tok, P.PackSettings(16, eval_fraction=0.2),
                           data_cache=str(tmp_path / "c2"), progress=False)
    assert via.meta["reader"] == "datasets"
    assert seen == {"ids": "uint16", "mask": "uint8", "heldout": "bool"}
    for a, b in ((direct.train, via.train), (direct.eval, via.eval), (direct.train_mask, via.train_mask),
                 (direct.eval_mask, via.eval_mask)):
        assert a.shape[0] > 0 and np.array_equal(a, b)


def test_every_long_stage_shows_a_bar_unless_progress_is_off(tmp_path, tok, monkeypatch, capsys):
    src = _jsonl(tmp_path / "a.jsonl", _texts(100, 13))
    P.prepare_source(SourceSpec(src), tok, P.PackSettings(16), data_cache=str(tmp_path / "c1"), progress=False)
    monkeypatch.setattr(P, "_jsonl_files", lambda spec: None)
    P.prepare_source(SourceSpec(src), tok, P.PackSettings(16), data_cache=str(tmp_path / "c2"), progress=False)
    err = capsys.readouterr().err
    assert not any(s in err for s in ("count records", "tokenize", "concatenate", "pack", "it/s"))
    monkeypatch.undo()

    def counted(*_a):
        raise AssertionError("records were counted: only an error message needs their number")

    monkeypatch.setattr(parallel, "_records_before", counted, raising=False)  # no silent counting pass
    monkeypatch.setattr(parallel, "_MIN_RANGE", 500)
    P.prepare_source(SourceSpec(src), tok, P.PackSettings(16), data_cache=str(tmp_path / "c3"), progress=True)
    err = capsys.readouterr().err
    assert all(s in err for s in ("tokenize a.jsonl", "concatenate a.jsonl"))
    monkeypatch.setattr(P, "_jsonl_files", lambda spec: None)
    P.prepare_source(SourceSpec(src), tok, P.PackSettings(16), data_cache=str(tmp_path / "c4"), progress=True)
    assert "pack a.jsonl" in capsys.readouterr().err
