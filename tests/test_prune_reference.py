"""distill.prune against naive references: models cut by hand, scores computed unit by unit, search termination."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from core.tiny import VOCAB, tiny_model
from distill.prune import (
    AXES,
    Arch,
    SearchSettings,
    arch_of,
    candidates,
    count_params,
    family_of,
    feasible_range,
    head_dim_of,
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


def test_the_shortlist_keeps_the_accepted_picks_of_an_even_spacing_and_moves_the_others():
    """The search ranks an even spread of the candidate list. Spread over the accepted shapes alone, every pick moved
    (the demo's search lost its winner); spread over the whole list, a refused pick moves to the nearest accepted
    shape and the accepted picks stay those of the list without the refusal."""
    from distill.prune import shortlist

    model = tiny_model("llama", layers=2, hidden=48, heads=6, kv_heads=3)
    base, fam = arch_of(model), family_of(model)
    assert fam.heads_divide_hidden
    every = candidates(base, fam, fam.counts(base)[0] // 2, AXES, accepted_only=False)
    ok = [fam.accepts(a.hidden, a.heads) for a in every]

    def spaced(n: int) -> list[int]:
        return [round(i * (len(every) - 1) / (n - 1)) for i in range(n)]

    # The case: an even spacing that lands on refused shapes, with more accepted shapes than it picks.
    n = next(n for n in range(3, sum(ok)) if not all(ok[i] for i in spaced(n)))
    refused = [i for i in spaced(n) if not ok[i]]
    got = [every.index(a) for a in shortlist(every, fam, n)]
    assert len(got) == n and got == sorted(set(got)) and all(ok[i] for i in got)
    assert [i for i in spaced(n) if ok[i]] == [i for i in got if i in spaced(n)]  # the accepted picks stay
    moved = [i for i in got if i not in spaced(n)]
    assert len(moved) == len(refused)
    for i in refused:  # each to a neighbour
        assert min(abs(j - i) for j in moved) <= len(every) // n
    few = [a for a, good in zip(every, ok) if good][: n - 1] + [a for a, good in zip(every, ok) if not good]
    assert shortlist(few, fam, n) == [a for a in few if fam.accepts(a.hidden, a.heads)]


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


def _cut_by_hand(model, rec: dict):
    """``model`` with the units ``rec`` drops removed by hand: layers deleted; dropped query heads' ``o_proj`` columns,
    neurons' ``down_proj`` columns and hidden channels zeroed. An RMSNorm over the kept ``h'`` of ``h`` channels is
    the full one with its weight scaled by ``sqrt(h'/h)`` and its eps by ``h'/h`` (the zeros add nothing to the sum)."""
    ref = copy.deepcopy(model)
    c = model.config
    hd, h, kept = head_dim_of(c), c.hidden_size, len(rec["kept_channels"])
    drop = [i for i in range(h) if i not in set(rec["kept_channels"])]
    ref.model.layers = torch.nn.ModuleList([ref.model.layers[i] for i in rec["kept_layers"]])
    ref.config.num_hidden_layers = len(rec["kept_layers"])
    if getattr(ref.config, "layer_types", None):
        ref.config.layer_types = [c.layer_types[i] for i in rec["kept_layers"]]
    norms = [ref.model.norm]
    with torch.no_grad():
        for j, layer in enumerate(ref.model.layers):
            layer.self_attn.layer_idx = j
            attn, mlp = layer.self_attn, layer.mlp
            for q in set(range(c.num_attention_heads)) - set(rec["kept_q_heads"][j]):
                attn.o_proj.weight[:, q * hd:(q + 1) * hd] = 0
            for n in set(range(c.intermediate_size)) - set(rec["kept_neurons"][j]):
                mlp.down_proj.weight[:, n] = 0
            for proj in (attn.o_proj, mlp.down_proj):  # what a layer writes to a dropped channel
                proj.weight[drop] = 0
                if proj.bias is not None:
                    proj.bias[drop] = 0
            norms += [layer.input_layernorm, layer.post_attention_layernorm]
        ref.model.embed_tokens.weight[:, drop] = 0
        for norm in norms:
            norm.weight[drop] = 0
            norm.weight.mul_(math.sqrt(kept / h))
            norm.variance_epsilon *= kept / h
    return ref


@pytest.mark.parametrize("arch,kw,shape", [
    ("llama", {}, Arch(2, 48, 1, 2, 100)),
    ("qwen2", {"tie_word_embeddings": True}, Arch(2, 40, 1, 1, 33)),  # q/k/v biases, tied head
    ("mistral", {"hidden": 60, "heads": 6, "kv_heads": 3}, Arch(2, 45, 2, 1, 51)),  # odd widths, head_dim 10
    ("llama", {"head_dim": 24, "attention_bias": True, "mlp_bias": True}, Arch(2, 40, 1, 2, 51)),  # head_dim ≠ h/heads
])
def test_a_student_cut_on_every_axis_is_the_teacher_cut_by_hand(arch, kw, shape):
    """Layers, KV groups, query heads, neurons and hidden channels cut at once: every slice (rows, columns, biases,
    norms, embeddings and head) against the teacher with those units removed by hand."""
    model = tiny_model(arch, layers=3, **kw)
    with torch.no_grad():  # biases start at zero: random ones, so a wrong slice of them shows
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    pruned = prune_to(model, importance(model, _blocks(), progress=False), shape)
    assert pruned.config.hidden_size == shape.hidden < model.config.hidden_size
    ref = _cut_by_hand(model, pruned.config.distill_pruning)
    ids = _blocks(2, seed=5)
    with torch.no_grad():
        torch.testing.assert_close(pruned(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch,kw", [("qwen2", {"hidden": 48, "heads": 6, "kv_heads": 2}), ("llama", {"head_dim": 24})])
def test_head_scores_are_the_mean_norm_of_each_heads_o_proj_output(arch, kw):
    """The documented head score, head by head: ``mean_t ‖o_proj.weight[:, head] · attn_out[t, head]‖`` over every
    token, laid out ``[layers, kv_heads, group]`` with query head ``q`` in KV group ``q // group``."""
    model = tiny_model(arch, layers=2, **kw)
    ids = _blocks(5)
    scores = importance(model, ids, batch_size=2, progress=False)  # uneven micro-batches on purpose
    c = model.config
    hd, heads, kv = head_dim_of(c), c.num_attention_heads, c.num_key_value_heads
    seen: list[torch.Tensor] = []  # [batch, seq, heads * head_dim] per layer: o_proj's input
    hooks = [layer.self_attn.o_proj.register_forward_pre_hook(lambda _m, a: seen.append(a[0]))
             for layer in model.model.layers]
    with torch.no_grad():
        model(input_ids=ids)
    for hook in hooks:
        hook.remove()
    for i, layer in enumerate(model.model.layers):
        w = layer.self_attn.o_proj.weight.detach()
        want = torch.tensor([[float((seen[i][..., q * hd:(q + 1) * hd] @ w[:, q * hd:(q + 1) * hd].t())
                                    .norm(dim=-1).mean()) for q in range(g * heads // kv, (g + 1) * heads // kv)]
                             for g in range(kv)])
        torch.testing.assert_close(scores.heads[i], want, rtol=1e-4, atol=1e-7)


def test_the_smallest_reachable_budget_has_a_candidate():
    """feasible_range's lower end is a shape the search may use: for a Llama with 4 heads and hidden widths in steps
    of 5, the narrowest width (10) takes no 4 heads, and the range named a budget no candidate reached."""
    model = tiny_model("llama", layers=2, hidden=40, heads=4, kv_heads=2)
    base, fam = arch_of(model), family_of(model)
    for axes in [("hidden",), ("hidden", "heads"), AXES]:
        lo, _ = feasible_range(base, fam, axes, False)
        assert candidates(base, fam, lo, axes), axes


def test_channel_scores_sum_the_mean_magnitude_of_every_norm_output():
    """The documented channel score: ``Σ_norms mean_t |norm(x)[t, c]|`` over both norms of every layer and the final
    norm, with uneven micro-batches."""
    model = tiny_model("qwen2", layers=3, tie_word_embeddings=True)
    ids = _blocks(5)
    scores = importance(model, ids, batch_size=2, progress=False)
    norms = [n for layer in model.model.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    outs: list[torch.Tensor] = []  # [batch, seq, hidden] per norm
    hooks = [n.register_forward_hook(lambda _m, _a, o: outs.append(o)) for n in [*norms, model.model.norm]]
    with torch.no_grad():
        model(input_ids=ids)
    for hook in hooks:
        hook.remove()
    assert len(outs) == 2 * 3 + 1
    torch.testing.assert_close(scores.channels, sum(o.abs().mean(dim=(0, 1)) for o in outs), rtol=1e-5, atol=1e-6)
