"""distill.prune against naive references: models cut by hand, scores computed unit by unit, search termination."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from core.tiny import VOCAB, tiny_model
from distill.prune import (
    AXES,
    SearchSettings,
    arch_of,
    candidates,
    count_params,
    family_of,
    importance,
    prune_to,
    save_pruned,
    search,
)


def _blocks(n: int = 4, seq: int = 24, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n, seq), generator=g)


def test_iterative_rounds_with_a_small_round_cut_always_shrink(monkeypatch):
    """max_round_cut below the tolerance puts the unpruned shape in a round's window; it (KL 0) won every round and
    the search never ended. Every intermediate round must cut something."""
    import distill.prune as prune

    teacher = tiny_model("llama", layers=4).requires_grad_(False)
    blocks = _blocks(6, 32)
    s = SearchSettings(target_ratio=0.9, top_k=1, finalists=2, max_candidates=4, search_steps=0, batch_size=2,
                       iterative=True, max_round_cut=0.05)
    sizes: list[tuple[int, int]] = []  # (a round's starting size, its winner's)
    real_round = prune.search_round

    def recording_round(model, *a, **k):
        assert len(sizes) < 12, f"no end to the rounds: {sizes}"
        out = real_round(model, *a, **k)
        sizes.append((count_params(model)[0], count_params(out[0])[0]))
        return out

    monkeypatch.setattr(prune, "search_round", recording_round)
    result = search(teacher, blocks[:4], blocks[4:], blocks[:4], s, log=lambda _msg: None)
    assert all(end < start for start, end in sizes[:-1]), sizes
    assert arch_of(result.model) != arch_of(teacher)
    assert abs(count_params(result.model)[0] - result.target) <= 0.03 * result.target


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_every_candidate_is_a_config_transformers_loads(arch, tmp_path):
    """LlamaConfig refuses a hidden size that is no multiple of the heads (head_dim given or not): such a winner failed
    to save after the whole search. Every candidate must build its config class; one with 3 of 6 heads and pruned
    channels saves and reloads with the same logits."""
    model = tiny_model(arch, layers=2, hidden=48, heads=6, kv_heads=3)
    base, fam = arch_of(model), family_of(model)
    found = candidates(base, fam, fam.counts(base)[0] // 2, AXES)
    for a in found:
        type(model.config)(hidden_size=a.hidden, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                           head_dim=fam.head_dim, intermediate_size=a.intermediate)
    if arch == "qwen2":  # no such rule: those shapes stay candidates
        assert any(a.hidden % a.heads for a in found)
    a = next(a for a in found if a.heads == 3 and a.hidden < base.hidden)
    pruned = prune_to(model, importance(model, _blocks(), progress=False), a)
    save_pruned(pruned, None, tmp_path / "out")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    ids = _blocks(2, seed=3)
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, pruned(input_ids=ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_bf16_teacher_cut_at_full_size_is_the_teacher(arch, tmp_path):
    """A bf16 teacher as from_pretrained loads it keeps its rotary inv_freq in fp32; the pruned and derived students
    cast it to bf16 too (model.to(dtype)), so at full size they differed from the teacher (and from themselves
    reloaded) by angles that grow with position."""
    from distill.student import derive_student

    tiny_model(arch, layers=2).save_pretrained(tmp_path / "teacher")
    teacher = AutoModelForCausalLM.from_pretrained(tmp_path / "teacher", dtype=torch.bfloat16).eval()
    ids = _blocks(2, 160)
    pruned = prune_to(teacher, importance(teacher, _blocks(), progress=False), arch_of(teacher))
    derived = derive_student(teacher, 2)
    with torch.no_grad():
        want = teacher(input_ids=ids).logits
        for student in (pruned, derived):
            assert next(student.parameters()).dtype == torch.bfloat16
            torch.testing.assert_close(student(input_ids=ids).logits, want, rtol=0, atol=0)
