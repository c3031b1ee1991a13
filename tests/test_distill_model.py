import pytest
import torch
import torch.nn.functional as F

from core.tiny import tiny_model
from distill import losses
from distill.layers import LayerMapError, derived_pairs, parse_layer_pairs, relative_pairs
from distill.model import DistillModel, DistillSetupError, LossConfig
from distill.student import derive_student, spread_layers


def loss_config(**overrides) -> LossConfig:
    """LossConfig has no defaults of its own; these are the tests' explicit baseline."""
    base = dict(kd_weight=1.0, kd_kind="forward_kl", temperature=2.0, beta=0.5, kd_chunk_size=1024, ce_weight=0.0,
                focal_weight=0.0, focal_alpha=0.25, focal_gamma=2.0, hidden_weight=0.0, hidden_layers=["relative"],
                hidden_kind="nmse", attn_weight=0.0, attn_layers=[], attn_num_queries=64)
    return LossConfig(**(base | overrides))


def pair(**kw):
    teacher = tiny_model(layers=4, seed=0, **kw)
    student = derive_student(teacher, [0, 3])
    return teacher, student


def ids(batch=2, seq=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 300, (batch, seq), generator=g)


def test_teacher_hidden_from_state_dict_and_optimizer():
    teacher, student = pair()
    m = DistillModel(student, teacher, loss_config(hidden_weight=1.0, hidden_layers=["relative"]))
    keys = list(m.state_dict())
    assert keys and all(k.startswith(("student.", "projectors.")) for k in keys)
    teacher_ids = {id(p) for p in teacher.parameters()}
    assert not any(id(p) in teacher_ids for p in m.parameters())
    assert not any(p.requires_grad for p in teacher.parameters()) and not teacher.training


def test_projector_when_widths_differ_and_is_saved():
    teacher = tiny_model(layers=4, hidden=64, heads=4, kv_heads=2)
    student = tiny_model(layers=2, hidden=32, heads=2, kv_heads=1, seed=3)
    m = DistillModel(student, teacher, loss_config(hidden_weight=1.0, hidden_layers=["relative"], kd_weight=0.0))
    assert m.hidden_pairs == [(0, 1), (1, 3)]
    assert m.projectors["s0_t1"].weight.shape == (64, 32)
    assert "projectors.s0_t1.weight" in m.state_dict()
    out = m(ids())
    out.loss.backward()
    assert m.projectors["s0_t1"].weight.grad is not None


def test_forward_terms_equal_direct_computation():
    teacher = tiny_model(layers=4, seed=0)
    student = derive_student(teacher, [0, 2, 3])
    # HF's last hidden state is after the final norm: compare layers before the last one.
    cfg = loss_config(kd_weight=1.0, temperature=2.0, ce_weight=0.5, focal_weight=0.3, hidden_weight=0.7,
                     hidden_layers=["0:1", "1:2"], hidden_kind="mse", attn_weight=0.2, attn_layers=["2:3"], attn_num_queries=64,
                     kd_chunk_size=5)
    m = DistillModel(student, teacher, cfg)
    x = ids()
    out = m(x)
    # Reference: plain forward passes with every hidden state and eager attention probabilities.
    s = student(x, output_hidden_states=True)
    with torch.no_grad():
        t = teacher(x, output_hidden_states=True)
    target = x[:, 1:]
    kd = losses.kd_loss(s.logits[:, :-1], t.logits[:, :-1], temperature=2.0)
    ce = F.cross_entropy(s.logits[:, :-1].reshape(-1, s.logits.shape[-1]), target.reshape(-1))
    hid = torch.stack([F.mse_loss(s.hidden_states[1], t.hidden_states[2]),
                       F.mse_loss(s.hidden_states[2], t.hidden_states[3])]).mean()
    torch.testing.assert_close(out.kd, kd, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.ce, ce, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.hidden, hid, rtol=1e-5, atol=1e-7)
    expected = 1.0 * out.kd + 0.5 * out.ce + 0.3 * out.focal + 0.7 * out.hidden + 0.2 * out.attn
    torch.testing.assert_close(out.loss, expected)
    assert out.attn > 0


def test_captured_attention_maps_match_eager_attention():
    """q/k captured by hooks give the same probabilities as the eager attention layer."""
    teacher, student = pair()
    teacher.config._attn_implementation = "eager"
    m = DistillModel(student, teacher, loss_config(kd_weight=0.0, attn_weight=1.0, attn_layers=["1:3"]))
    x = ids(batch=1, seq=10)
    with torch.no_grad():
        m(x)  # fills nothing persistent; run the taps directly below
        taps = m._teacher_taps
        taps.clear()
        eager = teacher(x, output_attentions=True).attentions[3]  # [1, heads, seq, seq]
        q, k = taps.qk(3, 16)
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = q @ k.transpose(-1, -2) / 16 ** 0.5
    scores = scores.masked_fill(~torch.ones(10, 10, dtype=torch.bool).tril(), float("-inf"))
    torch.testing.assert_close(scores.softmax(-1), eager, rtol=1e-5, atol=1e-6)


def test_chunked_and_full_kd_paths_agree_with_gradients():
    # fp64: in fp32 the two summation orders differ by ~2e-5 relative on this small loss depending on the
    # thread count, which a tolerance tight enough to catch a chunking bug cannot absorb
    teacher, student = (m.double() for m in pair())
    x = ids()
    grads = []
    values = []
    for chunk in (None, 7):
        student.zero_grad()
        m = DistillModel(student, teacher, loss_config(kd_weight=1.0, kd_chunk_size=chunk, temperature=1.5))
        out = m(x)
        out.loss.backward()
        values.append(out.loss.detach())
        grads.append(torch.cat([p.grad.flatten() for p in student.parameters() if p.grad is not None]))
        m.remove_hooks()
    torch.testing.assert_close(values[0], values[1], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-8, atol=1e-12)


def test_ce_is_over_the_students_whole_head_whichever_kd_path_computes_it():
    """A student head with rows past the shared vocabulary (padding): CE is its full softmax on every path, so
    kd_chunk_size does not change the objective."""
    teacher = tiny_model(layers=2, seed=0, vocab_size=320).double()
    student = tiny_model(layers=2, seed=1, vocab_size=400).double()
    x = ids()
    outs = []
    for chunk in (None, 8):
        with pytest.warns(UserWarning, match="comparing the first 320 logits"):
            m = DistillModel(student, teacher, loss_config(kd_chunk_size=chunk, ce_weight=1.0), tokenizer_size=300)
        outs.append(m(x))
        m.remove_hooks()
    torch.testing.assert_close(outs[0].ce, outs[1].ce, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(outs[0].kd, outs[1].kd, rtol=1e-10, atol=1e-12)
    full = F.cross_entropy(student(x).logits[:, :-1].reshape(-1, 400), x[:, 1:].reshape(-1))
    torch.testing.assert_close(outs[1].ce, full, rtol=1e-10, atol=1e-12)


def test_padding_never_counts():
    teacher, student = pair()
    m = DistillModel(student, teacher, loss_config(kd_weight=1.0, ce_weight=1.0, hidden_weight=1.0,
                                                  hidden_layers=["derived"]))
    x = ids(batch=1, seq=8)
    padded = torch.cat([x, torch.zeros(1, 4, dtype=torch.long)], 1)
    am = torch.cat([torch.ones(1, 8), torch.zeros(1, 4)], 1).long()
    a, b = m(x), m(padded, attention_mask=am)
    for k in ("kd", "ce", "hidden"):
        torch.testing.assert_close(getattr(a, k), getattr(b, k), rtol=1e-5, atol=1e-6)


def test_derive_student_keeping_every_layer_is_the_teacher():
    teacher = tiny_model(layers=3)
    student = derive_student(teacher, [0, 1, 2])
    x = ids()
    torch.testing.assert_close(student(x).logits, teacher(x).logits)
    assert all(p.data_ptr() != q.data_ptr() for p, q in zip(student.parameters(), teacher.parameters()))


def test_derived_student_layers_and_pairs():
    teacher = tiny_model(layers=6)
    student = derive_student(teacher, "0-1,5")
    assert student.config.num_hidden_layers == 3 and student.config.distill_kept_layers == [0, 1, 5]
    torch.testing.assert_close(student.model.layers[2].mlp.up_proj.weight, teacher.model.layers[5].mlp.up_proj.weight)
    assert derived_pairs([0, 1, 5], 6) == [(0, 0), (1, 4), (2, 5)]
    assert spread_layers(30, 10) == [0, 3, 6, 10, 13, 16, 19, 23, 26, 29]
    with pytest.raises(ValueError, match="out of range"):
        derive_student(teacher, [0, 9])


def test_layer_maps():
    assert relative_pairs(30, 40)[15] == (15, 20)  # the 17B→7B seed pair
    assert parse_layer_pairs(["15:20"], 30, 40) == [(15, 20)]
    assert parse_layer_pairs(["-1:-1"], 30, 40) == [(29, 39)]
    with pytest.raises(LayerMapError, match="teacher layer 40 is out of range"):
        parse_layer_pairs(["1:40"], 30, 40)
    with pytest.raises(LayerMapError, match="derived"):
        parse_layer_pairs(["derived"], 30, 40)


def test_setup_errors_name_the_fix():
    teacher = tiny_model(layers=2, vocab=320)
    other = tiny_model(layers=2, vocab=400)
    with pytest.raises(DistillSetupError, match="vocab_size 400 != student vocab_size 320"):
        DistillModel(teacher, other, loss_config())
    with pytest.warns(UserWarning, match="padding"):
        m = DistillModel(teacher, other, loss_config(), tokenizer_size=300)
    assert m.vocab == 320
    m(ids()).loss.backward()
    with pytest.raises(DistillSetupError, match="need a teacher"):
        DistillModel(teacher, None, loss_config(kd_weight=1.0))
    with pytest.raises(DistillSetupError, match="every loss weight is 0"):
        loss_config(kd_weight=0.0)


def test_normalized_hidden_mse_is_scale_free():
    teacher = tiny_model(layers=4, seed=0)
    student = derive_student(teacher, [0, 2, 3])
    m = DistillModel(student, teacher, loss_config(kd_weight=0.0, hidden_weight=1.0, hidden_layers=["0:1"],
                                                  hidden_kind="nmse"))
    x = ids()
    s = student(x, output_hidden_states=True).hidden_states[1]
    t = teacher(x, output_hidden_states=True).hidden_states[2].detach()
    expected = ((s - t).pow(2).mean(-1) / t.pow(2).mean(-1)).mean()
    torch.testing.assert_close(m(x).hidden, expected, rtol=1e-5, atol=1e-7)


def test_derived_student_keeps_the_teachers_generation_config():
    """A chat teacher's generation_config (e.g. several end-of-turn ids) must survive derivation: the student is
    saved with it (final/, checkpoints), and without it generation runs past the end of a turn."""
    teacher = tiny_model(layers=4)
    teacher.generation_config.eos_token_id = [2, 5]
    teacher.generation_config.max_new_tokens = 7
    student = derive_student(teacher, [0, 3])
    assert student.generation_config.eos_token_id == [2, 5]
    assert student.generation_config.max_new_tokens == 7
    assert student.generation_config is not teacher.generation_config  # a copy, not a shared object


def test_keep_layers_below_minus_depth_is_an_error_not_a_wrap():
    teacher = tiny_model(layers=4)
    assert derive_student(teacher, [0, -1]).config.distill_kept_layers == [0, 3]
    with pytest.raises(ValueError, match="out of range"):
        derive_student(teacher, [0, -5])  # -5 % 4 == 3: would silently keep the last layer


def test_projector_follows_the_students_dtype():
    """A bf16 student of another width: the projector must be built in the student's dtype, or the hidden term
    fails on the first step (bf16 states through an fp32 Linear)."""
    teacher = tiny_model(layers=4, hidden=64).to(torch.bfloat16)
    student = tiny_model(layers=2, hidden=32, heads=2, kv_heads=1, seed=3).to(torch.bfloat16)
    m = DistillModel(student, teacher, loss_config(kd_weight=0.0, hidden_weight=1.0, hidden_layers=["1:3"]))
    proj = m.projectors["s1_t3"]
    assert proj.weight.dtype == torch.bfloat16 and proj.weight.device == student.lm_head.weight.device
    out = m(ids())
    out.loss.backward()
    assert torch.isfinite(out.hidden) and out.hidden > 0
    assert proj.weight.grad is not None and torch.isfinite(proj.weight.grad).all() and proj.weight.grad.abs().sum() > 0


def test_keep_layers_reversed_range_is_an_error_not_dropped():
    teacher = tiny_model(layers=6)
    assert derive_student(teacher, "0-1,4-5").config.distill_kept_layers == [0, 1, 4, 5]
    with pytest.raises(ValueError, match="5-4"):
        derive_student(teacher, "0-1,5-4")  # range(5, 5) is empty: the student silently lost layers 4 and 5
