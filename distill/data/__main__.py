"""Prepare a run's data ahead of time (on one node, before a multi-node job).

    python -m distill.data prepare --config recipes/configs/NAME.yaml [key=value ...]

Reads the data keys of a recipe config (the recipe checks its other keys when it runs), tokenizes
and packs every source into the data cache, and prints tokens, blocks, bytes and time per source.
A later run with the same sources, tokenizer and seq_len maps the cache and starts in seconds.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass

from core.config import ConfigError, build_config, field, load_yaml, run_cli
from distill.data.text import BUILTIN


@dataclass
class PrepareConfig:
    teacher: str = field("smollm2-135m-instruct", help="model whose tokenizer is used (as in the recipe)")
    tokenizer: str | None = field(None, help="tokenizer source; default: the teacher's")
    dataset: str = field(BUILTIN, help="one source (used when datasets is empty)")
    datasets: list | None = field(None, help="weighted sources: [{source: PATH_OR_NAME, weight: 0.7}, ...]")
    eval_dataset: str | None = field(None, help="held-out text; default: a held-out split of each source")
    text_field: str = field("text", help="column holding the text")
    seq_len: int = field(256, help="tokens per packed block")
    completion_only: bool = field(True, help="chat records: only assistant tokens are targets")
    data_cache: str | None = field(None, help="cache folder; default $HYBRID_DISTILL_CACHE/data")
    num_proc: int | None = field(None, help="tokenizer processes; default: every core this process may use")
    streaming: bool = field(False, help="streamed sources are not prepared; this only reports them")
    seed: int = field(0, help="unused here; accepted so recipe configs load")


def _parse(argv: list[str]) -> PrepareConfig:
    from core.config import _parse_scalar

    values: dict = {}
    overrides: dict = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            print(__doc__)
            raise SystemExit(0)
        if arg == "--config" and i + 1 < len(argv):
            values.update(load_yaml(argv[i + 1]))
            i += 2
            continue
        if arg.startswith("--config="):
            values.update(load_yaml(arg.split("=", 1)[1]))
        elif "=" in arg and not arg.startswith("-"):
            key, value = arg.split("=", 1)
            overrides[key.strip()] = _parse_scalar(value)
        else:
            raise ConfigError(f"cannot parse argument '{arg}'; use prepare --config PATH key=value ...")
        i += 1
    known = {f.name for f in dataclasses.fields(PrepareConfig)}
    # The recipe's other keys (loss weights, steps...) are its own to check; the command line must be ours.
    picked = {k: v for k, v in values.items() if k in known}
    picked.update(overrides)
    return build_config(PrepareConfig, picked, where="the command line")


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "prepare":
        raise ConfigError("usage: python -m distill.data prepare --config FILE [key=value ...]")
    cfg = _parse(argv[1:])
    from distill.data.corpus import build_data

    tokenizer = _tokenizer(cfg)
    t0 = time.time()
    data = build_data(tokenizer, dataset=cfg.dataset, datasets=cfg.datasets, eval_dataset=cfg.eval_dataset,
                      text_field=cfg.text_field, seq_len=cfg.seq_len, eval_blocks=1,
                      completion_only=cfg.completion_only, data_cache=cfg.data_cache, num_proc=cfg.num_proc,
                      streaming=cfg.streaming)
    seconds = time.time() - t0
    print(f"{'source':<32} {'weight':>7} {'tokens':>14} {'blocks':>10} {'bytes':>14} {'time s':>8}  cache")
    for r in data.sources:
        from distill.data.prepare import open_prepared

        nbytes = open_prepared(r.path).meta["bytes"] if r.path else 0
        print(f"{r.name[:32]:<32} {r.weight:>7.3g} {r.tokens or 0:>14,} {r.train_blocks or 0:>10,} "
              f"{nbytes:>14,} {r.seconds:>8.1f}  {r.path or '(streamed)'}")
    print(f"total: {sum(r.tokens or 0 for r in data.sources):,} training tokens in "
          f"{sum(r.train_blocks or 0 for r in data.sources):,} blocks of {cfg.seq_len}, {seconds:.1f}s")


def _tokenizer(cfg: PrepareConfig):
    from core.models import ModelSourceError, load_tokenizer
    from core.tiny import TINY, tiny_tokenizer

    if (cfg.tokenizer or cfg.teacher) == TINY:
        return tiny_tokenizer()
    try:
        return load_tokenizer(cfg.tokenizer or cfg.teacher)
    except (ModelSourceError, OSError) as err:
        raise ConfigError(str(err).splitlines()[0]) from None


if __name__ == "__main__":
    run_cli(main)
