"""The hybrid sparse attention pattern: one spec, stored in the model config.

A query at position ``i`` sees a key at position ``j <= i`` iff

* ``j < sink_tokens`` (attention sinks: the first tokens every query keeps), or
* ``i - j < window`` (the local window counts the query itself: exactly ``window`` recent keys), or
* ``global_every > 0 and j % global_every == 0`` (periodic global tokens every later query sees;
  at most ``max_globals`` of them when set, the earliest ones).

``sink_tokens=0`` is legitimate (no sinks: window + globals only); ``window`` must be at least 1
(the token itself). Sequences no longer than ``sink_tokens + window`` get exactly dense causal
attention.

``global_rows=True`` additionally gives each global token a full attention row (it sees every
earlier key, Longformer-style). A global row needs the whole history at decode time, so a
bounded KV cache is impossible with it; that is why it is off by default.

``window_policy`` maps sequence length to window: ``[[1024, 256], [4096, 512], [None, 1024]]``
reads "up to 1024 tokens: 256; up to 4096: 512; beyond: 1024". At inference the window follows
the input length; in training the recipe samples a window from the table.

Per-head roles (DuoAttention-style, and Gemma-style whole layers): ``full_heads`` maps a layer index
to the KV heads of that layer that keep full causal attention ("retrieval heads"); ``full_layers``
lists layers whose every head is full. Every other KV head streams (the pattern above). The query
heads of a GQA group follow their KV head. ``head_scores`` keeps how the roles were chosen
(``{"method": ..., "scores": [[per KV head] per layer], ...}``); it does not change the pattern.
With no roles every head streams, as before. A full head needs its whole history at decode time:
the serving cache keeps a full cache for those heads and the bounded one for the rest.
"""

from __future__ import annotations

import dataclasses
import json
import numbers
from typing import Any

from attention.errors import HybridAttentionError

CONFIG_KEY = "hybrid_attention"


def _is_int(value: Any) -> bool:
    """An integer (numpy's too), not a bool or a float such as 2.5 or 256.0."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _index_list(value: Any) -> list[int] | None:
    """Sorted distinct indices of a list, tuple or set of integers (numpy's too), else None (floats, bools, strings)."""
    if not isinstance(value, (list, tuple, set, frozenset)) or not all(_is_int(x) for x in value):
        return None
    return sorted({int(x) for x in value})


def _layer_key(value: Any) -> int | None:
    """A ``full_heads`` layer key: an integer, or its decimal string (JSON object keys are strings)."""
    if _is_int(value):
        return int(value)
    if isinstance(value, str) and value.isascii() and value.isdigit():
        return int(value)
    return None


@dataclasses.dataclass
class HybridAttentionConfig:
    sink_tokens: int = 128
    window: int = 512
    global_every: int = 1024
    max_globals: int | None = None
    global_rows: bool = False
    window_policy: list[tuple[int | None, int]] | None = None
    full_heads: dict[int, list[int]] | None = None
    full_layers: list[int] | None = None
    head_scores: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        # Types first: a spec also comes from hand-edited config.json files and JSON on the command line.
        for key in ("sink_tokens", "window", "global_every", "max_globals"):
            value = getattr(self, key)
            if value is None and key == "max_globals":
                continue
            if not _is_int(value):
                raise HybridAttentionError(f"{key} must be an integer, got {value!r}")
            setattr(self, key, int(value))
        if not isinstance(self.global_rows, bool):
            raise HybridAttentionError(f"global_rows must be true or false, got {self.global_rows!r}")
        if self.sink_tokens < 0:
            raise HybridAttentionError(f"sink_tokens must be >= 0, got {self.sink_tokens}; use 0 to disable sinks")
        if self.window <= 0:
            raise HybridAttentionError(f"window must be > 0, got {self.window}; the window counts the token itself")
        if self.global_every < 0:
            raise HybridAttentionError(f"global_every must be >= 0, got {self.global_every}; use 0 to disable globals")
        if self.max_globals is not None and self.max_globals < 0:
            raise HybridAttentionError(f"max_globals must be >= 0 or None, got {self.max_globals}")
        if self.global_rows and (self.global_every == 0 or self.max_globals == 0):
            # the pattern would be the one without rows, yet the spec unbounded: serving would refuse it
            raise HybridAttentionError(f"global_rows=true has no global tokens to give rows to (global_every="
                                       f"{self.global_every}, max_globals={self.max_globals}); set global_rows=false")
        if self.window_policy is not None:
            try:
                policy = [(b if b is None or not _is_int(b) else int(b), int(w) if _is_int(w) else w)
                          for b, w in self.window_policy]
            except (TypeError, ValueError):
                policy = []
            if not policy or not all((b is None or _is_int(b)) and _is_int(w) and w > 0 for b, w in policy):
                raise HybridAttentionError("window_policy needs [[max_len, window], ...] of integers with windows > 0, "
                                           f"got {self.window_policy!r}")
            bounds = [b for b, _ in policy if b is not None]
            if any(b < 1 for b in bounds):  # no input is shorter than 1 token: never served, yet trained on
                raise HybridAttentionError(f"window_policy bounds must be >= 1 (a length in tokens), got {bounds}")
            # strictly: with a repeated bound the later window is sampled in training but never served
            if any(a >= b for a, b in zip(bounds, bounds[1:])) or any(b is None for b, _ in policy[:-1]):
                raise HybridAttentionError("window_policy bounds must strictly increase; only the last may be None "
                                           f"(no limit), got {[b for b, _ in policy]}")
            self.window_policy = policy
        if self.full_heads is not None:
            if not isinstance(self.full_heads, dict):
                raise HybridAttentionError("full_heads needs {layer: [kv_head, ...]}, e.g. {0: [1], 5: [0, 2]}")
            heads: dict[int, list[int]] = {}
            for layer, hs in self.full_heads.items():
                li, his = _layer_key(layer), _index_list(hs)
                if li is None or his is None:
                    raise HybridAttentionError(f"full_heads[{layer!r}] must be a list of KV head indices under an "
                                               f"integer layer, got {hs!r}")
                if li < 0 or any(h < 0 for h in his):
                    raise HybridAttentionError(f"full_heads has a negative layer or head index ({layer}: {hs})")
                if his:
                    heads[li] = his
            self.full_heads = dict(sorted(heads.items())) or None
        if self.full_layers is not None:
            layers = _index_list(self.full_layers)
            if layers is None:
                raise HybridAttentionError(f"full_layers must be a list of layer indices, got {self.full_layers!r}")
            if any(x < 0 for x in layers):
                raise HybridAttentionError(f"full_layers has a negative layer index: {layers}")
            self.full_layers = layers or None
        if self.head_scores is not None and not isinstance(self.head_scores, dict):
            raise HybridAttentionError("head_scores must be a dict ({'method': ..., 'scores': [[...], ...]})")

    @property
    def has_head_roles(self) -> bool:
        """True when some KV heads keep full attention (the rest stream)."""
        return bool(self.full_heads or self.full_layers)

    def full_kv_heads(self, layer: int | None, kv_heads: int) -> tuple[int, ...]:
        """The KV heads of ``layer`` that keep full causal attention (all of a full layer; none by default)."""
        if layer is None or not self.has_head_roles:
            return ()
        if self.full_layers and layer in self.full_layers:
            return tuple(range(kv_heads))
        return tuple(h for h in (self.full_heads or {}).get(layer, ()) if h < kv_heads)

    def check_model(self, num_layers: int, kv_heads: int) -> None:
        """One-line error when the roles name a layer or KV head the model does not have."""
        bad_layers = [x for x in (self.full_layers or []) + list(self.full_heads or {}) if x >= num_layers]
        if bad_layers:
            raise HybridAttentionError(f"hybrid attention head roles name layer(s) {sorted(set(bad_layers))} but the "
                                       f"model has {num_layers} layers (0..{num_layers - 1}); fix full_heads/full_layers")
        bad = [(x, h) for x, hs in (self.full_heads or {}).items() for h in hs if h >= kv_heads]
        if bad:
            raise HybridAttentionError(f"hybrid attention full_heads name (layer, kv_head) {bad} but the model has "
                                       f"{kv_heads} KV heads per layer (0..{kv_heads - 1}); fix full_heads")

    def full_head_count(self, num_layers: int, kv_heads: int) -> int:
        """How many (layer, KV head) pairs keep full attention."""
        return sum(len(self.full_kv_heads(x, kv_heads)) for x in range(num_layers))

    def streaming(self) -> HybridAttentionConfig:
        """The same pattern with every head streaming (no roles)."""
        return dataclasses.replace(self, full_heads=None, full_layers=None, head_scores=None)

    @property
    def windows(self) -> list[int]:
        """Every window the spec can use: ``window`` and those of ``window_policy``."""
        return [self.window] + [w for _, w in self.window_policy or []]

    def window_for(self, seq_len: int) -> int:
        """The window to use for an input of ``seq_len`` tokens (the policy's, else ``window``)."""
        if not self.window_policy:
            return self.window
        for bound, w in self.window_policy:
            if bound is None or seq_len <= bound:
                return w
        return self.window_policy[-1][1]

    def with_window(self, window: int) -> HybridAttentionConfig:
        return dataclasses.replace(self, window=window, window_policy=None)

    @property
    def bounded(self) -> bool:
        """True when a decode-time KV cache of constant size can serve this pattern (full heads grow)."""
        return (not self.global_rows and (self.global_every == 0 or self.max_globals is not None)
                and not self.has_head_roles)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if d["window_policy"] is not None:
            d["window_policy"] = [list(p) for p in d["window_policy"]]
        if d["full_heads"] is not None:
            d["full_heads"] = {str(k): list(v) for k, v in d["full_heads"].items()}  # JSON object keys are strings
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HybridAttentionConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise HybridAttentionError(f"unknown hybrid attention keys {sorted(unknown)}; known: {sorted(known)}")
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)
