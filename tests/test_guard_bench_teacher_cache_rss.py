"""bench/teacher_cache_rss.py: each arm's memory is its peak while reading, and the arms' digests cover every target."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from safetensors.torch import load_file

from distill.teacher_cache import write_shard

spec = importlib.util.spec_from_file_location(
    "bench_teacher_cache_rss", Path(__file__).resolve().parents[1] / "bench" / "teacher_cache_rss.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)

SEQ, TOPK, SHARD_BLOCKS = 256, 32, 128


def test_loading_whole_peaks_near_twice_the_cache_and_the_peak_is_reported(tmp_path):
    """Concatenating loaded shards holds them twice: the end-of-run RSS alone reads about half of that."""
    blocks, cache_mb = bench.write_cache(tmp_path / "cache", 4 * SHARD_BLOCKS * SEQ, TOPK, SEQ, SHARD_BLOCKS)
    load = bench.run_arm("load", tmp_path / "cache", 20, 8, blocks, SEQ)
    reader = bench.run_arm("reader", tmp_path / "cache", 20, 8, blocks, SEQ)
    peak, end = load["peak_mb"] - load["rss0_mb"], load["rss_mb"] - load["rss0_mb"]
    assert peak >= 1.5 * cache_mb, (peak, cache_mb)
    assert end < peak
    assert reader["peak_mb"] >= reader["rss_mb"] >= reader["rss0_mb"] - 1
    assert reader["digest"] == load["digest"]


def test_digest_sees_a_change_in_the_log_probs_alone(tmp_path):
    """Ids left as they were, log-probs shifted: an arm that read wrong log-probs must not pass the check."""
    cache = tmp_path / "cache"
    blocks, _ = bench.write_cache(cache, 2 * SHARD_BLOCKS * SEQ, 8, SEQ, SHARD_BLOCKS)
    before = bench.run_arm("reader", cache, 10, 4, blocks, SEQ)["digest"]
    for shard in sorted(cache.glob("shard-*.safetensors")):
        t = load_file(str(shard))
        write_shard(shard, t["index"], t["logprobs"].float() - 1.0)
    after = bench.run_arm("reader", cache, 10, 4, blocks, SEQ)
    assert after["digest"] != before
