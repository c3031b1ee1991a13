"""distill.prune on a teacher loaded with accelerate offload (``--offload``: ``device_map``), on tiny models.

Offloaded weights sit on the ``meta`` device outside their module's forward; scoring, cutting candidates and
the short distillation must read them through accelerate and give what the teacher in memory gives. On CPU
only disk offload leaves weights on ``meta`` (CPU offload with a CPU main device keeps them in place), so
these tests offload to disk.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import distill.prune as prune
from core.models import load_causal_lm
from core.tiny import VOCAB, save_tiny
from distill.prune import (
    Arch,
    count_params,
    identity_record,
    importance,
    prune_to,
    short_distill,
    student_from_record,
)
from tests.helpers import write_text_corpus

# Embeddings, half the layers, the final norm and the head on disk: every kind of weight prune reads is offloaded.
DISK_MAP = {"model.embed_tokens": "disk", "model.layers.0": "cpu", "model.layers.1": "disk", "model.layers.2": "disk",
            "model.norm": "disk", "model.rotary_emb": "cpu", "lm_head": "disk"}


def _blocks(n: int = 4, seq: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (n, seq), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def teachers(request, tmp_path_factory):
    """``(in memory, offloaded)``: the same saved tiny teacher loaded twice."""
    root = tmp_path_factory.mktemp("offload")
    path = save_tiny(root / "teacher", layers=3, tie_word_embeddings=request.param)
    plain = load_causal_lm(str(path)).eval().requires_grad_(False)
    offloaded = load_causal_lm(str(path), device_map=DISK_MAP, offload_folder=str(root / "offload"))
    offloaded.eval().requires_grad_(False)
    assert offloaded.model.layers[1].mlp.down_proj.weight.device.type == "meta"  # really offloaded
    assert offloaded.model.embed_tokens.weight.device.type == "meta"
    return plain, offloaded


@pytest.mark.parametrize("block_score", ["bi", "loss"])
def test_offloaded_importance_equals_in_memory(teachers, block_score):
    plain, offloaded = teachers
    ids = _blocks()
    want = importance(plain, ids, batch_size=2, progress=False, block_score=block_score)
    got = importance(offloaded, ids, batch_size=2, progress=False, block_score=block_score)
    for name in ("blocks", "heads", "neurons", "channels"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), msg=name)
    assert got.tokens == want.tokens


def test_candidates_cut_from_offloaded_teacher_equal_in_memory(teachers):
    plain, offloaded = teachers
    ids = _blocks()
    scores = importance(plain, ids, batch_size=2, progress=False)
    arch = Arch(layers=2, hidden=48, kv_heads=1, group=2, intermediate=96)  # every axis cut
    want, got = prune_to(plain, scores, arch), prune_to(offloaded, scores, arch)
    assert not any(p.device.type == "meta" for p in got.parameters())
    with torch.no_grad():
        torch.testing.assert_close(got(input_ids=ids).logits, want(input_ids=ids).logits, rtol=0, atol=0)
    record = copy.deepcopy(got.config.distill_pruning)
    again = student_from_record(offloaded, record)  # the resume path cuts from the teacher the same way
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=ids).logits, want(input_ids=ids).logits, rtol=0, atol=0)
    full = prune_to(offloaded, scores, prune.arch_of(plain))  # the full shape is the teacher itself
    with torch.no_grad():
        torch.testing.assert_close(full(input_ids=ids).logits, plain(input_ids=ids).logits)
    assert identity_record(offloaded)["kept_layers"] == [0, 1, 2]


def test_short_distill_from_offloaded_teacher_equals_in_memory(teachers):
    """The KD term reads the teacher head's weight: an offloaded head must not be read as ``meta`` garbage."""
    plain, offloaded = teachers
    ids = _blocks(seed=1)
    scores = importance(plain, ids, batch_size=2, progress=False)
    arch = Arch(layers=2, hidden=64, kv_heads=2, group=2, intermediate=64)
    students = [short_distill(prune_to(teacher, scores, arch), teacher, ids, 2, batch_size=2)
                for teacher in (plain, offloaded)]
    for (name, want), got in zip(students[0].state_dict().items(), students[1].state_dict().values(), strict=True):
        torch.testing.assert_close(got, want, msg=name)


def test_heldout_of_offloaded_teacher_equals_in_memory(teachers):
    """The search's held-out set runs the teacher once: its ids go where the embeddings run, not to ``meta``."""
    plain, offloaded = teachers
    ids = _blocks(seed=2)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[:, :5] = False
    want, got = prune.HeldOut(plain, ids, batch_size=2, mask=mask), prune.HeldOut(offloaded, ids, batch_size=2, mask=mask)
    torch.testing.assert_close(got.hidden, want.hidden)
    student = prune_to(plain, importance(plain, ids, batch_size=2, progress=False),
                       Arch(layers=2, hidden=64, kv_heads=2, group=2, intermediate=64))
    a, b = want.stats(student), got.stats(student)
    assert a.tokens == b.tokens and (a.nll_sum, a.kl_sum, a.agree) == pytest.approx((b.nll_sum, b.kl_sum, b.agree))


def test_cli_offload_writes_a_loadable_pruned_model(tmp_path, monkeypatch, capsys):
    path = save_tiny(tmp_path / "teacher", layers=3)
    write_text_corpus(tmp_path / "text.txt")
    loaded = []

    def small_memory_load(name, *args, **kwargs):
        # --offload's device_map="auto", with too little CPU memory for the whole teacher (a GPU too small for it)
        assert kwargs.get("device_map") == "auto"
        model = load_causal_lm(name, *args, max_memory={"cpu": 450_000}, offload_folder=str(tmp_path / "offload"),
                               **kwargs)
        loaded.append(model)
        return model

    monkeypatch.setattr(prune, "load_causal_lm", small_memory_load)
    out = tmp_path / "pruned"
    code = prune.main(["--model", str(path), "--out", str(out), "--offload", "--target-ratio", "0.5",
                       "--axes", "depth,mlp", "--dataset", str(tmp_path / "text.txt"), "--seq-len", "32",
                       "--calib-blocks", "4", "--eval-blocks", "2", "--reported-blocks", "2", "--search-steps", "1",
                       "--top-k", "1",
                       "--finalists", "2", "--batch-size", "2"])
    stdout = capsys.readouterr().out
    assert code == 0, stdout
    assert "disk" in loaded[0].hf_device_map.values()  # the teacher really was offloaded
    summary = json.loads(stdout.strip().splitlines()[-1])
    model = AutoModelForCausalLM.from_pretrained(out)
    assert count_params(model)[0] == summary["winner"]["params_non_embedding"]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=_blocks(1)).logits).all()
