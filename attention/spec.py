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
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from attention.errors import HybridAttentionError

CONFIG_KEY = "hybrid_attention"


@dataclasses.dataclass
class HybridAttentionConfig:
    sink_tokens: int = 128
    window: int = 512
    global_every: int = 1024
    max_globals: int | None = None
    global_rows: bool = False
    window_policy: list[tuple[int | None, int]] | None = None

    def __post_init__(self) -> None:
        if self.sink_tokens < 0:
            raise HybridAttentionError(f"sink_tokens must be >= 0, got {self.sink_tokens}; use 0 to disable sinks")
        if self.window <= 0:
            raise HybridAttentionError(f"window must be > 0, got {self.window}; the window counts the token itself")
        if self.global_every < 0:
            raise HybridAttentionError(f"global_every must be >= 0, got {self.global_every}; use 0 to disable globals")
        if self.max_globals is not None and self.max_globals < 0:
            raise HybridAttentionError(f"max_globals must be >= 0 or None, got {self.max_globals}")
        if self.window_policy is not None:
            policy = [(None if b is None else int(b), int(w)) for b, w in self.window_policy]
            if not policy or any(w <= 0 for _, w in policy):
                raise HybridAttentionError("window_policy needs [[max_len, window], ...] with windows > 0")
            bounds = [b for b, _ in policy if b is not None]
            if bounds != sorted(bounds) or any(b is None for b, _ in policy[:-1]):
                raise HybridAttentionError("window_policy bounds must increase; only the last may be None (no limit)")
            self.window_policy = policy

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
        """True when a decode-time KV cache of constant size can serve this pattern."""
        return not self.global_rows and (self.global_every == 0 or self.max_globals is not None)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if d["window_policy"] is not None:
            d["window_policy"] = [list(p) for p in d["window_policy"]]
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
