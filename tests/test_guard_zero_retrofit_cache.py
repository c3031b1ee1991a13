"""The teacher cache on two real gloo processes: a rerun after a kill shares the missing shards evenly, and the
process group waits as long as the training recipes' (``HYBRID_DISTILL_DIST_TIMEOUT``)."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from core.tiny import TINY
from distill.data import build_data
from distill.sources import load_recipe_tokenizer
from distill.teacher_cache import META, fingerprint, shard_metadata, write_shard
from recipes.cache_teacher import (
    CacheTeacherConfig,
    cache_shard,
    claim_work,
    load_teacher,
    shard_blocks,
    shard_name,
)
from tests.helpers import ROOT, child_env

SETTINGS = ["teacher=tiny-random", "seq_len=32", "max_blocks=24", "shard_blocks=4", "mode=topk", "topk=5",
            "batch_size=4", "eval_blocks=2"]

# Rank RANK of a 2-process gloo group (the environment `accelerate launch` gives a rank): the recipe's own main(),
# with each shard it writes recorded; prints which it wrote and the process group's timeout.
WORKER = """import json, sys, torch
import recipes.cache_teacher as ct
written, real = [], ct.cache_shard
def recorded(cfg, teacher, blocks, shard, *a, **k):
    written.append(shard)
    return real(cfg, teacher, blocks, shard, *a, **k)
ct.cache_shard = recorded
sys.argv = ["cache_teacher.py", *sys.argv[1:]]
ct.main()
group = torch.distributed.distributed_c10d._get_default_group()
timeout = group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
print(json.dumps({"rank": torch.distributed.get_rank(), "written": written, "timeout": timeout}))
torch.distributed.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_processes(args: list[str], cache_root: Path, **env: str) -> dict[int, dict]:
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, *args], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env=child_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE="2", RANK=str(r),
                                            LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1",
                                            HYBRID_DISTILL_CACHE=str(cache_root), **env))
             for r in range(2)]
    results = {}
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        line = json.loads(out.strip().splitlines()[-1])
        results[line["rank"]] = line
    return results


def test_a_rerun_shares_the_missing_shards_evenly_and_waits_as_long_as_training(tmp_path: Path,
                                                                                 monkeypatch: pytest.MonkeyPatch):
    """A killed run that had written every even shard (its rank 0 had finished its share) is rerun on two processes:
    both write half of what is missing, instead of rank 1 writing all of it while rank 0 waits at the barrier."""
    monkeypatch.setenv("HYBRID_DISTILL_CACHE", str(tmp_path / "hd-cache"))
    out = tmp_path / "cache"
    args = [*SETTINGS, f"output_dir={out}"]
    cfg = CacheTeacherConfig(teacher=TINY, seq_len=32, max_blocks=24, shard_blocks=4, mode="topk", topk=5,
                             batch_size=4, eval_blocks=2, output_dir=str(out))
    work = out.with_name(f".{out.name}.partial")
    assert claim_work(cfg, work) == 0
    tokenizer = load_recipe_tokenizer(cfg.teacher, cfg.tokenizer)
    data = build_data(tokenizer, dataset=cfg.dataset, eval_dataset=cfg.eval_dataset, seq_len=cfg.seq_len,
                      eval_blocks=cfg.eval_blocks, text_field=cfg.text_field, max_train_blocks=cfg.max_blocks,
                      progress=False)
    assert data.train.shape[0] == 24  # six shards of four blocks
    teacher, bar = load_teacher(cfg, torch.device("cpu")), SimpleNamespace(update=lambda n: None)
    for i in (0, 2, 4):
        cache_shard(cfg, teacher, shard_blocks(cfg, data.train, i), i, work / shard_name(i), bar, len(tokenizer))
    kept = {i: (work / shard_name(i)).read_bytes() for i in (0, 2, 4)}

    results = _two_processes(args, tmp_path / "hd-cache", HYBRID_DISTILL_DIST_TIMEOUT="4321")
    assert sorted(results[0]["written"] + results[1]["written"]) == [1, 3, 5]  # none doubled, none missing
    assert results[0]["written"] == [1, 5] and results[1]["written"] == [3]
    assert results[0]["timeout"] == results[1]["timeout"] == 4321.0
    assert not work.exists() and json.loads((out / META).read_text())["blocks"] == 24
    for i in range(6):
        assert shard_metadata(out / shard_name(i))["blocks"] == fingerprint(shard_blocks(cfg, data.train, i))
    assert {i: (out / shard_name(i)).read_bytes() for i in (0, 2, 4)} == kept  # the finished ones were kept


def test_shards_are_readable_like_every_other_file(tmp_path: Path) -> None:
    """safetensors writes its files private (0600); a cache read by a training job under another user (a shared
    cluster folder) must get the permissions of the rest of the folder, as the export's files do."""
    mask = os.umask(0o022)
    try:
        path = tmp_path / "shard-00000.safetensors"
        write_shard(path, torch.zeros(1, 2, 3, dtype=torch.int32), torch.zeros(1, 2, 3))
        (tmp_path / "other.json").write_text("{}")
    finally:
        os.umask(mask)
    assert stat.S_IMODE(path.stat().st_mode) == stat.S_IMODE((tmp_path / "other.json").stat().st_mode) == 0o644
