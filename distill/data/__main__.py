"""Prepare a run's data ahead of time (on one node, before a multi-node job).

    python -m distill.data prepare --config recipes/configs/NAME.yaml [key=value ...] [num_proc=N]

Reads the config as the distill recipe does (``distill.config.DistillConfig``: unknown keys and bad
values are refused, a key left out takes the recipe's default), tokenizes and packs every source into
the data cache, and prints tokens, blocks, bytes and time per source. A later run with the same
sources, tokenizer and seq_len maps the cache and starts in seconds.
"""

from __future__ import annotations

import sys
import time

from core.config import ConfigError, check_output_dir, parse_config, run_cli
from distill.config import DistillConfig
from distill.data.corpus import build_data
from distill.data.prepare import open_prepared
from distill.sources import load_recipe_tokenizer


def _parse(argv: list[str]) -> tuple[DistillConfig, int | None]:
    """``(recipe config, num_proc)``: ``num_proc=N`` is this command's own key, the rest the recipe's."""
    num_proc = None
    rest = []
    for arg in argv:
        if arg.startswith("num_proc="):
            try:
                num_proc = int(arg.split("=", 1)[1])
            except ValueError:
                num_proc = 0
            if num_proc < 1:
                raise ConfigError(f"num_proc must be a whole number >= 1, got {arg.split('=', 1)[1]!r}")
        else:
            rest.append(arg)
    return parse_config(DistillConfig, rest), num_proc


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "prepare":
        raise ConfigError("usage: python -m distill.data prepare --config FILE [key=value ...]")
    cfg, num_proc = _parse(argv[1:])
    if cfg.data_cache:
        check_output_dir(cfg.data_cache, "data_cache", writable=False)
    tokenizer = load_recipe_tokenizer(cfg.teacher, cfg.tokenizer)
    t0 = time.time()
    data = build_data(tokenizer, dataset=cfg.dataset, datasets=cfg.datasets, eval_dataset=cfg.eval_dataset,
                      text_field=cfg.text_field, seq_len=cfg.seq_len, eval_blocks=1,
                      completion_only=cfg.completion_only, data_cache=cfg.data_cache, num_proc=num_proc,
                      streaming=cfg.streaming)
    seconds = time.time() - t0
    print(f"{'source':<32} {'weight':>7} {'tokens':>14} {'blocks':>10} {'bytes':>14} {'time s':>8}  cache")
    for r in data.sources:
        nbytes = open_prepared(r.path).meta["bytes"] if r.path else 0
        print(f"{r.name[:32]:<32} {r.weight:>7.3g} {r.tokens or 0:>14,} {r.train_blocks or 0:>10,} "
              f"{nbytes:>14,} {r.seconds:>8.1f}  {r.path or '(streamed)'}")
    print(f"total: {sum(r.tokens or 0 for r in data.sources):,} training tokens in "
          f"{sum(r.train_blocks or 0 for r in data.sources):,} blocks of {cfg.seq_len}, {seconds:.1f}s")


if __name__ == "__main__":
    run_cli(main)
