"""Draw a hybrid attention pattern as a block picture.

    python -m attention.show --seq 4096 --out mask.png
    python -m attention.show --seq 8192 --sink 64 --window 256 --global-every 512 --out mask.png
    python -m attention.show --model runs/retrofit/final --seq 4096 --out mask.png

Each pixel is a ``block x block`` tile of (query, key) pairs, shaded by the fraction the pattern
keeps; the title gives the fraction of causal pairs kept (the work ratio against dense attention).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from attention.errors import HybridAttentionError
from attention.masks import allowed
from attention.spec import CONFIG_KEY, HybridAttentionConfig

MAX_PIXELS = 512


def block_density(seq: int, spec: HybridAttentionConfig, block: int, window: int | None = None) -> torch.Tensor:
    """``[ceil(seq/block), ceil(seq/block)]`` fraction of kept pairs per tile, one row of tiles at a time."""
    tiles = -(-seq // block)
    keys = torch.arange(seq)
    pad = tiles * block - seq
    out = torch.zeros(tiles, tiles)
    for t in range(tiles):
        rows = torch.arange(t * block, min(seq, (t + 1) * block))
        m = allowed(rows, keys, spec, window).float()
        m = torch.nn.functional.pad(m, (0, pad))
        out[t] = m.view(len(rows), tiles, block).mean((0, 2)) * (len(rows) / block)
    return out


def kept_fraction(seq: int, spec: HybridAttentionConfig, window: int | None = None) -> float:
    """Kept pairs over causal pairs for a ``seq``-token input."""
    keys = torch.arange(seq)
    kept = sum(int(allowed(torch.arange(s, min(seq, s + 1024)), keys, spec, window).sum())
               for s in range(0, seq, 1024))
    return kept / (seq * (seq + 1) / 2)


def draw(seq: int, spec: HybridAttentionConfig, out: str | Path, *, block: int | None = None,
         window: int | None = None) -> Path:
    """Write the picture to ``out`` (PNG); returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    block = block or max(1, -(-seq // MAX_PIXELS))
    w = spec.window_for(seq) if window is None else window
    dens = block_density(seq, spec, block, w)
    frac = kept_fraction(seq, spec, w)
    fig, ax = plt.subplots(figsize=(6.4, 6.0), dpi=120)
    # A power norm keeps one-token-wide global columns visible next to fully kept tiles.
    im = ax.imshow(dens.numpy(), cmap="Blues", norm=matplotlib.colors.PowerNorm(0.3, vmin=0.0, vmax=1.0),
                   interpolation="nearest", extent=(0, seq, seq, 0))
    ax.set_xlabel("key position")
    ax.set_ylabel("query position")
    rows = ", global rows" if spec.global_rows else ""
    ax.set_title(f"sink {spec.sink_tokens}, window {w}, global every {spec.global_every}{rows}\n"
                 f"{seq} tokens, {block}x{block} tiles, {100 * frac:.1f}% of causal pairs kept", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label="fraction of tile kept")
    fig.tight_layout()
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m attention.show", description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=4096, help="sequence length to draw")
    p.add_argument("--out", default="mask.png", help="PNG to write")
    p.add_argument("--model", help="model directory whose config.json holds the spec (overrides defaults)")
    p.add_argument("--sink", type=int, help="sink tokens")
    p.add_argument("--window", type=int, help="local window (counts the token itself)")
    p.add_argument("--global-every", type=int, help="period of global tokens (0 = none)")
    p.add_argument("--max-globals", type=int, help="at most this many global tokens")
    p.add_argument("--global-rows", action="store_true", help="global tokens also attend to everything before")
    p.add_argument("--block", type=int, help=f"tile size in tokens (default: fit {MAX_PIXELS} pixels)")
    a = p.parse_args(argv)
    try:
        base = HybridAttentionConfig().to_dict()
        if a.model:
            path = Path(a.model) / "config.json"
            if not path.is_file():
                raise HybridAttentionError(f"{a.model} has no config.json; point --model at a saved model directory "
                                           "or pass --sink/--window")
            try:
                cfg = json.loads(path.read_text())
            except json.JSONDecodeError as err:
                raise HybridAttentionError(f"{path} is not valid JSON ({err}); fix it or pass --sink/--window") from None
            if not isinstance(cfg, dict) or CONFIG_KEY not in cfg:
                raise HybridAttentionError(f"{a.model}/config.json has no {CONFIG_KEY!r}; pass --sink/--window instead")
            if not isinstance(cfg[CONFIG_KEY], dict):
                raise HybridAttentionError(f"{path}: {CONFIG_KEY!r} must be an object of spec keys, got "
                                           f"{cfg[CONFIG_KEY]!r}; fix it or pass --sink/--window")
            base.update(cfg[CONFIG_KEY])
        for key, val in (("sink_tokens", a.sink), ("window", a.window), ("global_every", a.global_every),
                         ("max_globals", a.max_globals)):
            if val is not None:
                base[key] = val
        if a.window is not None:  # an explicit window replaces a saved window_policy (which would win otherwise)
            base["window_policy"] = None
        base["global_rows"] = base["global_rows"] or a.global_rows
        if a.seq < 1:
            raise HybridAttentionError(f"--seq must be >= 1, got {a.seq}")
        if a.block is not None and a.block < 1:
            raise HybridAttentionError(f"--block must be >= 1 (tokens per tile), got {a.block}; leave it out to fit "
                                       f"{MAX_PIXELS} pixels")
        spec = HybridAttentionConfig.from_dict(base)
        path = draw(a.seq, spec, a.out, block=a.block)
    except (HybridAttentionError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
