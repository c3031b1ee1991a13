"""attention/spec.py: a hybrid spec read from a hand-edited config.json or command-line JSON is checked whole."""

from __future__ import annotations

import json

import numpy as np
import pytest

from attention import HybridAttentionConfig, HybridAttentionError


@pytest.mark.parametrize("key, value", [("window", 2.5), ("window", "4"), ("sink_tokens", 1.5),
                                        ("global_every", 2.5), ("max_globals", 3.0), ("window", True)])
def test_integer_fields_refuse_other_types_in_one_line(key, value):
    with pytest.raises(HybridAttentionError, match=f"{key} must be an integer, got {value!r}") as err:
        HybridAttentionConfig.from_dict({key: value})
    assert "\n" not in str(err.value)


def test_global_rows_must_be_a_bool():
    with pytest.raises(HybridAttentionError, match="global_rows must be true or false"):
        HybridAttentionConfig.from_dict({"global_rows": "yes"})


@pytest.mark.parametrize("policy, match", [
    ([[1024, 256], [1024, 512], [None, 1024]], r"strictly increase.*got \[1024, 1024, None\]"),  # never served
    ([[2048, 256], [1024, 512]], "strictly increase"),
    ([[None, 256], [1024, 512]], "only the last may be None"),
    ([[1024, 256.9]], "integers with windows > 0"),  # not truncated to 256
    ([[1024.5, 256]], "integers with windows > 0"),
    ([[1024, 0]], "integers with windows > 0"),
    ([[1024]], "integers with windows > 0"),
    ([], "integers with windows > 0"),
])
def test_window_policy_refuses_what_training_and_serving_would_read_differently(policy, match):
    with pytest.raises(HybridAttentionError, match=match):
        HybridAttentionConfig(window_policy=policy)


def test_integers_of_other_types_are_stored_as_python_ints_and_round_trip():
    spec = HybridAttentionConfig(sink_tokens=np.int64(4), window=np.int32(16), global_every=np.int64(32),
                                 max_globals=np.int64(2), window_policy=[[np.int64(64), np.int64(8)], [None, 16]])
    assert (spec.sink_tokens, spec.window, spec.global_every, spec.max_globals) == (4, 16, 32, 2)
    assert all(type(v) is int for v in (spec.sink_tokens, spec.window, spec.max_globals, *spec.window_policy[0]))
    assert spec.window_policy == [(64, 8), (None, 16)]
    assert HybridAttentionConfig.from_dict(json.loads(spec.to_json())) == spec
    assert spec.window_for(64) == 8 and spec.window_for(65) == 16


@pytest.mark.parametrize("roles", [
    {"full_layers": [1.5]},  # would be truncated to layer 1
    {"full_layers": [True]},  # a bool is not layer 1
    {"full_layers": "12"},  # a string is not the layers [1, 2]
    {"full_heads": {0: [1.7]}},
    {"full_heads": {0: [False]}},
    {"full_heads": {0: "01"}},  # not KV heads [0, 1]
    {"full_heads": {1.5: [0]}},
    {"full_heads": {True: [0]}},
    {"full_heads": {"1.0": [0]}},
])
def test_head_roles_refuse_what_is_not_an_index_list(roles):
    with pytest.raises(HybridAttentionError) as err:
        HybridAttentionConfig.from_dict(roles)
    assert "\n" not in str(err.value)


def test_head_roles_accept_json_keys_and_integers_of_other_types():
    spec = HybridAttentionConfig(full_heads={"3": [np.int64(1), 0], 5: (2,)}, full_layers=[np.int32(7), 2])
    assert spec.full_heads == {3: [0, 1], 5: [2]} and spec.full_layers == [2, 7]
    assert all(type(h) is int for hs in spec.full_heads.values() for h in hs) and type(spec.full_layers[0]) is int
    assert HybridAttentionConfig.from_dict(json.loads(spec.to_json())) == spec


@pytest.mark.parametrize("policy", [[[0, 8], [None, 16]], [[-4, 8], [None, 16]], [[0, 8]]])
def test_window_policy_refuses_bounds_no_input_can_reach(policy):
    # No input has fewer than 1 token: such an entry is never served, yet training would crop to it.
    with pytest.raises(HybridAttentionError, match="bounds") as err:
        HybridAttentionConfig(window_policy=policy)
    assert "\n" not in str(err.value)
    assert HybridAttentionConfig(window_policy=[[1, 8], [None, 16]]).window_for(1) == 8


@pytest.mark.parametrize("keys", [{"global_every": 0}, {"global_every": 8, "max_globals": 0}])
def test_global_rows_without_global_tokens_is_refused(keys):
    """Without global tokens there are no global rows: the flag changed no mask but made the spec unbounded, so
    the serving cache refused a model whose pattern it can serve ("needs the whole history")."""
    with pytest.raises(HybridAttentionError, match="global_rows=true has no global tokens.*set global_rows=false"):
        HybridAttentionConfig(global_rows=True, **keys)
    assert HybridAttentionConfig(global_rows=False, **keys).bounded
