"""Offline teacher: its next-token distributions cached once, then distilled from without the teacher.

For teachers too big to sit beside the student, ``recipes/cache_teacher.py`` runs the teacher over
the packed training blocks once and stores, per position, a sparse view of its distribution;
``recipes/distill.py teacher_cache=DIR`` then computes the logits term from the shards. Two modes:

* ``topk``: the ``k`` most likely next tokens and their log-probabilities (T = 1). The rest of the
  vocabulary is one *tail bucket* holding the remaining mass, so the teacher distribution is exact
  on ``k + 1`` outcomes: KL over those buckets is a lower bound of the full KL that tightens as ``k``
  grows (with T != 1 the tail bucket is tempered as if it were one token). Its gradient is *biased*:
  the student's tail tokens are only pushed as a group, never towards the teacher's tail shape.
  ``meta.json`` records the mean tail mass the truncation drops.
* ``sampled`` (Sparse Logit Sampling, ACL 2025): ``N`` tokens drawn from the teacher distribution at
  the KD temperature, stored as distinct ids with counts (and the teacher log-probs of those ids).
  ``count / N`` is an unbiased estimate of the teacher distribution, so the forward-KL value and
  gradient computed from it (:func:`distill.losses.sampled_kd_loss`) are unbiased; only their
  variance shrinks with ``N``. The temperature is fixed when the cache is written.

Layout of a cache folder: ``meta.json`` (mode, k or samples, temperature, vocab size, tokenizer
fingerprint, seq_len, blocks, fingerprint of the packed data, bytes per token, teacher held-out
perplexity) and ``shard-NNNNN.safetensors`` with ``index`` ``[blocks, seq, slots]`` int32,
``logprobs`` ``[blocks, seq, slots]`` fp16 and, for ``sampled``, ``counts`` ``[blocks, seq, slots]``
uint8 (0 on padding slots).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from core.config import ConfigError
from core.fsio import share_like_umask
from distill.data import Blocks
from distill.data.corpus import FileArray
from distill.losses import sampled_kd_loss, topk_kd_loss

META = "meta.json"
MODES = ("topk", "sampled")


class TeacherCacheError(ConfigError):
    """A cache that is missing, incomplete, made from other data, or for another tokenizer."""


def fingerprint(blocks: torch.Tensor | Blocks, chunk: int = 4096) -> str:
    """A hash of the packed token blocks ``[n, seq]``: a cache only matches the exact data it was made from.

    Read ``chunk`` blocks at a time (the SHA-256 of their int64 bytes in order), so a memory-mapped corpus of
    billions of tokens is hashed without being loaded whole.
    """
    h = hashlib.sha256()
    for lo in range(0, blocks.shape[0], chunk):
        h.update(blocks[lo: lo + chunk].to(torch.int64).contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of the tokenizer's token → id table: ids only mean the same thing under the same table."""
    items = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(items, ensure_ascii=False).encode()).hexdigest()[:16]


@torch.no_grad()
def topk_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., vocab]`` logits → ``([..., k] int32 ids, [..., k] fp32 log-probs)`` at T = 1."""
    logp = F.log_softmax(logits.float(), dim=-1)
    values, index = logp.topk(k, dim=-1)
    return index.to(torch.int32), values


@torch.no_grad()
def tail_mass(topk_logprobs_: torch.Tensor) -> torch.Tensor:
    """``[..., k]`` top-k log-probs → ``[...]`` probability mass outside the top-k."""
    return (1.0 - topk_logprobs_.float().exp().sum(-1)).clamp(min=0.0)


@torch.no_grad()
def sample_teacher(logits: torch.Tensor, n: int, temperature: float = 1.0,
                   generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draw ``n`` tokens per position from ``softmax(logits / T)``, folded into distinct ids with counts.

    Args:
        logits: ``[..., vocab]`` teacher logits.
        n: draws per position (with replacement), at most 255 (counts are stored as uint8).
    Returns:
        ``ids`` ``[..., n]`` int32 (distinct per position first, then 0 padding), ``counts``
        ``[..., n]`` uint8 (0 on padding, summing to ``n``), ``logprobs`` ``[..., n]`` fp32: the
        teacher's log-probs at T of those ids (``-inf`` on padding).
    """
    if not 1 <= n <= 255:
        raise ValueError(f"samples must be in [1, 255] (stored as uint8 counts), got {n}")
    lead, vocab = logits.shape[:-1], logits.shape[-1]
    logp = F.log_softmax(logits.float().reshape(-1, vocab) / temperature, dim=-1)
    draws = torch.multinomial(logp.exp(), n, replacement=True, generator=generator)  # [rows, n]
    s = draws.sort(dim=-1).values
    # Group equal ids: a run starts where the sorted id changes; its group number is the run index.
    starts = torch.ones_like(s, dtype=torch.bool)
    starts[:, 1:] = s[:, 1:] != s[:, :-1]
    group = starts.long().cumsum(-1) - 1
    counts = torch.zeros_like(s).scatter_add_(1, group, torch.ones_like(s))
    ids = torch.zeros_like(s).scatter_(1, group, s)
    lp = logp.gather(-1, ids).masked_fill(counts == 0, float("-inf"))
    return (ids.to(torch.int32).reshape(*lead, n), counts.to(torch.uint8).reshape(*lead, n),
            lp.reshape(*lead, n))


def bytes_per_token(mode: str, slots: int) -> int:
    """Stored bytes per position: int32 id + fp16 log-prob per slot, plus a uint8 count when sampled."""
    return slots * (4 + 2 + (1 if mode == "sampled" else 0))


def slots_for_bytes(mode: str, budget: int) -> int:
    """The most slots (k or samples) that fit in ``budget`` bytes per token."""
    return budget // bytes_per_token(mode, 1)


def write_shard(path: Path, index: torch.Tensor, logprobs: torch.Tensor, counts: torch.Tensor | None = None,
                metadata: dict[str, str] | None = None) -> None:
    """One shard: ``index`` int32, ``logprobs`` fp16 and ``counts`` uint8 ``[blocks, seq, slots]``, + string metadata."""
    tensors = {"index": index.to(torch.int32).contiguous(), "logprobs": logprobs.to(torch.float16).contiguous()}
    if counts is not None:
        tensors["counts"] = counts.to(torch.uint8).contiguous()
    save_file(tensors, str(path), metadata=metadata)
    share_like_umask(path)  # safetensors writes it private (0600); the cache's other files are not


def shard_metadata(path: Path) -> dict[str, str]:
    """The string metadata :func:`write_shard` stored in a shard (its header only is read)."""
    with open(path, "rb") as f:
        return json.loads(f.read(int.from_bytes(f.read(8), "little"))).get("__metadata__", {})


@dataclass
class CachedTargets:
    """The cached teacher targets of a micro-batch.

    ``ids`` ``[batch, seq, slots]`` long; ``logprobs`` ``[batch, seq, slots]`` fp32;
    ``weights`` ``[batch, seq, slots]`` fp32 (``count / N``) for a sampled cache, None for top-k.
    """

    ids: torch.Tensor
    logprobs: torch.Tensor
    weights: torch.Tensor | None = None

    def positions(self, sl: slice) -> CachedTargets:
        """The targets at sequence positions ``sl`` (e.g. ``slice(None, -1)``: every position with a next token)."""
        w = None if self.weights is None else self.weights[:, sl]
        return CachedTargets(self.ids[:, sl], self.logprobs[:, sl], w)


def cached_kd_loss(student_logits: torch.Tensor, targets: CachedTargets | tuple[torch.Tensor, torch.Tensor],
                   mask: torch.Tensor | None = None, *, temperature: float = 1.0) -> torch.Tensor:
    """The logits term from cached targets: top-k + tail bucket, or the unbiased sampled estimate.

    ``student_logits`` ``[batch, seq, vocab]`` aligned with ``targets`` (a ``(ids, logprobs)`` pair
    is read as top-k); ``mask`` ``[batch, seq]``.
    """
    if isinstance(targets, tuple):
        targets = CachedTargets(*targets)
    if targets.weights is None:
        return topk_kd_loss(student_logits, targets.ids, targets.logprobs, mask, temperature=temperature)
    return sampled_kd_loss(student_logits, targets.ids, targets.weights, mask, temperature=temperature,
                           teacher_logprobs=targets.logprobs)


_NUMPY_DTYPES = {"I32": np.int32, "F16": np.float16, "U8": np.uint8, "F32": np.float32, "I64": np.int64}


def shard_arrays(path: Path) -> dict[str, tuple[FileArray, tuple[int, ...]]]:
    """Where the tensors of one safetensors shard lie in its file: per name, ``[blocks, seq * slots]`` rows and
    the tensor's own shape.

    A safetensors file is an 8-byte little-endian header length, a JSON header giving each tensor's dtype,
    shape and byte range, then the raw little-endian data. Nothing is read beyond the header (and nothing
    is mapped or left open), so a cache of thousands of shards costs nothing until rows are looked up.
    """
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    end = 8 + size + max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if path.stat().st_size < end:
        raise TeacherCacheError(f"teacher cache shard {path} is truncated ({path.stat().st_size} of {end} bytes); "
                                "rerun recipes/cache_teacher.py")
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _NUMPY_DTYPES:
            raise TeacherCacheError(f"{path}: tensor {name} has dtype {info['dtype']}; rewrite the cache with "
                                    "recipes/cache_teacher.py")
        shape = tuple(info["shape"])
        rows = FileArray(str(path), 8 + size + info["data_offsets"][0], np.dtype(_NUMPY_DTYPES[info["dtype"]]),
                         (shape[0], int(np.prod(shape[1:]))))
        out[name] = (rows, shape)
    return out


class TeacherCache:
    """Cached teacher targets for the blocks of a training set, read from the shards on demand.

    The shards stay on disk (rows read with ``pread``, as the training blocks are): a
    micro-batch's :meth:`lookup` copies only its own rows, so memory does not grow with the cache, which
    at 384 bytes per token is hundreds of GB for a corpus of a billion tokens.

    Args:
        path: the cache folder.
        train_blocks: ``[blocks, seq]`` the run's packed training blocks (must match the cache's).
        vocab_size, tokenizer: the student's; a cache written under another vocabulary or
            tokenizer is refused (its ids would name other tokens).
        temperature: the run's KD temperature; a sampled cache was drawn at one temperature and
            is only unbiased at that one.
        data_fingerprint: :func:`fingerprint` of ``train_blocks`` when the caller already has it, or a function
            that gives it, called only once what ``meta.json`` can judge has passed (a multi-process run hashes the
            corpus once, on the main process, and a wrong block count is named before a corpus is hashed); None:
            hashed here.
    """

    def __init__(self, path: str | Path, train_blocks: torch.Tensor | Blocks, *, vocab_size: int | None = None,
                 tokenizer=None, temperature: float | None = None,
                 data_fingerprint: str | Callable[[], str] | None = None):
        path = Path(path)
        self.path = path
        self.meta = read_meta(path)
        check_meta(self.meta, path, temperature=temperature)
        check_vocabulary(self.meta, path, vocab_size=vocab_size, tokenizer=tokenizer)
        if self.meta.get("blocks") not in (None, train_blocks.shape[0]):  # before hashing a corpus to say so
            raise TeacherCacheError(
                f"teacher cache {path} was made from other data: it holds {self.meta['blocks']} blocks but this run "
                f"trains on {train_blocks.shape[0]}; set max_train_blocks={self.meta['blocks']} if it was written with "
                f"max_blocks={self.meta['blocks']}, else rerun recipes/cache_teacher.py with this run's dataset and seq_len")
        if callable(data_fingerprint):  # only now: the checks above cost no pass over the corpus
            data_fingerprint = data_fingerprint()
        if self.meta["fingerprint"] != (data_fingerprint or fingerprint(train_blocks)):
            raise TeacherCacheError(
                f"teacher cache {path} was made from other data (dataset/seq_len/tokenizer differ); rerun "
                "recipes/cache_teacher.py with this run's dataset and seq_len"
            )
        # numeric order: from shard 100000 on the names grow a digit and string order is not shard order
        shards = [shard_arrays(s) for s in sorted(path.glob("shard-*.safetensors"),
                                                   key=lambda p: int(p.stem.split("-", 1)[1]))]
        if not shards:
            raise TeacherCacheError(f"teacher cache {path} has no shards; rerun recipes/cache_teacher.py")
        blocks = sum(sh["index"][1][0] for sh in shards)
        if blocks != train_blocks.shape[0]:
            raise TeacherCacheError(f"teacher cache {path} is incomplete ({blocks} of "
                                    f"{train_blocks.shape[0]} blocks); rerun recipes/cache_teacher.py")
        self.seq, self.k = shards[0]["index"][1][1:]
        self.vocab_size = vocab_size
        width = self.seq * self.k
        names = ("index", "logprobs", "counts") if self.mode == "sampled" else ("index", "logprobs")
        # One row reader per tensor over the shards laid end to end (the training blocks' reader).
        self._rows = {n: Blocks([sh[n][0] for sh in shards], [None] * len(shards), width) for n in names}

    @property
    def mode(self) -> str:
        return self.meta.get("mode", "topk")

    def _read(self, name: str, blocks: torch.Tensor) -> torch.Tensor:
        rows = self._rows[name].rows(blocks.reshape(-1).cpu())  # [micro, seq * slots] in the stored dtype
        return torch.from_numpy(rows).view(-1, self.seq, self.k)

    def lookup(self, blocks: torch.Tensor, device: torch.device | str) -> CachedTargets:
        """``[micro]`` block indices → the targets of those blocks (``[micro, seq, slots]`` each)."""
        ids = self._read("index", blocks)
        if self.vocab_size is not None and ids.numel() and int(ids.max()) >= self.vocab_size:
            raise TeacherCacheError(f"teacher cache {self.path} holds token ids beyond the student's vocabulary of "
                                    f"{self.vocab_size}; cache with the student's tokenizer")
        ids = ids.to(device, torch.long)
        logp = self._read("logprobs", blocks).to(device, torch.float32)
        if self.mode != "sampled":
            return CachedTargets(ids, logp)
        counts = self._read("counts", blocks).to(device, torch.float32)
        return CachedTargets(ids, logp, counts / counts.sum(-1, keepdim=True).clamp(min=1))


def read_meta(path: str | Path) -> dict:
    """``meta.json`` of a cache folder, or a one-line error when it is not one."""
    path = Path(path)
    if not (path / META).is_file():
        raise TeacherCacheError(f"{path} is not a teacher cache (no {META}); write one with recipes/cache_teacher.py")
    try:
        meta = json.loads((path / META).read_text())
    except (ValueError, OSError):  # torn or unreadable
        meta = None
    if not isinstance(meta, dict) or "fingerprint" not in meta:
        raise TeacherCacheError(f"{path / META} is not a teacher cache's metadata (unreadable, or without its data "
                                "fingerprint); rewrite the cache with recipes/cache_teacher.py")
    return meta


def check_vocabulary(meta: dict, path: str | Path, *, vocab_size: int | None = None, tokenizer=None) -> None:
    """A cache written under another vocabulary (``vocab_size``: the student's) or tokenizer is refused: its ids
    would name other tokens. Sizes that differ only in padding rows beyond the shared tokenizer are one vocabulary
    (as for a live teacher, :func:`distill.model.check_pair`)."""
    cached_vocab = meta.get("vocab_size")
    padding_only = (tokenizer is not None and vocab_size is not None and cached_vocab is not None
                    and len(tokenizer) <= min(vocab_size, cached_vocab))
    if vocab_size is not None and cached_vocab not in (None, vocab_size) and not padding_only:
        raise TeacherCacheError(f"teacher cache {path} was written for a vocabulary of {cached_vocab} tokens but the "
                                f"student has {vocab_size}; cache with the student's tokenizer")
    if tokenizer is not None and meta.get("tokenizer_fingerprint") not in (None, tokenizer_fingerprint(tokenizer)):
        raise TeacherCacheError(f"teacher cache {path} was written with another tokenizer; rerun "
                                "recipes/cache_teacher.py with this run's tokenizer")


def check_meta(meta: dict, path: str | Path, *, temperature: float | None = None, kd_kind: str | None = None,
               seq_len: int | None = None) -> None:
    """Checks that need only the cache's metadata (run before any model loads)."""
    mode = meta.get("mode", "topk")
    if mode not in MODES:
        raise TeacherCacheError(f"teacher cache {path} has unknown mode {mode!r}; rewrite it with recipes/cache_teacher.py")
    if seq_len is not None and meta.get("seq_len") not in (None, seq_len):
        raise TeacherCacheError(f"teacher cache {path} holds blocks of {meta['seq_len']} tokens but the run uses "
                                f"seq_len={seq_len}; set seq_len={meta['seq_len']} or re-cache at this seq_len")
    if kd_kind is not None and kd_kind != "forward_kl":
        raise TeacherCacheError(f"a teacher cache gives forward-KL targets only; set kd_kind=forward_kl "
                                f"(got {kd_kind}) or distill from the live teacher")
    if mode == "sampled" and temperature is not None and abs(meta["temperature"] - temperature) > 1e-9:
        raise TeacherCacheError(f"teacher cache {path} was sampled at temperature {meta['temperature']} but the run "
                                f"uses {temperature}; set temperature={meta['temperature']} or re-sample the cache")


