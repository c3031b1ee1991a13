"""A teacher-cached distill run hashes its training corpus once, on the main process, and every rank checks the
cache against that one hash."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import distill.teacher_cache as teacher_cache
from core.tiny import tiny_tokenizer
from distill.teacher_cache import (
    META,
    TeacherCache,
    TeacherCacheError,
    fingerprint,
    tokenizer_fingerprint,
    write_shard,
)
from tests.helpers import ROOT, child_env


def _blocks() -> torch.Tensor:
    return torch.randint(0, 320, (5, 8), generator=torch.Generator().manual_seed(0))


def _write_cache(path: Path, blocks: torch.Tensor, tok) -> None:
    path.mkdir()
    ids, lp = teacher_cache.topk_logprobs(torch.randn(*blocks.shape, 320, generator=torch.Generator().manual_seed(1)), 4)
    write_shard(path / "shard-00000.safetensors", ids, lp)
    (path / META).write_text(json.dumps({"mode": "topk", "k": 4, "seq_len": blocks.shape[1], "blocks": blocks.shape[0],
                                         "fingerprint": fingerprint(blocks), "vocab_size": 320,
                                         "tokenizer_fingerprint": tokenizer_fingerprint(tok)}))


def test_a_given_fingerprint_is_used_instead_of_hashing_and_still_checked(tmp_path, monkeypatch):
    tok, blocks = tiny_tokenizer(), _blocks()
    _write_cache(tmp_path / "c", blocks, tok)
    hashed = TeacherCache(tmp_path / "c", blocks, vocab_size=320, tokenizer=tok)  # single process: as before
    known = fingerprint(blocks)

    def no_hash(*args, **kwargs):
        raise AssertionError("the corpus was hashed although its fingerprint was given")
    monkeypatch.setattr(teacher_cache, "fingerprint", no_hash)
    given = TeacherCache(tmp_path / "c", blocks, vocab_size=320, tokenizer=tok, data_fingerprint=known)
    pick = torch.tensor([4, 0, 2])
    a, b = hashed.lookup(pick, "cpu"), given.lookup(pick, "cpu")
    assert torch.equal(a.ids, b.ids) and torch.equal(a.logprobs, b.logprobs)
    with pytest.raises(TeacherCacheError, match="made from other data"):
        TeacherCache(tmp_path / "c", blocks, vocab_size=320, tokenizer=tok, data_fingerprint="0" * 16)


def test_single_process_shared_fingerprint_is_the_plain_one(monkeypatch):
    from recipes import distill

    blocks = _blocks()
    assert distill.shared_fingerprint(SimpleNamespace(is_main_process=True), blocks) == fingerprint(blocks)


# Rank RANK of a 2-process gloo group: shared_fingerprint with fingerprint() counted; prints the JSON result.
WORKER = """import json, os, sys, torch
from accelerate import PartialState
import recipes.distill as d
state = PartialState(cpu=True, backend="gloo")
real, calls = d.fingerprint, []
def counted(blocks, *a, **k):
    calls.append(state.process_index)
    return real(blocks, *a, **k)
d.fingerprint = counted
blocks = torch.randint(0, 320, (5, 8), generator=torch.Generator().manual_seed(0))
value = d.shared_fingerprint(state, blocks)
print(json.dumps({"rank": state.process_index, "value": value, "hashed": len(calls)}))
state.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.distributed
def test_two_gloo_processes_hash_once_and_agree():
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, "-c", WORKER], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=child_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE="2",
                                                       RANK=str(r), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2",
                                                       OMP_NUM_THREADS="1"))
             for r in range(2)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    by_rank = {r["rank"]: r for r in results}
    assert sorted(by_rank) == [0, 1]
    assert by_rank[0]["hashed"] == 1 and by_rank[1]["hashed"] == 0  # the corpus is read once, not once per rank
    assert by_rank[0]["value"] == by_rank[1]["value"] == fingerprint(_blocks())
