"""Run the teacher once over the training data and cache a sparse view of its distributions.

    python recipes/cache_teacher.py --config recipes/configs/cache_teacher_demo.yaml
    python recipes/cache_teacher.py teacher=DIR dataset=data.jsonl seq_len=2048 topk=64 output_dir=cache/
    python recipes/cache_teacher.py mode=sampled samples=48 temperature=1.0 output_dir=cache/   # unbiased

Then train without the teacher: ``accelerate launch recipes/distill.py teacher_cache=cache/ student=DIR
hidden_weight=0 attn_weight=0`` (the data keys must match: the cache checks a fingerprint of the
packed blocks, a sampled cache its temperature). See ``distill/teacher_cache.py`` for the format, the
top-k tail-bucket approximation and the unbiased sampled estimate.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

# Python puts a script's folder first on sys.path, and this folder holds distill.py, which would shadow
# the `distill` package: keep the folder off sys.path so imports come from the installed packages.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch
from tqdm.auto import tqdm

from core.config import ConfigError, check_fields, field, parse_config, run_cli, save_config
from core.fsio import replace_dir
from core.rundir import check_replaceable
from distill.data import BUILTIN, build_data, eval_batches
from distill.teacher_cache import (
    META,
    MODES,
    bytes_per_token,
    fingerprint,
    sample_teacher,
    tail_mass,
    tokenizer_fingerprint,
    topk_logprobs,
    write_shard,
)
from eval.metrics import evaluate_lm


@dataclass
class CacheTeacherConfig:
    teacher: str = field("smollm2-135m-instruct", help="teacher model (as in recipes/distill.py)")
    tokenizer: str | None = field(None, help="tokenizer source; default: the teacher's")
    dataset: str = field(BUILTIN, help="training text, exactly as the distill run will use it")
    eval_dataset: str | None = field(None, help="held-out text, as in the distill run")
    text_field: str = field("text", help="text column")
    seq_len: int = field(256, ge=2, help="packed block length (must match the distill run)")
    eval_blocks: int = field(16, ge=1,
                             help="held-out blocks for the teacher perplexity recorded in the cache")
    max_blocks: int | None = field(None, ge=1,
                                   help="cache only the first N training blocks (and train on them)")
    mode: str = field("topk", choices=MODES, help="topk: the k most likely tokens + a tail bucket (biased); "
                      "sampled: `samples` draws from the teacher at `temperature` with counts (unbiased KD loss "
                      "and gradient)")
    topk: int = field(32, ge=1, help="mode=topk: teacher tokens kept per position")
    samples: int = field(48, ge=1, le=255, help="mode=sampled: draws per position; stored as distinct ids + "
                         "uint8 counts")
    temperature: float = field(1.0, gt=0, help="mode=sampled: KD temperature the draws are made at (the distill "
                               "run must use the same)")
    batch_size: int = field(8, ge=1, help="blocks per teacher forward")
    shard_blocks: int = field(256, ge=1, help="blocks per shard file")
    seed: int = field(0, ge=0, le=2**32 - 1, help="seed (tiny-random teacher)")
    output_dir: str = field("runs/teacher-cache", help="cache folder to write")
    overwrite: bool = field(False, help="replace an existing cache")
    # accepted so one YAML can drive both recipes; unused here
    student: str | None = field(None, help="unused (the distill run's student)")
    keep_layers: str = field("10", help="unused")

    def __post_init__(self) -> None:
        check_fields(self)  # every field's range/choices, declared above (core.config.field)


def main() -> None:
    cfg = parse_config(CacheTeacherConfig)
    out = Path(cfg.output_dir)
    if out.exists() and not cfg.overwrite:
        raise ConfigError(f"{out} already exists; pass overwrite=true or another output_dir=")
    if out.exists():  # overwrite replaces only a cache of ours (core/rundir.py)
        check_replaceable(out, (out / META).is_file(), f"a teacher cache (no {META})")
    from distill.sources import load_pair

    cfg_for_load = type("C", (), {**cfg.__dict__, "student": None, "teacher_cache": None, "keep_layers": "1"})
    teacher, _, tokenizer = load_pair(cfg_for_load)
    data = build_data(tokenizer, dataset=cfg.dataset, eval_dataset=cfg.eval_dataset, seq_len=cfg.seq_len,
                      eval_blocks=cfg.eval_blocks, text_field=cfg.text_field, max_train_blocks=cfg.max_blocks)
    vocab = teacher.config.vocab_size
    if cfg.mode == "topk" and cfg.topk > vocab:
        raise ConfigError(f"topk {cfg.topk} exceeds the vocabulary ({vocab})")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        t0 = time.time()
        n = data.train.shape[0]
        slots = cfg.topk if cfg.mode == "topk" else cfg.samples
        gen = torch.Generator().manual_seed(cfg.seed)
        tail_sum, tokens = 0.0, 0
        with torch.inference_mode(), tqdm(total=n * cfg.seq_len, unit="tok", desc=f"teacher {cfg.mode}") as bar:
            for shard, start in enumerate(range(0, n, cfg.shard_blocks)):
                idx, val, cnt = [], [], []
                for b in range(start, min(n, start + cfg.shard_blocks), cfg.batch_size):
                    blocks = data.train[b: min(b + cfg.batch_size, start + cfg.shard_blocks, n)]
                    logits = teacher(input_ids=blocks).logits
                    if cfg.mode == "topk":
                        i, v = topk_logprobs(logits, cfg.topk)
                        tail_sum += float(tail_mass(v).sum())
                        tokens += v.shape[0] * v.shape[1]
                    else:
                        i, c, v = sample_teacher(logits, cfg.samples, cfg.temperature, gen)
                        cnt.append(c)
                    idx.append(i)
                    val.append(v)
                    bar.update(blocks.numel())
                write_shard(tmp / f"shard-{shard:05d}.safetensors", torch.cat(idx), torch.cat(val),
                            torch.cat(cnt) if cnt else None)
            teacher_ppl = evaluate_lm(teacher, eval_batches(data.eval, cfg.batch_size, mask=data.eval_mask))[0].perplexity
        meta = {"mode": cfg.mode, "k": slots, "seq_len": cfg.seq_len, "blocks": n,
                "fingerprint": fingerprint(data.train), "teacher": cfg.teacher, "dataset": cfg.dataset,
                "vocab_size": vocab, "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
                "bytes_per_token": bytes_per_token(cfg.mode, slots), "teacher_ppl": teacher_ppl,
                "seconds": time.time() - t0}
        if cfg.mode == "topk":
            meta["tail_mass"] = tail_sum / max(tokens, 1)  # mean teacher mass the truncation drops
        else:
            meta["samples"] = cfg.samples
            meta["temperature"] = cfg.temperature
        (tmp / META).write_text(json.dumps(meta, indent=1))
        save_config(cfg, tmp / "config.yaml")
        replace_dir(tmp, out)  # fsynced, then renamed; an old cache is removed only after
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    size = sum(p.stat().st_size for p in out.iterdir())
    what = (f"top-{cfg.topk}, mean tail mass {meta['tail_mass']:.3f}" if cfg.mode == "topk"
            else f"{cfg.samples} samples at T={cfg.temperature}")
    print(f"teacher cache: {out}  ({n} blocks × {cfg.seq_len} tokens, {what}, {meta['bytes_per_token']} bytes/token "
          f"stored ({size / (n * cfg.seq_len):.0f} on disk), teacher held-out ppl {teacher_ppl:.2f})")


if __name__ == "__main__":
    run_cli(main)
