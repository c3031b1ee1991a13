"""Run the teacher once over the training data and cache a sparse view of its distributions.

    python recipes/cache_teacher.py --config recipes/configs/cache_teacher_demo.yaml
    python recipes/cache_teacher.py teacher=DIR dataset=data.jsonl seq_len=2048 topk=64 output_dir=cache/
    python recipes/cache_teacher.py mode=sampled samples=48 temperature=1.0 output_dir=cache/   # unbiased

Then train without the teacher: ``accelerate launch recipes/distill.py teacher_cache=cache/ student=DIR
hidden_weight=0 attn_weight=0`` (the data keys must match: the cache checks a fingerprint of the
packed blocks, a sampled cache its temperature). See ``distill/teacher_cache.py`` for the format, the
top-k tail-bucket approximation and the unbiased sampled estimate.

At corpus scale: ``accelerate launch recipes/cache_teacher.py ...`` splits the shards across processes
(GPU i writes shards i, i + world, ...; the teacher in bf16 on GPUs). Shards are written whole into
``.NAME.partial/`` next to the output; a killed run rerun with the same settings keeps the shards whose
blocks are unchanged (each shard records a fingerprint of its blocks) and shares the rest evenly among its
processes, and the folder becomes ``output_dir`` once every shard is there. The process group waits as long
as the training recipes' (3 hours, ``HYBRID_DISTILL_DIST_TIMEOUT=SECONDS``): the other processes wait while
the main one prepares a corpus the first time.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# Python puts a script's folder first on sys.path, and this folder holds distill.py, which would shadow
# the `distill` package: keep the folder off sys.path so imports come from the installed packages.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch
from accelerate import PartialState
from tqdm.auto import tqdm

from core.config import (
    ConfigError,
    check_fields,
    check_output_dir,
    config_changes,
    field,
    load_yaml,
    parse_config,
    run_cli,
    save_config,
    to_dict,
)
from core.fsio import replace_dir, restore_aside
from core.models import ModelSourceError, load_causal_lm, peek_config
from core.rundir import check_replaceable
from core.tiny import TINY, tiny_teacher
from distill.config import check_data_source, check_model_source
from distill.data import BUILTIN, build_data, eval_batches
from distill.sources import load_recipe_tokenizer
from distill.teacher_cache import (
    META,
    MODES,
    bytes_per_token,
    fingerprint,
    sample_teacher,
    shard_metadata,
    tail_mass,
    tokenizer_fingerprint,
    topk_logprobs,
    write_shard,
)
from distill.training import dist_timeout
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
    dtype: str = field("auto", choices=("auto", "fp32", "bf16", "fp16"),
                       help="teacher weights; auto: bf16 on GPUs that support it, fp32 on CPU (log-probs are fp32)")
    shard_blocks: int = field(256, ge=1, help="blocks per shard file")
    seed: int = field(0, ge=0, le=2**32 - 1, help="seed (tiny-random teacher)")
    output_dir: str = field("runs/teacher-cache", help="cache folder to write")
    overwrite: bool = field(False, help="replace an existing cache (or start an unfinished one over)")
    debug_exit_after_shards: int | None = field(None, ge=1, help="testing: die like a killed process after "
                                                "writing this many shards (this process)")
    # accepted so one YAML can drive both recipes; unused here
    student: str | None = field(None, help="unused (the distill run's student)")
    keep_layers: str = field("10", help="unused")

    def __post_init__(self) -> None:
        check_fields(self)  # every field's range/choices, declared above (core.config.field)


# Keys a resumed (unfinished) cache may change: they do not change what is written (the teacher's dtype does).
RESUME_SAFE = ("output_dir", "overwrite", "batch_size", "student", "keep_layers", "debug_exit_after_shards")


def shard_name(i: int) -> str:
    return f"shard-{i:05d}.safetensors"


def claim_work(cfg: CacheTeacherConfig, work: Path) -> int:
    """The folder shards are written into until the cache is whole (main process); returns shards already in it.

    An unfinished folder from a killed run with the same settings is resumed (its finished shards are
    kept if their blocks still match, see :func:`shards_to_write`); one with other settings is refused, unless it
    holds no shard yet (a run that failed before its first, whose rerun fixes a setting); ``overwrite=true`` starts
    it over either way.
    """
    saved = work / "config.yaml"
    if work.exists() and not saved.is_file():
        # A run killed between creating the folder and writing its config.yaml left it empty, or holding only
        # our temporary names: start it over. Anything else is not ours to delete.
        if any(not _ours_temporary(p) for p in work.iterdir()):
            raise ConfigError(f"{work} exists but is not an unfinished teacher cache (no config.yaml); move it away")
        shutil.rmtree(work)
    if work.exists():
        changes = config_changes(load_yaml(saved), to_dict(cfg), RESUME_SAFE)
        if changes and not any(work.glob("shard-*.safetensors")):
            # A run that failed before its first shard (a bad text_field, too little data): nothing to keep, and
            # its settings are the ones that failed, so the fixed rerun starts it over.
            print(f"starting {work} over: it holds no shard yet, and its settings differ", flush=True)
        elif changes and not cfg.overwrite:
            listed = ", ".join(f"{k}: {o!r} → {n!r}" for k, (o, n) in changes.items())
            raise ConfigError(f"{work} holds an unfinished cache with other settings ({listed}); rerun with its "
                              "settings to finish it, or overwrite=true to start over")
        if changes or cfg.overwrite:
            shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    for stale in work.glob(".shard-*"):  # a shard being written when the run was killed
        stale.unlink()
    save_config(cfg, saved)
    return len(list(work.glob("shard-*.safetensors")))


def _ours_temporary(path: Path) -> bool:
    """A file this recipe writes under a temporary name: a shard being written (``.shard-*``) or config.yaml
    being written (:func:`core.fsio.atomic_write`'s ``.config.yaml.*.tmp``)."""
    name = path.name
    return path.is_file() and (name.startswith(".shard-") or (name.startswith(".config.yaml.") and name.endswith(".tmp")))


def shard_blocks(cfg: CacheTeacherConfig, train, i: int) -> torch.Tensor:
    """Shard ``i``'s training blocks ``[n, seq]``."""
    return train[i * cfg.shard_blocks: min(train.shape[0], (i + 1) * cfg.shard_blocks)]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def shards_to_write(cfg: CacheTeacherConfig, train, work: Path, rank: int, world: int,
                    dtype: torch.dtype | None = None) -> list[int]:
    """This process's shards (``i mod world == rank``) not yet in ``work`` for the data as it is now.

    A kept shard counts only if its recorded block fingerprint matches: a dataset file regenerated under
    the same name changes no setting, and its old shards must not be mixed with the new data. Nor may
    shards of another teacher precision (``dtype``: the teacher's now): ``dtype=auto`` resolves to bf16 on a
    GPU and fp32 on a CPU, so a run resumed on another machine would otherwise mix the two in one cache.
    """
    todo = []
    for i in range(rank, math.ceil(train.shape[0] / cfg.shard_blocks), world):
        path = work / shard_name(i)
        meta = shard_metadata(path) if path.is_file() else {}
        if (meta.get("blocks") != fingerprint(shard_blocks(cfg, train, i))
                or (dtype is not None and meta.get("dtype") != dtype_name(dtype))):
            todo.append(i)
    return todo


def shards_for_process(cfg: CacheTeacherConfig, train, work: Path, state: PartialState,
                       dtype: torch.dtype | None = None) -> list[int]:
    """This process's share of the shards still missing from ``work``: every missing shard, in order, dealt out
    round-robin (``missing[rank::world]``).

    Each process checks only its own ``i mod world`` shards (:func:`shards_to_write`: hashing every shard's
    blocks on every process would read the corpus ``world`` times), then all of them learn the whole missing
    list. Were each to write only the missing shards it found, a process whose share a killed run had finished
    would wait idle at the closing barrier while another wrote its whole share alone. The exchange is collective: no
    process writes a shard before every one has looked at the folder, so none finds a shard another is writing.
    A fresh cache gives the plain split, shard ``i`` to process ``i mod world``.
    """
    rank, world = state.process_index, state.num_processes
    mine = shards_to_write(cfg, train, work, rank, world, dtype=dtype)
    if world == 1:
        return mine
    found: list[list[int] | None] = [None] * world
    torch.distributed.all_gather_object(found, mine)
    return sorted(i for part in found for i in part)[rank::world]


def process_state() -> PartialState:
    """This process among those ``accelerate launch`` started: gloo without GPUs, and the training recipes'
    process-group timeout (:func:`distill.training.dist_timeout`, 3 hours) instead of torch's 10 (NCCL) or 30
    (gloo) minutes, which the other processes would exceed waiting while the main one prepares a large corpus.
    """
    # Without GPUs: gloo, and cpu=True, without which accelerate's barriers are no-ops under a CPU launch.
    cpu = not torch.cuda.is_available()
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return PartialState(cpu=cpu)
    return PartialState(cpu=cpu, timeout=dist_timeout(), **({"backend": "gloo"} if cpu else {}))


def cache_shard(cfg: CacheTeacherConfig, teacher, blocks: torch.Tensor, shard: int, path: Path, bar,
                vocab: int | None = None) -> None:
    """The teacher's targets for one shard's blocks ``[n, seq]``, written whole (temp name, then renamed).

    ``vocab``: the tokenizer's length; a teacher head padded beyond it is cut there (its distribution over
    the tokenizer's tokens, renormalized, as the live teacher's sliced logits): padding rows name no token, and
    a student padded less than the teacher would refuse their ids.

    Sampled draws use a generator seeded by ``(seed, shard)``: the same cache whatever the number of
    processes or restarts. The shard's metadata carries its tail mass (top-k) for the cache summary.
    """
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + shard)
    idx, val, cnt = [], [], []
    tail_sum, tokens = 0.0, 0
    device = device_dtype(teacher)[0]
    with torch.inference_mode():
        for b in range(0, blocks.shape[0], cfg.batch_size):
            batch = blocks[b: b + cfg.batch_size]
            logits = teacher(input_ids=batch.to(device)).logits[..., :vocab].float().cpu()
            if cfg.mode == "topk":
                i, v = topk_logprobs(logits, cfg.topk)
                tail_sum += float(tail_mass(v).sum())
                tokens += v.shape[0] * v.shape[1]
            else:
                i, c, v = sample_teacher(logits, cfg.samples, cfg.temperature, gen)
                cnt.append(c)
            idx.append(i)
            val.append(v)
            bar.update(batch.numel())
    tmp = path.with_name(f".{path.name}")
    meta = {"blocks": fingerprint(blocks), "dtype": dtype_name(device_dtype(teacher)[1])}  # shards_to_write's checks
    if cfg.mode == "topk":
        meta |= {"tail_sum": repr(tail_sum), "tokens": str(tokens)}
    write_shard(tmp, torch.cat(idx), torch.cat(val), torch.cat(cnt) if cnt else None, metadata=meta)
    os.replace(tmp, path)


def device_dtype(teacher) -> tuple[torch.device, torch.dtype]:
    p = next(teacher.parameters())
    return p.device, p.dtype


def load_teacher(cfg: CacheTeacherConfig, device: torch.device):
    """The frozen teacher on ``device`` in ``cfg.dtype`` (auto: bf16 on GPUs that have it, fp32 on CPU)."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.dtype)
    if dtype is None:  # auto
        dtype = torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    try:
        teacher = tiny_teacher(cfg.seed) if cfg.teacher == TINY else load_causal_lm(cfg.teacher, dtype)
    except (ModelSourceError, OSError) as err:
        raise ConfigError(str(err).splitlines()[0]) from None
    return teacher.to(device=device, dtype=dtype).eval().requires_grad_(False)


def check_before_loading(cfg: CacheTeacherConfig) -> None:
    """Local model and data paths that do not exist (:mod:`distill.config`'s checks), then seq_len within the
    teacher's positions and topk within its vocabulary, from its config.json and the tokenizer, before its weights
    load and before the unfinished folder is claimed (a teacher whose config cannot be read so is checked once it
    loads)."""
    for key in ("teacher", "tokenizer"):
        if getattr(cfg, key):
            check_model_source(getattr(cfg, key), key)
    for key in ("dataset", "eval_dataset"):
        if getattr(cfg, key):
            check_data_source(getattr(cfg, key), key)
    config = peek_config(cfg.teacher)
    if config is not None:
        check_teacher(cfg, config, load_recipe_tokenizer(cfg.teacher, cfg.tokenizer))


def check_teacher(cfg: CacheTeacherConfig, config, tokenizer) -> None:
    """What the teacher's ``config`` and ``tokenizer`` decide about the settings: a block longer than the
    teacher's context would cache targets from positions it never learned, a tokenizer larger than its vocabulary
    gives ids it has no row for, and top-k needs k tokens."""
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and cfg.seq_len > limit:
        raise ConfigError(f"seq_len {cfg.seq_len} exceeds the teacher's maximum of {limit} positions; lower seq_len")
    if len(tokenizer) > config.vocab_size:  # its ids past the vocabulary would fail the teacher's first forward
        raise ConfigError(f"the tokenizer has {len(tokenizer)} tokens but the teacher's vocabulary has "
                          f"{config.vocab_size}; set tokenizer= to one of the teacher's size (or leave it empty)")
    vocab = min(config.vocab_size, len(tokenizer))  # the head's rows that are tokens
    if cfg.mode == "topk" and cfg.topk > vocab:
        raise ConfigError(f"topk {cfg.topk} exceeds the vocabulary ({vocab}); lower topk")


def restore_replaced(out: Path) -> None:
    """Put back a cache that a kill left only under its aside name (:func:`core.fsio.restore_aside`).

    The old cache goes back to ``out`` (it is whole when it holds ``meta.json``): the state before the run,
    which a rerun with ``overwrite=true`` then replaces as intended. Every process may call this.
    """
    if restore_aside(out, lambda p: (p / META).is_file()) is not None:
        print(f"restored {out}, which a killed run had left aside", flush=True)


def main() -> None:
    cfg = parse_config(CacheTeacherConfig)
    out = Path(cfg.output_dir)
    check_output_dir(out, "output_dir")  # a file (overwrite=true would move it aside), or a place we cannot write
    check_before_loading(cfg)
    restore_replaced(out)
    if out.exists() and not cfg.overwrite:
        raise ConfigError(f"{out} already exists; pass overwrite=true or another output_dir=")
    if out.exists():  # overwrite replaces only a cache of ours (core/rundir.py)
        check_replaceable(out, (out / META).is_file(), f"a teacher cache (no {META})")
    state = process_state()
    work = out.with_name(f".{out.name}.partial")  # shards land here until the cache is whole; kept on a kill
    if state.is_main_process:
        out.parent.mkdir(parents=True, exist_ok=True)
        done = claim_work(cfg, work)
        if done:
            print(f"resuming {work}: {done} shard(s) already written")
    state.wait_for_everyone()
    teacher = load_teacher(cfg, state.device)
    tokenizer = load_recipe_tokenizer(cfg.teacher, cfg.tokenizer)
    check_teacher(cfg, teacher.config, tokenizer)  # again, for a teacher check_before_loading could not read
    with state.main_process_first():  # one process prepares the data, the others map it
        data = build_data(tokenizer, dataset=cfg.dataset, eval_dataset=cfg.eval_dataset, seq_len=cfg.seq_len,
                          eval_blocks=cfg.eval_blocks, text_field=cfg.text_field, max_train_blocks=cfg.max_blocks)
    vocab = min(teacher.config.vocab_size, len(tokenizer))  # the head's rows that are tokens
    t0, n = time.time(), data.train.shape[0]
    # Shards already written for these blocks (a resumed run) are skipped; the missing ones are dealt out evenly.
    todo = shards_for_process(cfg, data.train, work, state, dtype=device_dtype(teacher)[1])
    total = sum(min(n, (i + 1) * cfg.shard_blocks) - i * cfg.shard_blocks for i in todo) * cfg.seq_len
    with tqdm(total=total, unit="tok", desc=f"teacher {cfg.mode}", disable=not state.is_main_process) as bar:
        for written, i in enumerate(todo, 1):
            cache_shard(cfg, teacher, shard_blocks(cfg, data.train, i), i, work / shard_name(i), bar, vocab)
            if written == cfg.debug_exit_after_shards:
                os._exit(137)
    state.wait_for_everyone()
    if state.is_main_process:
        finish(cfg, teacher, tokenizer, data, work, out, time.time() - t0)
    state.wait_for_everyone()


def finish(cfg: CacheTeacherConfig, teacher, tokenizer, data, work: Path, out: Path, seconds: float) -> None:
    """Every shard is written: the teacher's held-out perplexity, ``meta.json``, then the folder goes in place."""
    n = data.train.shape[0]
    shards = [work / shard_name(i) for i in range(math.ceil(n / cfg.shard_blocks))]
    if missing := sum(not s.is_file() for s in shards):
        raise ConfigError(f"{work} lacks {missing} of {len(shards)} shards; rerun to finish it")
    for extra in set(work.glob("shard-*.safetensors")) - set(shards):  # the data shrank since they were written
        extra.unlink()
    device = next(teacher.parameters()).device
    teacher_ppl = evaluate_lm(teacher, eval_batches(data.eval, cfg.batch_size, mask=data.eval_mask),
                              device=device)[0].perplexity
    slots = cfg.topk if cfg.mode == "topk" else cfg.samples
    meta = {"mode": cfg.mode, "k": slots, "seq_len": cfg.seq_len, "blocks": n,
            "fingerprint": fingerprint(data.train), "teacher": cfg.teacher, "dataset": cfg.dataset,
            "vocab_size": teacher.config.vocab_size, "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
            "bytes_per_token": bytes_per_token(cfg.mode, slots), "teacher_ppl": teacher_ppl, "seconds": seconds}
    if cfg.mode == "topk":  # mean teacher mass the truncation drops, from every shard's own sums
        sums = [shard_metadata(s) for s in shards]
        meta["tail_mass"] = sum(float(m["tail_sum"]) for m in sums) / max(sum(int(m["tokens"]) for m in sums), 1)
    else:
        meta["samples"] = cfg.samples
        meta["temperature"] = cfg.temperature
    (work / META).write_text(json.dumps(meta, indent=1))
    replace_dir(work, out)  # fsynced, then renamed; an old cache is removed only after
    size = sum(p.stat().st_size for p in out.iterdir())
    what = (f"top-{cfg.topk}, mean tail mass {meta['tail_mass']:.3f}" if cfg.mode == "topk"
            else f"{cfg.samples} samples at T={cfg.temperature}")
    print(f"teacher cache: {out}  ({n} blocks × {cfg.seq_len} tokens, {what}, {meta['bytes_per_token']} bytes/token "
          f"stored ({size / (n * cfg.seq_len):.0f} on disk), teacher held-out ppl {teacher_ppl:.2f})")


if __name__ == "__main__":
    run_cli(main)
