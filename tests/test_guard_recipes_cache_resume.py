"""recipes/cache_teacher.py after a kill: the unfinished folder restarts cleanly, and what is not ours stays."""

from __future__ import annotations

import pytest
import torch

from core.config import ConfigError
from recipes.cache_teacher import CacheTeacherConfig, claim_work


def test_a_start_killed_before_its_config_was_written_restarts(tmp_path):
    """Killed between creating the unfinished folder and writing its config.yaml: before, every rerun (with
    overwrite=true too) was refused until the folder was deleted by hand."""
    cfg = CacheTeacherConfig(teacher="tiny-random", seq_len=8, shard_blocks=2, mode="topk", topk=3)
    work = tmp_path / ".cache.partial"
    work.mkdir()
    (work / ".config.yaml.1a2b3c4d.tmp").write_text("teacher: tiny-")  # atomic_write's temp, cut short
    (work / ".shard-00000.safetensors").write_bytes(b"\0" * 5)
    assert claim_work(cfg, work) == 0
    assert sorted(p.name for p in work.iterdir()) == ["config.yaml"]
    assert claim_work(cfg, work) == 0  # and it resumes like any unfinished cache from then on


@pytest.mark.parametrize("name", ["notes.txt", ".config.yaml.keep", "shard-00000.safetensors"])
def test_a_folder_holding_anything_else_is_still_refused_and_kept(tmp_path, name):
    cfg = CacheTeacherConfig(teacher="tiny-random", seq_len=8, shard_blocks=2, mode="topk", topk=3, overwrite=True)
    work = tmp_path / ".cache.partial"
    work.mkdir()
    (work / name).write_text("someone's")
    with pytest.raises(ConfigError, match="is not an unfinished teacher cache .*move it away"):
        claim_work(cfg, work)
    assert (work / name).read_text() == "someone's"


def test_a_resume_under_another_teacher_precision_rewrites_the_shards_it_would_mix(tmp_path):
    """dtype=auto is bf16 on a GPU and fp32 on a CPU: the same settings, so a killed GPU run resumed on a CPU
    (or the reverse) kept the bf16 shards beside new fp32 ones, one cache of two teachers."""
    from types import SimpleNamespace

    from core.tiny import tiny_teacher
    from distill.teacher_cache import shard_metadata
    from recipes.cache_teacher import cache_shard, shard_name, shards_to_write

    cfg = CacheTeacherConfig(teacher="tiny-random", seq_len=8, shard_blocks=2, mode="topk", topk=3)
    work = tmp_path / ".cache.partial"
    assert claim_work(cfg, work) == 0
    blocks = torch.randint(0, 40, (5, 8), generator=torch.Generator().manual_seed(0))
    bar = SimpleNamespace(update=lambda n: None)
    fp32, bf16 = tiny_teacher(0).eval(), tiny_teacher(0).eval().to(torch.bfloat16)
    cache_shard(cfg, bf16, blocks[0:2], 0, work / shard_name(0), bar)
    cache_shard(cfg, fp32, blocks[2:4], 1, work / shard_name(1), bar)
    assert shard_metadata(work / shard_name(0))["dtype"] == "bfloat16"
    assert shards_to_write(cfg, blocks, work, 0, 1, dtype=torch.float32) == [0, 2]
    assert shards_to_write(cfg, blocks, work, 0, 1, dtype=torch.bfloat16) == [1, 2]


def test_a_cache_left_aside_by_a_kill_inside_the_final_rename_is_put_back(tmp_path):
    """replace_dir moves an old cache aside before the new one takes its name; killed in between, the old cache
    (hundreds of GB at scale) lay under .old-cache-<hex> for good and output_dir was gone."""
    from distill.teacher_cache import META
    from recipes.cache_teacher import restore_replaced

    out = tmp_path / "cache"
    aside = tmp_path / ".old-cache-1a2b3c4d"
    aside.mkdir()
    (aside / META).write_text("{}")
    (aside / "shard-00000.safetensors").write_bytes(b"x")
    other = tmp_path / ".old-cache-99999999"  # not a whole cache (no meta.json): never moved in
    other.mkdir()
    restore_replaced(out)
    assert (out / META).is_file() and (out / "shard-00000.safetensors").read_bytes() == b"x"
    # the partial aside is replace_dir's own leftover (a kill while it removed an old cache): gone with the restore
    assert not aside.exists() and not other.exists()
    mine = tmp_path / ".old-cache-keep"  # not a name replace_dir makes: never touched
    mine.mkdir()
    restore_replaced(out)  # a cache in place is never touched
    assert (out / META).is_file() and (out / "shard-00000.safetensors").read_bytes() == b"x" and mine.is_dir()
