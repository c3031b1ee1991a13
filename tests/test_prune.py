"""distill.prune: importance scores, pruned models, budgets and the search, on tiny models built in code."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

from core.tiny import VOCAB, save_tiny, tiny_model
from distill.model import DistillModel, LossConfig
from distill.prune import (
    AXES,
    Arch,
    PruneError,
    SearchSettings,
    arch_of,
    block_loss_increase,
    candidates,
    count_params,
    family_of,
    importance,
    main,
    parse_axes,
    prune_to,
    resolve_target,
    resumed_student,
    save_pruned,
    search,
    select,
    student_from_record,
)
from distill.student import kept_channels, kept_layers
from tests.helpers import write_text_corpus


def _blocks(n: int = 4, seq: int = 24, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n, seq), generator=g)


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("arch,kw", [("llama", {}), ("mistral", {}), ("qwen2", {}),
                                     ("llama", {"tie_word_embeddings": True})])
def test_full_size_is_identity(arch, kw):
    model = tiny_model(arch, layers=3, **kw)
    scores = importance(model, _blocks(), progress=False)
    pruned = prune_to(model, scores, arch_of(model))
    ids = _blocks(2, seed=1)
    torch.testing.assert_close(_logits(pruned, ids), _logits(model, ids), rtol=0, atol=1e-5)
    assert count_params(pruned) == count_params(model)
    if arch == "qwen2":  # q/k/v biases survive
        assert pruned.model.layers[0].self_attn.q_proj.bias is not None


def test_family_counts_match_real_models():
    for arch, kw in [("llama", {}), ("qwen2", {}), ("llama", {"tie_word_embeddings": True})]:
        model = tiny_model(arch, layers=2, **kw)
        assert family_of(model).counts(arch_of(model)) == count_params(model)
        a = Arch(layers=1, hidden=48, kv_heads=1, group=1, intermediate=40)
        pruned = prune_to(model, importance(model, _blocks(), progress=False), a)
        assert family_of(model).counts(a) == count_params(pruned)


def _dead_model():
    """4 layers; a dead block (2), a dead head (layer 0, head 3), a dead neuron (layer 1, 5), a dead channel (7)."""
    model = tiny_model("llama", layers=4)
    hd = model.config.head_dim
    with torch.no_grad():
        block = model.model.layers[2]
        block.self_attn.o_proj.weight.zero_()
        block.mlp.down_proj.weight.zero_()  # the block adds nothing: x_out == x_in
        model.model.layers[0].self_attn.o_proj.weight[:, 3 * hd:4 * hd] = 0
        model.model.layers[1].mlp.down_proj.weight[:, 5] = 0
        for layer in model.model.layers:
            layer.input_layernorm.weight[7] = 0
            layer.post_attention_layernorm.weight[7] = 0
        model.model.norm.weight[7] = 0
    return model


def test_dead_units_rank_last():
    model = _dead_model()
    scores = importance(model, _blocks(), progress=False)
    assert int(scores.blocks.argmin()) == 2 and float(scores.blocks[2]) < 1e-6
    heads = scores.heads.reshape(4, -1)
    assert int(heads[0].argmin()) == 3 and float(heads[0, 3]) == 0
    assert int(scores.neurons[1].argmin()) == 5 and float(scores.neurons[1, 5]) == 0
    assert int(scores.channels.argmin()) == 7 and float(scores.channels[7]) == 0
    # ...and is the first thing a one-smaller architecture drops.
    sel = select(scores, Arch(layers=3, hidden=63, kv_heads=2, group=2, intermediate=127))
    assert 2 not in sel.layers and 7 not in sel.channels
    assert sel.layers == [0, 1, 3]
    sel = select(scores, Arch(layers=4, hidden=64, kv_heads=2, group=1, intermediate=127))
    assert 3 not in sel.q_heads[0] and 5 not in sel.neurons[1]


def test_block_influence_matches_naive_reference():
    model = tiny_model("llama", layers=3)
    ids = _blocks()
    scores = importance(model, ids, batch_size=3, progress=False)
    captured = []
    hooks = [layer.register_forward_hook(lambda _m, a, o: captured.append((a[0], o[0] if isinstance(o, tuple) else o)))
             for layer in model.model.layers]
    with torch.no_grad():
        model(input_ids=ids)
    for h in hooks:
        h.remove()
    naive = torch.stack([(1 - F.cosine_similarity(x.double(), y.double(), dim=-1)).mean() for x, y in captured])
    torch.testing.assert_close(scores.blocks.double(), naive, rtol=1e-4, atol=1e-6)
    # Neuron importance: mean |act(gate)·up| times the down column norm, computed by hand for layer 0.
    mlp = model.model.layers[0].mlp
    xs = []
    h = mlp.register_forward_pre_hook(lambda _m, a: xs.append(a[0]))
    with torch.no_grad():
        model(input_ids=ids)
    h.remove()
    x = xs[0]
    act = mlp.act_fn(x @ mlp.gate_proj.weight.t()) * (x @ mlp.up_proj.weight.t())
    ref = act.abs().mean(dim=(0, 1)) * mlp.down_proj.weight.norm(dim=0)
    torch.testing.assert_close(scores.neurons[0], ref, rtol=1e-4, atol=1e-6)


def _trained_with_dead_block():
    """4 layers trained briefly on periodic text (so skipping a live block costs loss), then block 2 killed."""
    model = tiny_model("llama", layers=4)
    ids = torch.randint(3, VOCAB, (8, 6), generator=torch.Generator().manual_seed(0)).repeat(1, 4)  # [8, 24]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(40):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    with torch.no_grad():
        model.model.layers[2].self_attn.o_proj.weight.zero_()
        model.model.layers[2].mlp.down_proj.weight.zero_()  # x_out == x_in: skipping it changes nothing
    return model, ids


def test_loss_increase_ranks_a_dead_block_last():
    model, ids = _trained_with_dead_block()
    scores = importance(model, ids, batch_size=3, progress=False, block_score="loss")
    assert abs(float(scores.blocks[2])) < 1e-6
    assert all(float(scores.blocks[i]) > 1e-2 for i in (0, 1, 3)), scores.blocks  # live blocks cost loss
    assert select(scores, Arch(layers=3, hidden=64, kv_heads=2, group=2, intermediate=128)).layers == [0, 1, 3]
    # The other scores do not depend on how blocks are scored.
    bi = importance(model, ids, batch_size=3, progress=False)
    torch.testing.assert_close(scores.neurons, bi.neurons)
    with pytest.raises(PruneError, match="block_score must be one of bi, loss"):
        importance(model, ids, progress=False, block_score="cos")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_loss_increase_matches_deleting_the_layer(arch):
    import copy

    model = tiny_model(arch, layers=3)
    ids = _blocks(5)
    got = block_loss_increase(model, ids, batch_size=2, progress=False)  # uneven micro-batches on purpose
    with torch.no_grad():
        full = model(input_ids=ids, labels=ids, use_cache=False).loss.double()
        for i in range(3):  # naive reference: a copy with layer i removed from the module list
            cut = copy.deepcopy(model)
            del cut.model.layers[i]
            cut.config.num_hidden_layers = 2
            if getattr(cut.config, "layer_types", None):
                cut.config.layer_types = [t for j, t in enumerate(cut.config.layer_types) if j != i]
            want = cut(input_ids=ids, labels=ids, use_cache=False).loss.double() - full
            torch.testing.assert_close(got[i].double(), want, rtol=1e-4, atol=1e-5)
            assert abs(float(want)) > 1e-4  # the reference sees a real change, so the comparison can fail


def test_search_records_the_block_score():
    teacher = tiny_model("llama", layers=3)
    s = SearchSettings(target_ratio=0.5, axes=("depth", "mlp"), search_steps=0, top_k=1, finalists=2,
                       batch_size=2, block_score="loss")
    result = search(teacher, _blocks(), _blocks(2, seed=1), _blocks(), s, log=lambda _m: None)
    assert "loss increase" in result.model.config.distill_pruning["rounds"][0]["method"]


@pytest.mark.parametrize("kv,group", [(1, 2), (2, 1), (1, 1)])
def test_gqa_structure_preserved(kv, group):
    model = tiny_model("qwen2", layers=2, heads=4, kv_heads=2)
    scores = importance(model, _blocks(), progress=False)
    pruned = prune_to(model, scores, Arch(layers=2, hidden=64, kv_heads=kv, group=group,
                                         intermediate=model.config.intermediate_size))
    c = pruned.config
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (kv * group, kv, 16)
    record = c.distill_pruning
    for kvs, qs in zip(record["kept_kv_heads"], record["kept_q_heads"]):
        assert len(kvs) == kv and len(qs) == kv * group
        # every kept query head belongs to a kept KV group, and each group keeps the same count
        assert sorted(q // 2 for q in qs) == sorted(g for g in kvs for _ in range(group))
    hd = 16
    for j, layer in enumerate(pruned.model.layers):
        src = model.model.layers[j].self_attn
        rows = torch.tensor([q * hd + d for q in record["kept_q_heads"][j] for d in range(hd)])
        torch.testing.assert_close(layer.self_attn.q_proj.bias, src.q_proj.bias[rows])
    # Naive reference: the teacher with every dropped query head's o_proj input columns zeroed (a dropped KV
    # group is the drop of all its query heads). With every layer, channel and neuron kept it is exact, so a
    # query head wired to another KV head, or k/v/o sliced wrongly, shows in the logits.
    assert record["kept_layers"] == [0, 1] and len(record["kept_channels"]) == model.config.hidden_size
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for j, layer in enumerate(ref.model.layers):
            for q in set(range(model.config.num_attention_heads)) - set(record["kept_q_heads"][j]):
                layer.self_attn.o_proj.weight[:, q * hd:(q + 1) * hd] = 0
    ids = _blocks(2, seed=5)
    torch.testing.assert_close(_logits(pruned, ids), _logits(ref, ids), rtol=1e-4, atol=1e-5)


def test_composed_record_points_at_teacher_weights():
    """Pruning a pruned model (the iterative path) keeps the record in the teacher's numbering."""
    teacher = tiny_model("llama", layers=4)
    once = prune_to(teacher, importance(teacher, _blocks(), progress=False), Arch(3, 56, 2, 2, 100))
    twice = prune_to(once, importance(once, _blocks(seed=2), progress=False), Arch(2, 48, 1, 2, 64))
    rec = twice.config.distill_pruning
    assert len(rec["rounds"]) == 2 and kept_layers(twice) == rec["kept_layers"]
    ch = torch.tensor(rec["kept_channels"])
    for j, layer in enumerate(twice.model.layers):
        src = teacher.model.layers[rec["kept_layers"][j]]
        n = torch.tensor(rec["kept_neurons"][j])
        torch.testing.assert_close(layer.mlp.down_proj.weight, src.mlp.down_proj.weight[ch][:, n])
        torch.testing.assert_close(layer.input_layernorm.weight, src.input_layernorm.weight[ch])
    torch.testing.assert_close(twice.model.embed_tokens.weight, teacher.model.embed_tokens.weight[:, ch])


def test_candidates_lie_within_budget_and_respect_axes():
    model = tiny_model("llama", layers=4)
    base, fam = arch_of(model), family_of(model)
    target = fam.counts(base)[0] // 2
    for axes in [AXES, ("depth",), ("mlp",), ("depth", "mlp"), ("hidden", "heads", "mlp")]:
        found = candidates(base, fam, target, axes)
        assert found, axes
        for a in found:
            assert abs(fam.counts(a)[0] - target) <= 0.03 * target
            if "depth" not in axes:
                assert a.layers == base.layers
            if "hidden" not in axes:
                assert a.hidden == base.hidden
            if "heads" not in axes:
                assert (a.kv_heads, a.group) == (base.kv_heads, base.group)
            if "mlp" not in axes:
                assert a.intermediate == base.intermediate


def test_bad_budgets_name_the_feasible_range():
    model = tiny_model("llama", layers=4)
    full = family_of(model).counts(arch_of(model))[0]
    with pytest.raises(PruneError, match=r"choose [\d,]+\.\.[\d,]+"):
        resolve_target(model, full * 2, None, AXES, False)
    with pytest.raises(PruneError, match=r"choose [\d,]+\.\.[\d,]+"):
        resolve_target(model, 10, None, ("depth",), False)
    with pytest.raises(PruneError, match="exactly one"):
        resolve_target(model, 10, 0.5, AXES, False)
    with pytest.raises(PruneError, match="unknown prune axes"):
        parse_axes("depth,width")


def test_unsupported_architecture_lists_supported():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(PruneError, match="llama, mistral, qwen2"):
        importance(gpt2, _blocks(), progress=False)


def test_cli_bad_budget_is_one_line(tmp_path, capsys):
    path = save_tiny(tmp_path / "teacher", layers=2)
    capsys.readouterr()  # saving prints progress bars
    code = main(["--model", str(path), "--out", str(tmp_path / "out"), "--target-ratio", "1.5"])
    err = capsys.readouterr().err.strip()
    last = err.splitlines()[-1]  # earlier lines are transformers' loading bars
    assert code == 2 and last.startswith("error: ") and "choose" in last and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_search_output_loads_within_budget_and_stays_tied(tmp_path):
    teacher = tiny_model("llama", layers=4, tie_word_embeddings=True).requires_grad_(False)
    blocks = _blocks(8, 32)
    s = SearchSettings(target_ratio=0.5, top_k=2, finalists=3, search_steps=2, batch_size=2,
                       calibration={"dataset": "random ids", "blocks": 8})
    result = search(teacher, blocks[:4], blocks[4:], blocks[:4], s, log=lambda _msg: None)  # train: not held-out
    target = result.target
    assert result.winner in result.table and len(result.table) >= 3
    assert all(abs(c.params - target) <= 0.03 * target for c in result.table)
    distilled = [c for c in result.table if c.kl_distilled == c.kl_distilled]  # not NaN
    assert len(distilled) == 2 and result.winner.kl_distilled == min(c.kl_distilled for c in distilled)
    save_pruned(result.model, None, tmp_path / "student", extra=result.to_json())
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "student")
    non_emb, _ = count_params(loaded)
    assert abs(non_emb - target) <= 0.03 * target
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    rec = loaded.config.distill_pruning
    assert kept_layers(loaded) == rec["kept_layers"] and rec["rounds"][0]["calibration"]["blocks"] == 8
    ids = _blocks(2, seed=3)
    torch.testing.assert_close(_logits(loaded, ids), _logits(result.model, ids))
    with pytest.raises(PruneError, match="not empty"):
        save_pruned(result.model, None, tmp_path / "student")


def test_overwrite_replaces_only_a_folder_prune_wrote(tmp_path):
    model = tiny_model("llama", layers=2)
    ours = tmp_path / "pruned"
    save_pruned(model, None, ours, extra={"winner": "a"})
    save_pruned(model, None, ours, overwrite=True, extra={"winner": "b"})  # our own output: replaced
    assert json.loads((ours / "search.json").read_text()) == {"winner": "b"}
    user = tmp_path / "my-model"  # e.g. the teacher's own folder: a model, but not ours
    model.save_pretrained(user)
    (user / "notes.txt").write_text("keep me")
    with pytest.raises(PruneError, match="did not write.*choose another --out"):
        save_pruned(model, None, user, overwrite=True, extra={"winner": "c"})
    assert (user / "notes.txt").read_text() == "keep me" and (user / "config.json").is_file()
    assert not (user / "search.json").exists()


@pytest.mark.parametrize("tied", [False, True])
def test_a_saved_record_cuts_the_same_student_again(tied):
    """A resume rebuilds the searched student from its saved record alone (one round or composed): the same
    config, shape and kept weights; a record of another teacher is refused."""
    teacher = tiny_model("llama", layers=4, tie_word_embeddings=tied)
    once = prune_to(teacher, importance(teacher, _blocks(), progress=False), Arch(3, 56, 2, 2, 100))
    twice = prune_to(once, importance(once, _blocks(seed=2), progress=False), Arch(2, 48, 1, 2, 64))
    ids = _blocks(2, seed=1)
    for pruned in (once, twice):
        record = json.loads(json.dumps(pruned.config.distill_pruning))  # as read back from config.json
        again = student_from_record(teacher, record)
        assert again.config.to_dict() == pruned.config.to_dict()
        want = pruned.state_dict()
        assert again.state_dict().keys() == want.keys()
        for k, v in again.state_dict().items():
            torch.testing.assert_close(v, want[k], rtol=0, atol=0)
        torch.testing.assert_close(_logits(again, ids), _logits(pruned, ids), rtol=0, atol=0)
    with pytest.raises(PruneError, match="resume with the teacher the run started with"):
        student_from_record(tiny_model("llama", layers=3), record)


def test_resume_reads_the_searched_student_back(tmp_path):
    """``resumed_student``: the saved student when ``output_dir/pruned`` holds the checkpoint's record, else the
    record cut from the teacher; a checkpoint without a record (an older run) searches again, with a warning."""
    from types import SimpleNamespace

    out = tmp_path / "run"
    step = out / "checkpoints" / "step-2"
    (step / "student").mkdir(parents=True)
    (step / "COMPLETE").write_text("")
    (step / "trainer_state.json").write_text("{}")
    cfg = SimpleNamespace(resume="latest", output_dir=str(out))
    teacher = tiny_model("llama", layers=4)
    logged: list[str] = []
    teacher.config.save_pretrained(step / "student")  # no pruning record
    assert resumed_student(teacher, cfg, logged.append) is None
    assert len(logged) == 1 and logged[0].startswith("warning:") and "searching the student again" in logged[0]

    searched = prune_to(teacher, importance(teacher, _blocks(), progress=False), Arch(3, 56, 2, 2, 100))
    with torch.no_grad():  # as the search's short distillation leaves it: not a plain cut of the teacher
        for p in searched.parameters():
            p.add_(0.01)
    searched.config.save_pretrained(step / "student")
    cut = resumed_student(teacher, cfg, logged.append)  # no pruned/ (a run from before it was saved)
    assert cut.config.distill_pruning == searched.config.distill_pruning and kept_layers(cut) == kept_layers(searched)
    assert count_params(cut) == count_params(searched) and len(logged) == 1
    save_pruned(searched, None, out / "pruned")
    back = resumed_student(teacher, cfg, logged.append)
    for k, v in searched.state_dict().items():
        torch.testing.assert_close(back.state_dict()[k], v, rtol=0, atol=0)
    assert len(logged) == 1


def test_iterative_rounds_cut_at_most_the_round_limit(monkeypatch):
    import distill.prune as prune

    teacher = tiny_model("llama", layers=4).requires_grad_(False)
    blocks = _blocks(6, 32)
    s = SearchSettings(target_ratio=0.4, top_k=1, finalists=2, search_steps=1, batch_size=2, iterative=True,
                       max_round_cut=0.3)
    weighed = []  # (the round's starting size, every candidate it weighed)
    real_round = prune.search_round

    def recording_round(model, *a, **k):
        out = real_round(model, *a, **k)
        weighed.append((count_params(model)[0], [c.params for c in out[2]]))
        return out

    monkeypatch.setattr(prune, "search_round", recording_round)
    result = search(teacher, blocks[:4], blocks[4:], blocks[:4], s, log=lambda _msg: None)  # train: not held-out
    assert result.rounds >= 3  # 0.7³ = 0.343 < 0.4 < 0.7² = 0.49
    assert len(result.model.config.distill_pruning["rounds"]) == result.rounds
    assert abs(count_params(result.model)[0] - result.target) <= 0.03 * result.target
    assert len(weighed) == result.rounds
    for start, sizes in weighed[:-1]:  # every candidate of an intermediate round, not only its winner
        assert min(sizes) >= start * (1 - 0.3), (start, min(sizes))


def test_hidden_pruned_student_distills_with_projectors():
    teacher = tiny_model("llama", layers=3).requires_grad_(False)
    scores = importance(teacher, _blocks(), progress=False)
    student = prune_to(teacher, scores, Arch(layers=2, hidden=48, kv_heads=2, group=2, intermediate=96))
    student.train()
    assert kept_channels(student) is not None and len(kept_channels(student)) == 48
    cfg = LossConfig(kd_weight=1.0, kd_kind="forward_kl", temperature=2.0, beta=0.5, kd_chunk_size=1024, ce_weight=1.0,
                     focal_weight=0.0, focal_alpha=0.25, focal_gamma=2.0, hidden_weight=1.0, hidden_layers=["derived"],
                     hidden_kind="nmse", attn_weight=0.0, attn_layers=[], attn_num_queries=64)
    model = DistillModel(student, teacher, cfg)
    assert model.hidden_pairs and all(p.in_features == 48 and p.out_features == 64 for p in model.projectors.values())
    # The projector starts as the channel scatter: kept channels back in their teacher places.
    proj = next(iter(model.projectors.values()))
    x = torch.randn(5, 48)
    expected = torch.zeros(5, 64)
    expected[:, kept_channels(student)] = x
    torch.testing.assert_close(proj(x), expected)
    out = model(input_ids=_blocks(2))
    assert torch.isfinite(out.loss) and out.hidden > 0
    out.loss.backward()
    assert proj.weight.grad is not None and student.model.embed_tokens.weight.grad.abs().sum() > 0


@pytest.mark.slow
def test_recipe_student_init_prune(tmp_path):
    """``student_init=prune`` through the real recipe CLI; the CE-only ablation reuses the same student."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "run"
    args = ["--config", "recipes/configs/tiny.yaml", f"output_dir={out}", "student_init=prune", "target_ratio=0.5",
            "prune_search_steps=1", "prune_top_k=1", "prune_calib_blocks=4", "prune_eval_blocks=2", "max_steps=2",
            "eval_every=0", "save_every=0", "attn_weight=0", "compare_ce_only=true"]
    proc = subprocess.run([sys.executable, "recipes/distill.py", *args], cwd=root, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("calibrated on") == 1  # searched once, reused by the ablation
    student = AutoModelForCausalLM.from_pretrained(out / "final")
    assert student.config.distill_pruning["kept_layers"] == kept_layers(student)
    full = family_of(tiny_model("llama", layers=4, hidden=64, vocab=512)).counts(Arch(4, 64, 2, 2, 128))[0]
    assert abs(count_params(student)[0] - full / 2) <= 0.03 * full / 2
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ce_only_ppl_final"] is not None
    bad = subprocess.run([sys.executable, "recipes/distill.py", "--config", "recipes/configs/tiny.yaml",
                          f"output_dir={tmp_path / 'bad'}", "student_init=prune", "target_ratio=0.5",
                          "target_params=1000"], cwd=root, capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "give one budget: target_params= or target_ratio=, not both" in bad.stderr


def test_plan_prints_calibration_memory(capsys):
    from distill import plan

    shape = plan.ModelShape(num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2,
                            vocab_size=320)
    fp32 = plan.calibration_bytes(shape, 2, 16, mixed_precision=False)
    bf16 = plan.calibration_bytes(shape, 2, 16, mixed_precision=True)
    assert fp32["weights"] == 4 * shape.num_params == 2 * bf16["weights"]
    # one layer's activations for 32 tokens: weight-dtype tensors + the hooks' fp32 copies
    assert fp32["activations"] == 4 * 32 * (4 * 64 + 2 * 32 + 3 * 128) + 4 * 32 * (3 * 64 + 128)
    assert fp32["offload_gpu"] < fp32["resident"]
    assert plan.main(["--config", "recipes/configs/deepseek_17b_to_7b.yaml"]) == 0
    out = capsys.readouterr().out
    assert "calibration (python -m distill.prune" in out and '"calibration_gib"' in out.splitlines()[-1]


def test_cli_writes_a_loadable_pruned_model(tmp_path, capsys):
    import json

    path = save_tiny(tmp_path / "teacher", layers=3)
    write_text_corpus(tmp_path / "text.txt")
    out = tmp_path / "pruned"
    code = main(["--model", str(path), "--out", str(out), "--target-ratio", "0.5", "--axes", "depth,mlp",
                 "--dataset", str(tmp_path / "text.txt"), "--seq-len", "32", "--calib-blocks", "4",
                 "--eval-blocks", "2", "--reported-blocks", "2", "--search-steps", "1", "--top-k", "1", "--finalists", "2",
                 "--batch-size", "2"])
    stdout = capsys.readouterr().out
    assert code == 0, stdout
    summary = json.loads(stdout.strip().splitlines()[-1])
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.hidden_size == 64 and model.config.num_attention_heads == 4  # axes respected
    assert count_params(model)[0] == summary["winner"]["params_non_embedding"]
    assert abs(summary["winner"]["params_non_embedding"] - summary["target"]) <= 0.03 * summary["target"]
    def no_nan(name: str):
        raise AssertionError(f"search.json holds {name}, which is not JSON")

    table = json.loads((out / "search.json").read_text(), parse_constant=no_nan)["candidates"]
    assert len(table) >= 2 and (out / "tokenizer.json").is_file()
    # Stages a candidate did not reach are null: here one finalist of the candidates is short-distilled.
    assert sum(r["kl_distilled"] is not None for r in table) == 1 and any(r["kl_distilled"] is None for r in table)
    assert (out / "search.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert model.config.distill_pruning["rounds"][0]["calibration"]["dataset"] == str(tmp_path / "text.txt")


def test_cli_ranks_past_the_heldout_blocks_a_recipe_run_reports(tmp_path, monkeypatch):
    """By default the CLI keeps the recipe's 16 reported held-out blocks out of the ranking; 0 ranks on the first."""
    import distill.prune as prune

    path = save_tiny(tmp_path / "teacher", layers=2)
    write_text_corpus(tmp_path / "text.txt", lines=1200)
    real, seen = prune.calibration_data, {}

    def spy(*args, **kwargs):
        calib, held, train = real(*args, **kwargs)
        seen[kwargs["reported_blocks"]] = held
        raise PruneError("stop")

    monkeypatch.setattr(prune, "calibration_data", spy)
    argv = ["--model", str(path), "--target-ratio", "0.5", "--dataset", str(tmp_path / "text.txt"), "--seq-len", "32",
            "--eval-blocks", "2"]
    assert main([*argv, "--out", str(tmp_path / "a")]) == 2 and main([*argv, "--out", str(tmp_path / "b"),
                                                                      "--reported-blocks", "0"]) == 2
    from distill.data import build_data
    every = build_data(prune.load_tokenizer(str(path)), dataset=str(tmp_path / "text.txt"), seq_len=32,
                       eval_blocks=18, progress=False).eval
    assert torch.equal(seen[16], every[16:18]) and torch.equal(seen[0], every[:2])
    assert main([*argv, "--out", str(tmp_path / "c"), "--reported-blocks", "-1"]) == 2


def test_cli_refuses_too_little_heldout_text_before_the_teacher_loads(tmp_path, monkeypatch, capsys):
    """Too few held-out blocks for the reported ones and the ranking ones is one line, and the teacher's weights
    (minutes at the target scale) are never read for it."""
    import distill.prune as prune
    from tests.helpers import forbid

    path = save_tiny(tmp_path / "teacher", layers=2)
    write_text_corpus(tmp_path / "text.txt", lines=40)
    forbid(monkeypatch, "the teacher loaded before the data was checked", (prune, "load_causal_lm"))
    capsys.readouterr()
    code = main(["--model", str(path), "--target-ratio", "0.5", "--dataset", str(tmp_path / "text.txt"),
                 "--seq-len", "32", "--eval-blocks", "8", "--out", str(tmp_path / "out")])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and last.startswith("error: the held-out text has") and "prune_eval_blocks" in last
    assert not (tmp_path / "out").exists()

def test_recipe_prune_calibrates_on_the_datasets_mixture_and_refuses_a_stream(tmp_path, monkeypatch):
    import dataclasses

    from core.tiny import tiny_tokenizer
    from distill import prune
    from distill.config import DistillConfig
    from distill.data import build_data

    class Searched(Exception):
        pass

    def fake_search(teacher, calib, held, train, s, log, **_masks):  # what the search was given; no search run
        raise Searched(calib, held, s.calibration)

    monkeypatch.setattr(prune, "search", fake_search)
    tok = tiny_tokenizer()
    text = tmp_path / "a.jsonl"
    text.write_text("\n".join(json.dumps({"text": f"the fox {i} jumps over the lazy dog " * 3}) for i in range(60)))
    cfg = DistillConfig(datasets=[str(text)], seq_len=16, prune_calib_blocks=4, prune_eval_blocks=2, eval_blocks=1,
                        data_cache=str(tmp_path / "c"))  # `dataset` stays the built-in corpus
    with pytest.raises(Searched) as got:
        prune.prune_for_recipe(tiny_model("llama", layers=2), tok, cfg, log=lambda _msg: None)
    calib, held, record = got.value.args
    # ranked on the held-out blocks after the one the run reports
    want = build_data(tok, **cfg.data_args(), seq_len=16, eval_blocks=3, progress=False)
    assert torch.equal(calib, want.train[:4]) and torch.equal(held, want.eval[1:]) and record["dataset"] == str(text)
    with pytest.raises(PruneError, match="streamed source.*set streaming=false"):
        prune.prune_for_recipe(tiny_model("llama", layers=2), tok, dataclasses.replace(cfg, streaming=True))


def test_recipe_config_checks_prune_fields():
    from core.config import ConfigError
    from distill.config import DistillConfig

    assert DistillConfig(student_init="prune", target_ratio=0.3).prune_axes == "depth,mlp,heads,hidden"
    assert DistillConfig().student_init == "prune" and DistillConfig(student="x").student == "x"  # student= wins
    for kw, msg in [({"student_init": "prune", "target_ratio": 0.3, "target_params": 1e6}, "give one budget"),
                    ({"student_init": "prune", "target_ratio": 1.5}, "target_ratio must be in"),
                    ({"student_init": "cut"}, "student_init must be one of prune, keep_layers")]:
        with pytest.raises(ConfigError, match=msg):
            DistillConfig(**kw)


def test_cli_dtype_auto_is_fp32_on_cpu_and_bf16_on_cuda(tmp_path, monkeypatch, capsys):
    import distill.prune as prune

    seen = []

    def load(name, dtype, **kw):  # stop before any model is built: only the resolution is under test
        seen.append(dtype)
        raise PruneError("stop")

    monkeypatch.setattr(prune, "load_causal_lm", load)
    monkeypatch.setattr(prune, "load_tokenizer", lambda name: None)  # the data comes before the teacher
    monkeypatch.setattr(prune, "calibration_data", lambda *args, **kwargs: (None, None, None))
    argv = ["--model", "m", "--out", str(tmp_path / "out"), "--target-ratio", "0.5"]
    for cuda, want in ((False, torch.float32), (True, torch.bfloat16)):
        monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
        assert main(argv) == 2 and seen[-1] == want
    assert main([*argv, "--dtype", "fp32"]) == 2 and seen[-1] == torch.float32  # explicit wins on CUDA too
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    capsys.readouterr()
    assert main([*argv, "--device", "cuda"]) == 2 and len(seen) == 3  # fails before loading, in one line
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "no CUDA GPU" in err and len(err.splitlines()) == 1
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "auto: bf16 on CUDA, fp32 on CPU" in capsys.readouterr().out


# -- completion-only masks in the search, and a mixture's calibration draw --------------------------------------

def _chat_jsonl(path, n: int) -> str:
    rows = [{"messages": [{"role": "user", "content": f"the fox {i} jumps over the lazy dog"},
                          {"role": "assistant", "content": "distill the teacher " * (1 + i % 3)}]} for i in range(n)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def _masked_case(n: int, seed: int, spans: list[tuple[int, int]]):
    """A tiny teacher, a student cut from it, ``n`` blocks of 20 tokens and a completion mask: block i's targets are
    positions ``spans[i]`` (blocks past the spans have none)."""
    teacher = tiny_model("llama", layers=3).requires_grad_(False)
    student = prune_to(teacher, importance(teacher, _blocks(), progress=False), Arch(2, 64, 2, 2, 64))
    ids = _blocks(n, seq=20, seed=seed)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    for row, (start, end) in enumerate(spans):
        mask[row, start:end] = True
    return teacher, student, ids, mask


def test_heldout_counts_only_completion_targets():
    """With a loss mask, held-out KL / perplexity / agreement are the naive sums over the masked-in targets only."""
    import math

    from distill.prune import HeldOut

    teacher, student, ids, mask = _masked_case(3, 5, [(8, 20), (3, 12)])  # block 2: prompt only, no target
    got = HeldOut(teacher, ids, batch_size=2, mask=mask).stats(student)
    with torch.no_grad():  # naive reference: position t counts when its label t+1 is a target
        ls, lt = (m(input_ids=ids).logits[:, :-1].float() for m in (student, teacher))
    keep = mask[:, 1:]
    lps, lpt = ls.log_softmax(-1)[keep], lt.log_softmax(-1)[keep]
    kl = (lpt.exp() * (lpt - lps)).sum(-1).mean().item()
    nll = F.cross_entropy(ls[keep], ids[:, 1:][keep]).item()
    agree = (ls.argmax(-1) == lt.argmax(-1))[keep].float().mean().item()
    assert got.tokens == got.ref_tokens == int(keep.sum()) == 12 + 9
    assert got.kl == pytest.approx(kl, rel=1e-4) and got.perplexity == pytest.approx(math.exp(nll), rel=1e-4)
    assert got.top1_agreement == pytest.approx(agree)
    every = HeldOut(teacher, ids, batch_size=2).stats(student)  # no mask: every token, as before
    assert every.tokens == 3 * 19 and abs(every.kl - got.kl) > 1e-3 * got.kl
    # The first ranking stage scores up to the first block holding a target; no target at all is an error.
    assert HeldOut(teacher, ids.flip(0), mask=mask.flip(0)).rank_blocks == 2
    assert HeldOut(teacher, ids).rank_blocks == 1
    with pytest.raises(PruneError, match="no completion target"):
        HeldOut(teacher, ids, mask=torch.zeros_like(mask))


def test_short_distill_trains_only_on_masked_in_targets():
    """The short distillation's gradient comes from the loss mask's targets only, as the recipe's DistillModel."""
    import dataclasses

    from distill.config import DistillConfig
    from distill.prune import short_distill

    teacher, base, ids, mask = _masked_case(2, 7, [(10, 20), (4, 9)])

    def params(m):
        return {k: v.detach().clone() for k, v in m.named_parameters()}

    # Every target masked out: the student does not move (default terms: KD + CE + hidden); without a mask it does.
    still = copy.deepcopy(base)
    before = params(still)
    short_distill(still, teacher, ids, 3, lr=1e-2, batch_size=4, loss_mask=torch.zeros_like(mask))
    assert all(torch.equal(before[k], v) for k, v in params(still).items())
    moved = copy.deepcopy(base)
    short_distill(moved, teacher, ids, 3, lr=1e-2, batch_size=4)
    assert any(not torch.equal(before[k], v) for k, v in params(moved).items())
    # A function of block indices (Blocks.loss_mask) giving nothing is plain training.
    same = copy.deepcopy(base)
    short_distill(same, teacher, ids, 3, lr=1e-2, batch_size=4, loss_mask=lambda index: None)
    assert all(torch.equal(params(moved)[k], v) for k, v in params(same).items())

    # One CE-only AdamW step: the update is lr · g / (|g| + eps) of the hand-computed gradient over the targets.
    ce_only = dataclasses.replace(DistillConfig().losses(), kd_weight=0.0, hidden_weight=0.0, attn_weight=0.0)
    lr = 1e-3

    def hand_step(keep):
        s = copy.deepcopy(base).train()
        logits = s(input_ids=ids).logits[:, :-1].float()
        F.cross_entropy(logits[keep], ids[:, 1:][keep]).backward()
        g = {k: p.grad.detach().clone() for k, p in s.named_parameters()}
        clip = min(1.0, 1.0 / (torch.linalg.vector_norm(torch.stack([v.norm() for v in g.values()])).item() + 1e-6))
        return {k: before[k] - lr * (v * clip) / ((v * clip).abs() + 1e-8) for k, v in g.items()}, g

    want, grad = hand_step(mask[:, 1:])
    every, _ = hand_step(torch.ones_like(mask[:, 1:]))
    student = copy.deepcopy(base)
    short_distill(student, None, ids, 1, loss_config=ce_only, lr=lr, batch_size=4, loss_mask=mask)
    got = params(student)
    big = {k: grad[k].abs() > 1e-6 for k in grad}  # where eps does not decide the step
    for k in got:
        torch.testing.assert_close(got[k][big[k]], want[k][big[k]], rtol=0, atol=lr * 1e-3)
    assert sum(int((got[k] != every[k])[big[k]].sum()) for k in got) > 100  # all-token training differs


def test_recipe_prune_passes_completion_masks_to_the_search(tmp_path, monkeypatch):
    """``student_init: prune`` on chat data with completion_only: the search gets the recipe's masks and uses them."""
    import dataclasses
    import math

    from core.tiny import tiny_tokenizer
    from distill import prune
    from distill.config import DistillConfig
    from distill.data import build_data

    tok = tiny_tokenizer()
    chat = _chat_jsonl(tmp_path / "chat.jsonl", 120)
    cfg = DistillConfig(datasets=[chat], seq_len=32, prune_calib_blocks=4, prune_eval_blocks=3, target_ratio=0.5,
                        prune_axes="depth,mlp", prune_search_steps=1, prune_top_k=1, prune_max_candidates=2,
                        micro_batch_size=2, eval_blocks=4, data_cache=str(tmp_path / "c"),
                        output_dir=str(tmp_path / "run"))
    want = build_data(tok, **cfg.data_args(), seq_len=32, eval_blocks=7, progress=False)
    want.eval, want.eval_mask = want.eval[4:], want.eval_mask[4:]  # ranked past the 4 blocks the run reports
    assert want.eval_mask is not None and 0 < int(want.eval_mask.sum()) < want.eval_mask.numel()

    given = {}

    def fake_search(teacher, calib, held, train, s, log, masks=None):
        given.update(calib=calib, held=held, train=train, masks=masks)
        raise PruneError("stop")

    real_search = prune.search
    monkeypatch.setattr(prune, "search", fake_search)
    with pytest.raises(PruneError, match="stop"):
        prune.prune_for_recipe(tiny_model("llama", layers=2), tok, cfg, log=lambda _msg: None)
    masks = given["masks"]
    assert torch.equal(given["held"], want.eval) and torch.equal(masks.heldout, want.eval_mask)
    idx = torch.arange(6)
    assert torch.equal(masks.train(idx), want.train.loss_mask(idx)) and not bool(masks.train(idx).all())
    assert torch.equal(given["calib"], want.train[:4])  # calibration: the same blocks, every token
    # completion_only=false: no mask anywhere, as for plain text.
    with pytest.raises(PruneError, match="stop"):
        prune.prune_for_recipe(tiny_model("llama", layers=2), tok, dataclasses.replace(cfg, completion_only=False),
                               log=lambda _msg: None)
    assert given["masks"].heldout is None and given["masks"].train(idx) is None

    # The real search: its held-out ranking and its short distillation see those masks.
    seen = {}
    real_short, real_heldout = prune.short_distill, prune.HeldOut

    def spy_short(*args, loss_mask=None, **kw):
        seen["train"] = loss_mask(idx)
        return real_short(*args, loss_mask=loss_mask, **kw)

    class SpyHeldOut(real_heldout):
        def __init__(self, teacher, blocks, batch_size=4, mask=None):
            seen["heldout"] = mask
            super().__init__(teacher, blocks, batch_size, mask=mask)

    monkeypatch.setattr(prune, "search", real_search)
    monkeypatch.setattr(prune, "short_distill", spy_short)
    monkeypatch.setattr(prune, "HeldOut", SpyHeldOut)
    student = prune.prune_for_recipe(tiny_model("llama", layers=2), tok, cfg, log=lambda _msg: None)
    assert torch.equal(seen["heldout"], want.eval_mask) and torch.equal(seen["train"], want.train.loss_mask(idx))
    assert student.config.num_hidden_layers <= 2
    record = json.loads((tmp_path / "run" / "pruned" / "search.json").read_text())
    assert all(math.isfinite(c["kl_init"]) for c in record["candidates"]) and math.isfinite(
        record["winner"]["kl_distilled"])


def test_recipe_prune_calibrates_a_two_source_mixture_by_weight_on_the_recipe_order(tmp_path):
    """A weighted mixture calibrates on the blocks the recipe's order draws first from each source, in the
    weights' proportions; a single source keeps its first blocks; a mixture smaller than the draw still works."""
    import numpy as np

    from core.tiny import tiny_tokenizer
    from distill.config import DistillConfig
    from distill.data import build_data
    from distill.prune import calibration_data

    tok = tiny_tokenizer()
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("\n".join(json.dumps({"text": f"the quick brown fox {i} jumps " * 3}) for i in range(200)))
    b.write_text("\n".join(json.dumps({"text": f"distill the teacher {i} now " * 3}) for i in range(200)))
    mix = [{"source": str(a), "weight": 3}, {"source": str(b), "weight": 1}]
    cfg = DistillConfig(datasets=mix, seq_len=16, seed=5, micro_batch_size=4, data_cache=str(tmp_path / "c"))
    data = build_data(tok, **cfg.data_args(), seq_len=16, eval_blocks=2, progress=False)
    calib, held, train = calibration_data(tok, seq_len=16, calib_blocks=16, eval_blocks=2, seed=cfg.seed,
                                          **cfg.data_args())
    # The recipe's order (recipes/distill.py: data.order(global_batch, cfg.seed)), drawn for 16 blocks.
    idx = data.order(16, cfg.seed).step_indices(0)
    assert torch.equal(calib, data.train[idx]) and torch.equal(held, data.eval) and train.shape == data.train.shape
    src = np.searchsorted(data.train.offsets, idx.numpy(), side="right") - 1
    assert np.bincount(src, minlength=2).tolist() == [12, 4]  # 3 : 1
    assert len(set(idx.tolist())) == 16
    # The recipe's first step (a global batch of 4) draws its blocks among them.
    first = data.order(cfg.micro_batch_size * cfg.grad_accum, cfg.seed).step_indices(0)
    assert set(first.tolist()) <= set(idx.tolist())
    # More calibration blocks than the mixture holds (5 + 5): as many as it holds, drawn by weight; no error.
    capped = DistillConfig(datasets=mix, seq_len=16, max_train_blocks=5, data_cache=str(tmp_path / "c"))
    few, _, _ = calibration_data(tok, seq_len=16, calib_blocks=64, eval_blocks=2, **capped.data_args())
    assert few.shape == (10, 16)
    # A single source: its first blocks, as before.
    one = DistillConfig(datasets=[str(a)], seq_len=16, data_cache=str(tmp_path / "c"))
    single = build_data(tok, **one.data_args(), seq_len=16, eval_blocks=2, progress=False)
    calib1, held1, _ = calibration_data(tok, seq_len=16, calib_blocks=6, eval_blocks=2, seed=5, **one.data_args())
    assert torch.equal(calib1, single.train[:6]) and torch.equal(held1, single.eval)


def test_recipe_prune_short_distils_candidates_with_the_runs_loss_terms(tmp_path, monkeypatch):
    """The recipe's search trains its candidates with the run's own terms (here reverse KL without CE), not the
    demo's defaults, and a run with other terms does not reuse a search memoised under the first ones."""
    import dataclasses

    from core.tiny import tiny_tokenizer
    from distill import prune
    from distill.config import DistillConfig

    cfg = DistillConfig(seq_len=32, prune_calib_blocks=4, prune_eval_blocks=2, target_ratio=0.5,
                        prune_axes="depth", prune_search_steps=1, prune_top_k=1, prune_max_candidates=2,
                        micro_batch_size=2, max_train_blocks=8, kd_kind="reverse_kl", ce_weight=0.0, hidden_weight=0.0,
                        output_dir=str(tmp_path / "run"))
    assert cfg.losses() != prune.default_loss_config()
    seen = []
    real_short = prune.short_distill

    def spy_short(*args, loss_config=None, **kw):
        seen.append(loss_config)
        return real_short(*args, loss_config=loss_config, **kw)

    monkeypatch.setattr(prune, "short_distill", spy_short)
    monkeypatch.setattr(prune, "_recipe_memo", {})
    tok = tiny_tokenizer()
    prune.prune_for_recipe(tiny_model("llama", layers=2), tok, cfg, log=lambda _msg: None)
    assert seen == [cfg.losses()]
    other = dataclasses.replace(cfg, kd_kind="forward_kl", output_dir=str(tmp_path / "run2"))
    prune.prune_for_recipe(tiny_model("llama", layers=2), tok, other, log=lambda _msg: None)
    assert seen == [cfg.losses(), other.losses()]  # searched again, with its own terms


def test_cli_bad_budget_lr_dataset_and_out_are_refused_before_the_teacher_loads(tmp_path, monkeypatch, capsys):
    import distill.prune as prune

    def loaded(*args, **kwargs):
        raise AssertionError("the teacher was loaded before the bad input was refused")
    monkeypatch.setattr(prune, "load_causal_lm", loaded)
    monkeypatch.setattr(prune, "load_tokenizer", loaded)
    afile = tmp_path / "afile"
    afile.write_text("not a folder")
    out = ["--out", str(tmp_path / "out")]
    ratio = ["--target-ratio", "0.5"]
    for flags, says in (
            ([*out], "give exactly one of --target-params (absolute) or --target-ratio"),
            ([*out, *ratio, "--target-params", "1e6"], "give exactly one of --target-params"),
            ([*out, "--target-ratio", "0"], "--target-ratio must be in (0, 1], got 0.0; choose"),
            ([*out, "--target-ratio", "1.5"], "--target-ratio must be in (0, 1], got 1.5; choose"),
            ([*out, "--target-ratio", "nan"], "--target-ratio must be in (0, 1], got nan"),
            ([*out, "--target-params", "-5"], "--target-params must be a finite number > 0, got -5.0"),
            ([*out, "--target-params", "inf"], "--target-params must be a finite number > 0, got inf"),
            ([*out, *ratio, "--lr", "nan"], "--lr must be a finite number > 0, got nan"),
            ([*out, *ratio, "--lr", "0"], "--lr must be a finite number > 0, got 0.0"),
            ([*out, *ratio, "--dataset", str(tmp_path / "missing.jsonl")],
             f"--dataset {tmp_path / 'missing.jsonl'} does not exist; check the path"),
            ([*out, *ratio, "--dataset", "./missing"], "--dataset ./missing does not exist"),
            (["--out", str(afile / "x"), *ratio], f"lies under {afile}, which is a file; choose another --out"),
            (["--out", str(afile), *ratio], "is a file, not a folder; choose another --out")):
        capsys.readouterr()
        assert main(["--model", "m", *flags]) == 2, flags
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("error: ") and says in err, (flags, err)
    assert afile.read_text() == "not a folder" and sorted(tmp_path.iterdir()) == [afile]  # nothing written


def test_save_pruned_puts_back_an_output_a_kill_left_aside_before_deciding_on_overwrite(tmp_path):
    """A prune killed between replace_dir's renames left its earlier output only under ``.old-pruned-<hex>``:
    the next save puts it back first, so it is protected as before (not empty: --overwrite) and then replaced
    with nothing left aside."""
    model = tiny_model("llama", layers=2)
    ours = tmp_path / "pruned"
    save_pruned(model, None, ours, extra={"winner": "a"})
    aside = ours.rename(tmp_path / ".old-pruned-0a1b2c3d")
    with pytest.raises(PruneError, match="not empty"):
        save_pruned(model, None, ours, extra={"winner": "b"})
    assert json.loads((ours / "search.json").read_text()) == {"winner": "a"} and not aside.exists()
    save_pruned(model, None, ours, overwrite=True, extra={"winner": "b"})
    assert json.loads((ours / "search.json").read_text()) == {"winner": "b"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pruned"]
    # save_pretrained's weights are created private by safetensors; the folder's files all read alike
    modes = {p.name: p.stat().st_mode & 0o777 for p in ours.iterdir()}
    assert modes["model.safetensors"] == modes["config.json"], modes
