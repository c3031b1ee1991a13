"""The attention pattern the benchmarks' "mixed" arm runs: the default retrofit's, or a retrofitted model's.

Not a benchmark itself: ``bench/attention.py`` and ``bench/decode.py`` import it, so both measure the
same pattern a user of the default retrofit config gets (its sinks, window or ``window_policy``,
globals, ``full_head_share``), or exactly the spec a retrofitted model saved (``--roles DIR``).
"""

from __future__ import annotations

import json
from pathlib import Path

from attention.heads import spread_roles
from attention.spec import CONFIG_KEY, HybridAttentionConfig

RETROFIT_CONFIG = Path(__file__).resolve().parents[1] / "recipes" / "configs" / "retrofit_smollm2.yaml"
PATTERN_KEYS = ("sink_tokens", "window", "global_every", "max_globals", "global_rows", "window_policy")


def retrofit_default() -> tuple[HybridAttentionConfig, float]:
    """``(pattern without roles, full_head_share)`` of recipes/configs/retrofit_smollm2.yaml."""
    import yaml

    cfg = yaml.safe_load(RETROFIT_CONFIG.read_text())
    spec = HybridAttentionConfig(**{k: cfg[k] for k in PATTERN_KEYS if k in cfg})
    return spec, float(cfg["full_head_share"])


def model_spec(model_dir: str | Path) -> HybridAttentionConfig:
    """The hybrid spec a retrofitted model saved in its config.json (one-line error when it has none)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise SystemExit(f"--roles {model_dir}: no config.json there; pass a retrofit's final/ folder")
    raw = json.loads(path.read_text()).get(CONFIG_KEY)
    if not raw:
        raise SystemExit(f"--roles {model_dir}: its config.json has no {CONFIG_KEY!r}; pass a retrofitted model")
    return HybridAttentionConfig.from_dict(raw)


def mixed_spec(layers: int, kv_heads: int, share: float | None = None,
               roles: str | None = None) -> HybridAttentionConfig:
    """The model ``roles``'s own spec, else the default retrofit pattern with ``share`` (default: the
    config's ``full_head_share``) of the ``layers × kv_heads`` pairs full, spread evenly over the layers
    (which heads does not change the cost, only how many)."""
    if roles:
        return model_spec(roles)
    spec, default = retrofit_default()
    return spread_roles(spec, layers, kv_heads, default if share is None else share)
