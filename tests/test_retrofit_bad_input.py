"""recipes/retrofit.py's bad input: one line naming the fix, at parse time (before the run folder or a model)."""

from __future__ import annotations

import pytest

from core.config import ConfigError, parse_config
from recipes.retrofit import RetrofitConfig

TINY = ["--config", "recipes/configs/retrofit_tiny.yaml"]


def test_a_window_the_policy_never_serves_is_refused():
    """With a window_policy the policy picks the window at every length (training and serving): a window= outside
    it was accepted and silently unused (the default policy made window=... on the command line a no-op)."""
    with pytest.raises(ConfigError, match=r"window=32 is never used: window_policy sets the window at every length "
                                          r"\(\[8, 16\]\); set window to one of those, or window_policy=null") as err:
        parse_config(RetrofitConfig, [*TINY, "window=32", "window_policy=[[64, 8], [null, 16]]"])
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="window=1024 is never used"):
        parse_config(RetrofitConfig, ["window=1024"])  # the built-in default policy
    parse_config(RetrofitConfig, [*TINY, "window=8", "window_policy=[[64, 8], [null, 16]]"])
    parse_config(RetrofitConfig, [*TINY, "window=32", "window_policy=null"])
