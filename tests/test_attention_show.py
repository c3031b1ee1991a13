"""``python -m attention.show`` draws the pattern and fails in one line on a bad spec."""

from __future__ import annotations

import torch

from attention import HybridAttentionConfig
from attention.masks import hybrid_mask
from attention.show import block_density, kept_fraction, main


def test_block_density_matches_dense_mask():
    spec = HybridAttentionConfig(sink_tokens=3, window=5, global_every=7)
    dense = hybrid_mask(50, spec).float()
    dens = block_density(50, spec, block=8)
    padded = torch.nn.functional.pad(dense, (0, 6, 0, 6))
    assert torch.allclose(dens, padded.view(7, 8, 7, 8).mean((1, 3)))
    assert abs(kept_fraction(50, spec) - dense.sum().item() / (50 * 51 / 2)) < 1e-9


def test_cli_writes_png_and_rejects_bad_spec(tmp_path, capsys):
    out = tmp_path / "mask.png"
    assert main(["--seq", "300", "--sink", "8", "--window", "32", "--global-every", "64", "--out", str(out)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"
    assert main(["--seq", "300", "--window", "0", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: window") and "\n" not in err


def test_cli_window_flag_wins_over_a_saved_window_policy(tmp_path, monkeypatch):
    # The default retrofit saves a window_policy; --window must draw that window, not the policy's.
    import json

    import attention.show as show

    model = tmp_path / "model"
    model.mkdir()
    spec = HybridAttentionConfig(sink_tokens=4, window=512, global_every=64, window_policy=[[128, 8], [None, 32]])
    (model / "config.json").write_text(json.dumps({"hybrid_attention": spec.to_dict()}))
    drawn = []
    monkeypatch.setattr(show, "draw", lambda seq, s, out, block=None: drawn.append(s.window_for(seq)) or out)
    assert main(["--model", str(model), "--seq", "300", "--window", "16", "--out", str(tmp_path / "a.png")]) == 0
    assert main(["--model", str(model), "--seq", "300", "--out", str(tmp_path / "b.png")]) == 0
    assert drawn == [16, 32]
