"""Offline teacher: top-k log-probabilities cached once, then distilled from without the teacher.

For teachers too big to sit beside the student, ``recipes/cache_teacher.py`` runs the teacher over
the packed training blocks once and stores, per token, the ``k`` most likely next tokens and their
log-probabilities (T = 1). ``recipes/distill.py teacher_cache=DIR`` then computes the logits term
from the shards. The rest of the vocabulary is one *tail bucket* holding the remaining mass, so the
teacher distribution is exact on ``k + 1`` outcomes: KL over those buckets is a lower bound of the
full KL that tightens as ``k`` grows (at T = 1; with T ≠ 1 the tail bucket is tempered as if it were
one token, which is the price of not storing the tail).

Layout of a cache folder: ``meta.json`` (k, seq_len, blocks, fingerprint of the packed data,
bytes per token, teacher held-out perplexity) and ``shard-NNNNN.safetensors`` with ``index``
``[blocks, seq, k]`` int32 and ``logprobs`` ``[blocks, seq, k]`` fp16.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from core.config import ConfigError

META = "meta.json"


class TeacherCacheError(ConfigError):
    """A cache that is missing, incomplete, or made from other data."""


def fingerprint(blocks: torch.Tensor) -> str:
    """A hash of the packed token blocks: a cache only matches the exact data it was made from."""
    return hashlib.sha256(blocks.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()[:16]


@torch.no_grad()
def topk_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., vocab]`` logits → ``([..., k] int32 ids, [..., k] fp32 log-probs)`` at T = 1."""
    logp = F.log_softmax(logits.float(), dim=-1)
    values, index = logp.topk(k, dim=-1)
    return index.to(torch.int32), values


def bytes_per_token(k: int) -> int:
    return k * (4 + 2)


def write_shard(path: Path, index: torch.Tensor, logprobs: torch.Tensor) -> None:
    save_file({"index": index.contiguous(), "logprobs": logprobs.to(torch.float16).contiguous()}, str(path))


class TeacherCache:
    """Cached top-k teacher log-probs for the blocks of a training set (loaded into memory)."""

    def __init__(self, path: str | Path, train_blocks: torch.Tensor):
        path = Path(path)
        if not (path / META).is_file():
            raise TeacherCacheError(f"{path} is not a teacher cache (no {META}); write one with recipes/cache_teacher.py")
        self.meta = json.loads((path / META).read_text())
        if self.meta["fingerprint"] != fingerprint(train_blocks):
            raise TeacherCacheError(
                f"teacher cache {path} was made from other data (dataset/seq_len/tokenizer differ); rerun "
                "recipes/cache_teacher.py with this run's dataset and seq_len"
            )
        shards = sorted(path.glob("shard-*.safetensors"))
        parts = [load_file(str(s)) for s in shards]
        self.index = torch.cat([p["index"] for p in parts])
        self.logprobs = torch.cat([p["logprobs"] for p in parts])
        if self.index.shape[0] != train_blocks.shape[0]:
            raise TeacherCacheError(f"teacher cache {path} is incomplete ({self.index.shape[0]} of "
                                    f"{train_blocks.shape[0]} blocks); rerun recipes/cache_teacher.py")
        self.k = self.index.shape[-1]

    def lookup(self, blocks: torch.Tensor, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """``[micro]`` block indices → ``([micro, seq, k] int64 ids, [micro, seq, k] fp32 log-probs)``."""
        return self.index[blocks].to(device, torch.long), self.logprobs[blocks].to(device, torch.float32)
