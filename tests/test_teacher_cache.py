"""Teacher caches: the sampled estimator is unbiased (top-k is not), and foreign caches are refused."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from core.tiny import tiny_tokenizer
from distill.losses import SampledKDLoss, kd_loss, sampled_kd_loss
from distill.teacher_cache import (
    META,
    CachedTargets,
    TeacherCache,
    TeacherCacheError,
    bytes_per_token,
    cached_kd_loss,
    check_meta,
    fingerprint,
    sample_teacher,
    tail_mass,
    tokenizer_fingerprint,
    topk_kd_loss,
    topk_logprobs,
    write_shard,
)

ROOT = Path(__file__).resolve().parents[1]


def _logits(positions=3, vocab=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(positions, vocab, generator=g, dtype=torch.float64) * 2.0
    student = torch.randn(positions, vocab, generator=g, dtype=torch.float64)
    return student, teacher


def test_sample_teacher_counts_are_distinct_ids_summing_to_n():
    _, teacher = _logits(positions=50)
    ids, counts, lp = sample_teacher(teacher, 12, 1.0, torch.Generator().manual_seed(1))
    assert ids.dtype == torch.int32 and counts.dtype == torch.uint8 and ids.shape == (50, 12)
    assert (counts.long().sum(-1) == 12).all()
    for row_ids, row_counts, row_lp, row_t in zip(ids, counts, lp, teacher):
        used = row_counts > 0
        assert len(set(row_ids[used].tolist())) == int(used.sum())  # distinct
        assert torch.isinf(row_lp[~used]).all()
        expected = torch.log_softmax(row_t.float(), -1)[row_ids[used].long()]
        assert torch.allclose(row_lp[used], expected, atol=1e-5)
    with pytest.raises(ValueError, match="255"):
        sample_teacher(teacher, 256)


def test_sampled_loss_matches_closed_form_for_one_draw():
    """For a fixed draw: value = T² · mean Σ w (log p - log q_T), grad = T (q_T - p_hat) / tokens."""
    student, teacher = _logits(positions=4)
    t = 1.7
    ids, counts, lp = sample_teacher(teacher, 9, t, torch.Generator().manual_seed(0))
    w = counts.double() / 9
    s = student.clone().requires_grad_(True)
    loss = sampled_kd_loss(s, ids, w, temperature=t, teacher_logprobs=lp.double())
    loss.backward()
    logq = torch.log_softmax(student / t, -1)
    p_hat = torch.zeros_like(student).scatter_add_(1, ids.long(), w)
    ref = sum((w[i][counts[i] > 0] * (lp[i][counts[i] > 0].double() - logq[i][ids[i][counts[i] > 0].long()])).sum()
              for i in range(4)) / 4 * t * t
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    assert torch.allclose(s.grad, t * (logq.exp() - p_hat) / 4, atol=1e-9)
    assert SampledKDLoss(t)(student, ids, w, teacher_logprobs=lp.double()).item() == pytest.approx(loss.item())
    # Masked positions count for nothing; no counted position gives 0 with a graph.
    mask = torch.tensor([True, False, True, False])
    s.grad = None
    sampled_kd_loss(s, ids, w, mask, temperature=t).backward()
    assert (s.grad[~mask] == 0).all() and (s.grad[mask] != 0).any()
    empty = sampled_kd_loss(s, ids, w, torch.zeros(4, dtype=torch.bool), temperature=t)
    empty.backward()
    assert empty.item() == 0.0


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_sampled_gradient_is_unbiased_and_topk_is_not(temperature):
    """Averaged over many draws the sampled gradient equals full-logit forward KD's; top-k's stays off."""
    positions, vocab, n, draws = 3, 40, 8, 4000
    student, teacher = _logits(positions, vocab)
    s = student.clone().requires_grad_(True)
    full = torch.autograd.grad(kd_loss(s, teacher, temperature=temperature), s)[0]
    full_value = kd_loss(student, teacher, temperature=temperature).item()

    # `draws` independent caches of the same positions, as one batch: the mean over tokens makes the
    # gradient w.r.t. the shared student logits the average of the per-draw gradients.
    ids, counts, lp = sample_teacher(teacher.expand(draws, positions, vocab), n, temperature,
                                     torch.Generator().manual_seed(0))
    loss = sampled_kd_loss(s.expand(draws, positions, vocab), ids, counts.double() / n, temperature=temperature,
                           teacher_logprobs=lp.double())
    sampled = torch.autograd.grad(loss, s)[0]
    # p_hat_j is a binomial share, std sqrt(p_j (1 - p_j) / n) per draw; the gradient is T (q - p_hat) / positions.
    p = torch.softmax(teacher / temperature, -1)
    std = temperature / positions * (p * (1 - p) / (n * draws)).sqrt()
    assert ((sampled - full).abs() <= 5 * std + 1e-9).all()
    assert loss.item() == pytest.approx(full_value, abs=5 * temperature**2 * 0.5 / draws**0.5)

    k = 4
    idx, top = topk_logprobs(teacher, k)
    topk = torch.autograd.grad(topk_kd_loss(s, idx.long(), top, temperature=temperature), s)[0]
    assert ((topk - full).abs() / (std + 1e-9)).max() > 20, "top-k gradient should be visibly biased"
    assert tail_mass(top).min() > 0


def _write_cache(path: Path, blocks: torch.Tensor, tokenizer, *, mode="sampled", vocab=320, temperature=1.0):
    path.mkdir()
    logits = torch.randn(*blocks.shape, vocab)
    if mode == "sampled":
        ids, counts, lp = sample_teacher(logits, 6, temperature)
        write_shard(path / "shard-00000.safetensors", ids, lp, counts)
    else:
        ids, lp = topk_logprobs(logits, 6)
        write_shard(path / "shard-00000.safetensors", ids, lp)
    meta = {"mode": mode, "k": 6, "seq_len": blocks.shape[1], "blocks": blocks.shape[0],
            "fingerprint": fingerprint(blocks), "vocab_size": vocab,
            "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer), "bytes_per_token": bytes_per_token(mode, 6),
            "temperature": temperature}
    (path / META).write_text(json.dumps(meta))


def test_a_cache_of_fewer_blocks_names_max_train_blocks_before_hashing_the_data(tmp_path, monkeypatch):
    """cache_teacher max_blocks=N without the run's max_train_blocks=N: the fix is that key, not other data."""
    import distill.teacher_cache as teacher_cache

    tok = tiny_tokenizer()
    blocks = torch.randint(0, 320, (5, 8))
    _write_cache(tmp_path / "c", blocks[:3], tok)
    monkeypatch.setattr(teacher_cache, "fingerprint", lambda *_: pytest.fail("hashed the whole corpus first"))
    with pytest.raises(TeacherCacheError, match="other data: it holds 3 blocks but this run trains on 5; set max_train_blocks=3") as err:
        TeacherCache(tmp_path / "c", blocks, vocab_size=320, tokenizer=tok, temperature=1.0)
    assert "\n" not in str(err.value)



def test_the_recipe_names_a_cache_of_fewer_blocks_before_hashing_the_data(tmp_path, monkeypatch):
    """recipes/distill.py hashed the whole training corpus (shared_fingerprint) before the cache compared its block
    count: a wrong max_train_blocks cost a pass over the corpus before its one-line error."""
    import distill.teacher_cache as teacher_cache
    from recipes import distill

    tok = tiny_tokenizer()
    blocks = torch.randint(0, 320, (5, 8))
    _write_cache(tmp_path / "c", blocks[:3], tok)
    for module in (teacher_cache, distill):
        monkeypatch.setattr(module, "fingerprint", lambda *_: pytest.fail("hashed the whole corpus first"))
    cfg = SimpleNamespace(teacher_cache=str(tmp_path / "c"), kd_weight=1.0, temperature=1.0)
    student = SimpleNamespace(config=SimpleNamespace(vocab_size=320))
    accelerator = SimpleNamespace(is_main_process=True)
    with pytest.raises(TeacherCacheError, match="it holds 3 blocks but this run trains on 5; set max_train_blocks=3"):
        distill.cached_teacher(cfg, accelerator, SimpleNamespace(train=blocks), student, tok)
    hashed = []
    monkeypatch.setattr(distill, "shared_fingerprint", lambda acc, b: hashed.append(b.shape[0]) or fingerprint(b))
    cache = distill.cached_teacher(cfg, accelerator, SimpleNamespace(train=blocks[:3]), student, tok)
    assert hashed == [3] and cache.mode == "sampled"  # the right count: hashed and compared, as before

def test_cache_lookup_and_loss_dispatch(tmp_path):
    tok = tiny_tokenizer()
    blocks = torch.randint(0, 320, (3, 8))
    _write_cache(tmp_path / "s", blocks, tok)
    _write_cache(tmp_path / "k", blocks, tok, mode="topk")
    sampled = TeacherCache(tmp_path / "s", blocks, vocab_size=320, tokenizer=tok, temperature=1.0)
    topk = TeacherCache(tmp_path / "k", blocks, vocab_size=320, tokenizer=tok, temperature=3.0)
    ts, tk = sampled.lookup(torch.tensor([2, 0]), "cpu"), topk.lookup(torch.tensor([2, 0]), "cpu")
    assert ts.weights is not None and torch.allclose(ts.weights.sum(-1), torch.ones(2, 8))
    assert tk.weights is None and ts.ids.shape == tk.ids.shape == (2, 8, 6)
    logits = torch.randn(2, 7, 320)
    a = cached_kd_loss(logits, ts.positions(slice(None, -1)))
    assert a.item() == pytest.approx(sampled_kd_loss(logits, ts.ids[:, :-1], ts.weights[:, :-1],
                                                     teacher_logprobs=ts.logprobs[:, :-1]).item())
    b = cached_kd_loss(logits, (tk.ids[:, :-1], tk.logprobs[:, :-1]))
    assert b.item() == pytest.approx(topk_kd_loss(logits, tk.ids[:, :-1], tk.logprobs[:, :-1]).item())
    assert isinstance(tk, CachedTargets) and tk.positions(slice(1, None)).ids.shape == (2, 7, 6)


def test_foreign_caches_are_refused_in_one_line(tmp_path):
    tok = tiny_tokenizer()
    blocks = torch.randint(0, 320, (2, 8))
    _write_cache(tmp_path / "c", blocks, tok, temperature=2.0)
    cases = [
        # 319 rows cannot hold the 320-token tokenizer (321 would: padding only, accepted as for a live teacher)
        (dict(vocab_size=319, tokenizer=tok, temperature=2.0), "vocabulary of 320"),
        (dict(vocab_size=321, temperature=2.0), "vocabulary of 320"),  # no tokenizer shows it is padding
        (dict(vocab_size=320, tokenizer=_other_tokenizer(), temperature=2.0), "another tokenizer"),
        (dict(vocab_size=320, tokenizer=tok, temperature=1.0), "temperature=2.0"),
    ]
    for kwargs, match in cases:
        with pytest.raises(TeacherCacheError, match=match) as err:
            TeacherCache(tmp_path / "c", blocks, **kwargs)
        assert "\n" not in str(err.value)
    with pytest.raises(TeacherCacheError, match="other data"):
        TeacherCache(tmp_path / "c", blocks + 1, vocab_size=320, tokenizer=tok, temperature=2.0)
    with pytest.raises(TeacherCacheError, match="kd_kind=forward_kl"):
        check_meta({"mode": "sampled", "temperature": 2.0}, tmp_path / "c", kd_kind="reverse_kl")
    with pytest.raises(TeacherCacheError, match="not a teacher cache"):
        TeacherCache(tmp_path, blocks)


def _resharded(tmp_path, tok, shards: list[tuple[str, tuple[int, int]]]):
    """A cache of 7 blocks written whole, then split into the named shards of the given block ranges; returns
    ``(blocks, path, whole)`` where ``whole`` holds the single shard's tensors."""
    from safetensors.torch import load_file

    blocks = torch.randint(0, 320, (7, 8), generator=torch.Generator().manual_seed(0))
    path = tmp_path / "c"
    _write_cache(path, blocks, tok)
    whole = load_file(str(path / "shard-00000.safetensors"))
    (path / "shard-00000.safetensors").unlink()
    for name, (lo, hi) in shards:
        write_shard(path / f"{name}.safetensors", whole["index"][lo:hi], whole["logprobs"][lo:hi],
                    whole["counts"][lo:hi])
    return blocks, path, whole


def test_cache_reads_rows_from_the_shards_on_demand(tmp_path):
    """Several shards laid end to end: a lookup across them equals the naive whole-cache read, and the cache
    reads the files at lookup time (a shard rewritten in place shows), so nothing is held in memory."""
    import hashlib

    from distill.data import Blocks

    tok = tiny_tokenizer()
    blocks, path, whole = _resharded(tmp_path, tok, [(f"shard-{i:05d}", r) for i, r in
                                                     enumerate([(0, 3), (3, 4), (4, 7)])])  # 3, 1 and 3 blocks
    cache = TeacherCache(path, blocks, vocab_size=320, tokenizer=tok, temperature=1.0)
    pick = torch.tensor([6, 0, 3, 2, 4, 3])
    got = cache.lookup(pick, "cpu")
    assert torch.equal(got.ids, whole["index"][pick].long())
    assert torch.equal(got.logprobs, whole["logprobs"][pick].float())
    counts = whole["counts"][pick].float()
    assert torch.allclose(got.weights, counts / counts.sum(-1, keepdim=True))
    def rewrite_in_place(index: torch.Tensor) -> None:  # the same bytes but the ids, into the same file
        write_shard(tmp_path / "new.safetensors", index, whole["logprobs"][3:4], whole["counts"][3:4])
        with open(path / "shard-00001.safetensors", "r+b") as f:
            f.write((tmp_path / "new.safetensors").read_bytes())

    rewrite_in_place(319 - whole["index"][3:4])  # other ids, all < 320: the next lookup reads them
    assert torch.equal(cache.lookup(torch.tensor([3]), "cpu").ids, 319 - whole["index"][3:4].long())
    rewrite_in_place(whole["index"][3:4] * 0 + 400)
    with pytest.raises(TeacherCacheError, match="beyond the student's vocabulary of 320"):
        cache.lookup(torch.tensor([3]), "cpu")
    shard = path / "shard-00002.safetensors"
    full = shard.read_bytes()
    shard.write_bytes(full[:-5])  # a copy cut short: refused when opened, not at some later lookup
    with pytest.raises(TeacherCacheError, match="shard-00002.safetensors is truncated"):
        TeacherCache(path, blocks, vocab_size=320, tokenizer=tok, temperature=1.0)
    shard.unlink()
    with pytest.raises(TeacherCacheError, match="incomplete \\(4 of 7 blocks\\)"):
        TeacherCache(path, blocks, vocab_size=320, tokenizer=tok, temperature=1.0)
    # The fingerprint reads the blocks a chunk at a time: the same hash as all the bytes at once,
    # for a tensor and for memory-mapped blocks alike.
    naive = hashlib.sha256(blocks.to(torch.int64).numpy().tobytes()).hexdigest()[:16]
    np_path = tmp_path / "blocks.bin"
    blocks.to(torch.int32).numpy().tofile(np_path)
    import numpy as np

    mapped = Blocks([np.memmap(np_path, dtype=np.int32, mode="r", shape=(7, 8))], [None], 8)
    assert fingerprint(blocks) == fingerprint(blocks, chunk=3) == fingerprint(mapped, chunk=2) == naive


def test_shards_are_read_in_numeric_order_past_five_digits(tmp_path):
    """From shard 100000 on the names grow a digit: string order would put it before shard 99999."""
    tok = tiny_tokenizer()
    blocks, path, whole = _resharded(tmp_path, tok, [("shard-99999", (0, 4)), ("shard-100000", (4, 7))])
    cache = TeacherCache(path, blocks, vocab_size=320, tokenizer=tok, temperature=1.0)
    pick = torch.arange(7)
    assert torch.equal(cache.lookup(pick, "cpu").ids, whole["index"][pick].long())


def _cache_cmd(out: Path, *extra: str) -> list[str]:
    return ["recipes/cache_teacher.py", "teacher=tiny-random", "seq_len=32", "max_blocks=20", "shard_blocks=4",
            "mode=sampled", "samples=6", "batch_size=3", f"output_dir={out}", *extra]


def _shards(path: Path) -> dict[str, tuple]:
    """Each shard's tensors (as bytes) and metadata (its key order in the file is not fixed)."""
    from safetensors.torch import load_file

    from distill.teacher_cache import shard_metadata

    return {p.name: ({k: (v.dtype, v.shape, v.numpy().tobytes()) for k, v in load_file(str(p)).items()},
                     shard_metadata(p)) for p in sorted(path.glob("shard-*.safetensors"))}


def test_a_rerun_keeps_only_shards_of_the_same_blocks_and_overwrite_starts_over(tmp_path):
    from core.tiny import tiny_teacher
    from recipes.cache_teacher import CacheTeacherConfig, cache_shard, claim_work, shard_name, shards_to_write

    cfg = CacheTeacherConfig(teacher="tiny-random", seq_len=8, shard_blocks=2, mode="topk", topk=3)
    teacher, bar = tiny_teacher(0).eval(), SimpleNamespace(update=lambda n: None)
    work = tmp_path / ".cache.partial"
    old = torch.randint(0, 40, (5, 8), generator=torch.Generator().manual_seed(0))
    assert claim_work(cfg, work) == 0 and shards_to_write(cfg, old, work, 0, 1) == [0, 1, 2]
    for i in (0, 1):
        cache_shard(cfg, teacher, old[2 * i: 2 * i + 2], i, work / shard_name(i), bar)
    assert claim_work(cfg, work) == 2  # a resume with the same settings keeps them
    assert shards_to_write(cfg, old, work, 0, 1) == [2] and shards_to_write(cfg, old, work, 1, 2) == []
    new = old.clone()
    new[3, 0] += 1  # the dataset file regenerated under the same name: same settings, other blocks in shard 1
    assert shards_to_write(cfg, new, work, 0, 1) == [1, 2]
    assert claim_work(dataclasses.replace(cfg, overwrite=True), work) == 0  # starts an unfinished cache over
    assert not list(work.glob("shard-*")) and (work / "config.yaml").is_file()


@pytest.mark.slow
def test_cache_teacher_resumes_after_a_kill_and_matches_an_uninterrupted_run(tmp_path):
    """Shards are written whole, one by one: a killed run keeps them and a rerun finishes the rest, giving the
    very bytes of a run never stopped (sampled draws are seeded per shard, not by what ran before)."""
    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)

    full = run(*_cache_cmd(tmp_path / "full"))
    assert full.returncode == 0, full.stderr[-2000:]
    killed = tmp_path / "killed"
    work = tmp_path / ".killed.partial"
    assert run(*_cache_cmd(killed, "debug_exit_after_shards=2")).returncode == 137
    assert not killed.exists() and len(_shards(work)) == 2
    other = run(*_cache_cmd(killed, "samples=7"))
    assert other.returncode == 2 and "other settings (samples: 6 → 7)" in other.stderr.strip().splitlines()[-1]
    assert "overwrite=true" in other.stderr and len(_shards(work)) == 2  # nothing lost
    resumed = run(*_cache_cmd(killed, "batch_size=5"))  # a safe change: batching does not change what is written
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "2 shard(s) already written" in resumed.stdout and not work.exists()
    assert _shards(killed) == _shards(tmp_path / "full") and len(_shards(killed)) == 5
    meta_a, meta_b = (json.loads((p / META).read_text()) for p in (tmp_path / "full", killed))
    assert {k: v for k, v in meta_a.items() if k != "seconds"} == {k: v for k, v in meta_b.items() if k != "seconds"}


@pytest.mark.distributed
@pytest.mark.slow
def test_cache_teacher_splits_shards_across_two_processes(tmp_path):
    """Two processes (gloo, CPU) write alternate shards and one cache: the bytes of a one-process run."""
    from tests.test_distributed import _launch

    one = subprocess.run([sys.executable, *_cache_cmd(tmp_path / "one", "mode=topk", "topk=5")], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert one.returncode == 0, one.stderr[-2000:]
    _launch("cpu_ddp_2proc.yaml", [str(ROOT / a) if a.endswith(".py") else a
                                   for a in _cache_cmd(tmp_path / "two", "mode=topk", "topk=5")], cpu_ddp=True)
    assert _shards(tmp_path / "two") == _shards(tmp_path / "one") and len(_shards(tmp_path / "one")) == 5
    meta_1, meta_2 = (json.loads((tmp_path / d / META).read_text()) for d in ("one", "two"))
    assert meta_2["tail_mass"] == pytest.approx(meta_1["tail_mass"]) and meta_2["fingerprint"] == meta_1["fingerprint"]


def _other_tokenizer():
    tok = tiny_tokenizer()
    tok.add_tokens(["<extra>"])
    return tok


@pytest.mark.slow
def test_sampled_cache_recipe_round_trip(tmp_path):
    cache = tmp_path / "cache"
    proc = subprocess.run([sys.executable, "recipes/cache_teacher.py", "teacher=tiny-random", "seq_len=64",
                           "max_blocks=16", "mode=sampled", "samples=12", "temperature=2.0",
                           f"output_dir={cache}"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    meta = json.loads((cache / "meta.json").read_text())
    assert meta["mode"] == "sampled" and meta["bytes_per_token"] == 12 * 7 and "bytes/token" in proc.stdout
    common = [sys.executable, "recipes/distill.py", "--config", "recipes/configs/tiny.yaml", f"teacher_cache={cache}",
              "hidden_weight=0", "attn_weight=0", "max_steps=2", "save_every=0", "max_train_blocks=16",
              "compare_ce_only=false"]
    good = subprocess.run([*common, "temperature=2.0", f"output_dir={tmp_path / 'good'}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert good.returncode == 0, good.stderr[-2000:]
    assert json.loads((tmp_path / "good" / "summary.json").read_text())["final_terms"]["kd"] > 0
    bad = subprocess.run([*common, "temperature=1.0", f"output_dir={tmp_path / 'bad'}"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "temperature=2.0" in bad.stderr and "Traceback" not in bad.stderr


def test_bench_cache_rss_reads_the_same_targets_without_loading_the_cache(tmp_path):
    """The memory benchmark at a small size: both arms read the same targets (it exits otherwise) and only
    loading the whole cache grows with it."""
    proc = subprocess.run([sys.executable, "bench/teacher_cache_rss.py", "--tokens", "2e5", "--steps", "20",
                           "--work", str(tmp_path / "w")], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["cache_mb"] > 50 and out["rss_growth_mb"]["load"] > 0.8 * out["cache_mb"]
    assert out["rss_growth_mb"]["reader"] < 0.3 * out["cache_mb"] and not (tmp_path / "w").exists()
