"""bench/on_policy.py: the held-out reverse-KL eval against a naive reference, its error bar, and --compare."""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import statistics
from pathlib import Path

import pytest
import torch

from core.tiny import tiny_model, tiny_tokenizer
from serve.engine import Engine
from serve.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 12  # tiny vocabulary: EOS (id 2) is sampled often, so continuations end at different lengths


def _bench():
    spec = importlib.util.spec_from_file_location("bench_on_policy", ROOT / "bench" / "on_policy.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _pair():
    return tiny_model(seed=1, layers=2, vocab=VOCAB).eval(), tiny_model(seed=2, layers=1, vocab=VOCAB).train()


def _tiny_data():
    """What ``run_arm`` reads of the bench's data: 24 train and 4 held-out blocks of 8 tokens."""
    from types import SimpleNamespace

    g = torch.Generator().manual_seed(0)
    return SimpleNamespace(train=torch.randint(3, VOCAB, (24, 8), generator=g),
                           eval=torch.randint(3, VOCAB, (4, 8), generator=g))


def _prompts(n: int, length: int = 5, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n, length), generator=g).tolist()


def _rollout_rows():
    """Two rollout rows with 4-token prompts; the second continuation stopped early (padded on the right)."""
    from distill.on_policy import rollout_batch

    prompts, conts = _prompts(2, length=4), [[5, 6, 7, 8, 9], [4, 3]]
    return prompts, conts, rollout_batch(prompts, conts, 0)


def _naive_positions(student, teacher, prompts, conts, temp: float = 1.0) -> list[tuple[torch.Tensor, float]]:
    """Each generated position from its own prefix: reverse KL(student || teacher at ``temp``), with the student's
    gradient, and the tempered teacher's entropy there."""
    out = []
    for p, c in zip(prompts, conts):
        for j in range(len(c)):
            ctx = torch.tensor([p + c[:j]])
            log_q = student(input_ids=ctx).logits[0, -1].log_softmax(-1)
            with torch.no_grad():
                log_p = (teacher(input_ids=ctx).logits[0, -1] / temp).log_softmax(-1)
            out.append(((log_q.exp() * (log_q - log_p)).sum(), float(-(log_p.exp() * log_p).sum())))
    return out


def test_own_continuation_rkl_equals_naive_reference():
    """Batched, padded eval == per-row, per-token KL(q || p) over a fresh engine's continuations (same seeds)."""
    bench = _bench()
    teacher, student = _pair()
    tok = tiny_tokenizer()
    prompts, gen, seed, samples = _prompts(6), 7, 123, 2
    got = bench.own_continuation_rkl(student, teacher, tok, prompts, gen, seed, samples=samples, batch=3)
    assert student.training  # left as found

    todo = [p for p in prompts for _ in range(samples)]
    fresh = Engine(model=copy.deepcopy(student), tokenizer=tok, max_batch=len(todo), max_seq_len=len(prompts[0]) + gen)
    conts = [c.token_ids for c in fresh.generate(todo, [SamplingParams(max_new_tokens=gen, temperature=1.0,
                                                                       seed=seed + i) for i in range(len(todo))])]
    assert len({len(c) for c in conts}) > 1  # some stopped at EOS: the eval's padding is exercised
    sums, counts = [], []
    with torch.no_grad():
        for p, c in zip(todo, conts):
            ids = torch.tensor([p + c])
            zq, zp = student.eval()(input_ids=ids).logits[0], teacher(input_ids=ids).logits[0]
            row = 0.0
            for t in range(len(p), len(p) + len(c)):  # logits at t - 1 predict token t
                q, lp = torch.softmax(zq[t - 1].double(), -1), torch.log_softmax(zp[t - 1].double(), -1)
                row += sum(float(q[v] * (torch.log(q[v]) - lp[v])) for v in range(VOCAB))
            sums.append(row)
            counts.append(len(c))
    ref = sum(sums) / sum(counts)
    assert got["rkl"] == pytest.approx(ref, rel=1e-5)
    n, mean_c = len(sums), sum(counts) / len(counts)
    se = (sum((s - ref * c) ** 2 for s, c in zip(sums, counts)) / ((n - 1) * n)) ** 0.5 / mean_c
    assert got["se"] == pytest.approx(se, rel=1e-4)


def test_own_continuation_rkl_error_bar_matches_seed_to_seed_spread():
    """The reported SE is the real sampling noise: the spread of the estimate over eval seeds agrees with it."""
    bench = _bench()
    teacher, student = _pair()
    tok = tiny_tokenizer()
    prompts = _prompts(40, seed=3)
    runs = [bench.own_continuation_rkl(student, teacher, tok, prompts, 6, seed=1000 * k, batch=20) for k in range(16)]
    spread = statistics.stdev(r["rkl"] for r in runs)
    se = statistics.mean(r["se"] for r in runs)
    assert 0.5 < spread / se < 2.0  # 16 draws: the sample std is within ±50 % of the truth with high probability
    assert len({round(r["rkl"], 9) for r in runs}) == 16  # each eval seed draws other continuations


def test_eval_windows_are_held_out_and_refuse_too_many():
    bench = _bench()
    blocks = torch.arange(3 * 8).reshape(3, 8)  # 3 held-out blocks of 8 tokens, windows of 4
    w = bench.eval_windows(blocks, 4, 6)
    assert w[:3] == [blocks[b, :4].tolist() for b in range(3)]  # first windows of every block come first
    assert w[3:] == [blocks[b, 4:].tolist() for b in range(3)]
    with pytest.raises(SystemExit, match="lower it"):
        bench.eval_windows(blocks, 4, 7)


def _log(tmp_path: Path, name: str, **row) -> str:
    base = {"budget_s": 300.0, "clock": "cpu", "student": "s", "seed": 0, "lr": 3e-4, "fraction": 0.2, "on_start": 0.0,
            "kind": "forward_kl", "on_kind": "reverse_kl", "beta": 0.5, "gen_tokens": 64, "gen_temperature": 1.0,
            "threads": 1, "schedule": "cosine", "eval_prompts": 128, "eval_samples": 1, "eval_seed": 10_000, "load_avg": [1.0],
            "init": None, "off_policy": None, "on_policy": None}
    base.update(row)
    path = tmp_path / name
    path.write_text("progress lines\n" + json.dumps(base) + "\n")
    return str(path)


def _arm(ppl, rkl, se, on_steps):
    return {"arm": "a", "steps": 10, "ppl": ppl, "own_rkl": rkl, "own_rkl_se": se, "on_steps": on_steps,
            "off_steps": 10 - on_steps, "on_step_s": 5.0, "off_step_s": 4.0, "on_step_wall_s": 5.0,
            "off_step_wall_s": 4.0, "rollout_tok_s": 0.0, "gen_time_share": 0.0}


def test_compare_two_arm_logs(tmp_path, capsys):
    bench = _bench()
    off = _log(tmp_path, "off.log", init={"ppl": 100.0, "own_rkl": 1.5}, off_policy=_arm(60.0, 1.25, 0.025, 0))
    mix = _log(tmp_path, "mix.log", on_policy=_arm(61.8, 1.10, 0.022, 2))
    bench.compare(off, mix)
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["own_rkl_change"] == pytest.approx(1.10 / 1.25 - 1)
    assert out["ppl_change"] == pytest.approx(61.8 / 60.0 - 1)
    assert out["own_rkl_change_se"] == pytest.approx((1.10 / 1.25) * ((0.022 / 1.10) ** 2 + (0.025 / 1.25) ** 2) ** 0.5)
    assert out["target_rkl_met"] and out["target_ppl_met"] and out["step_cost_ratio"] == pytest.approx(1.25)
    assert out["step_cost_ratio_mean"] is None and out["target_cost_met"]  # an older log has no means (null)
    # Queued rollouts: the median on-policy step decodes nothing; the mean, which the target also checks, does.
    queued = _log(tmp_path, "queued.log", on_policy=_arm(61.8, 1.10, 0.022, 2) | {"on_step_mean_s": 9.0,
                                                                                 "off_step_mean_s": 4.0})
    bench.compare(off, queued)
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["step_cost_ratio"] == pytest.approx(1.25) and out["step_cost_ratio_mean"] == pytest.approx(2.25)
    assert not out["target_cost_met"]
    other = _log(tmp_path, "other.log", seed=1, on_policy=_arm(61.8, 1.10, 0.022, 2))
    with pytest.raises(SystemExit, match="differ in seed"):
        bench.compare(off, other)
    assert out["environment_differences"] == []  # logs without a record compare as before
    # Arms run under different package versions: compared, with a note that names the difference.
    env = bench.environment()
    moved = json.loads(json.dumps(env))
    moved["packages"]["transformers"] = "0.0.1"
    off = _log(tmp_path, "off_env.log", init=None, off_policy=_arm(60.0, 1.25, 0.025, 0) | {"environment": moved})
    mix = _log(tmp_path, "mix_env.log", on_policy=_arm(61.8, 1.10, 0.022, 2) | {"environment": env})
    bench.compare(off, mix)
    printed = capsys.readouterr().out
    out = json.loads(printed.strip().splitlines()[-1])
    assert out["environment_differences"] == [f"transformers 0.0.1 -> {env['packages']['transformers']}"]
    assert "different environments (transformers 0.0.1 -> " in printed


def test_compare_pairs_summarises_labels_and_plots_the_trade_off(tmp_path, capsys):
    """Several OFF MIX pairs: each pair's own verdict, one labelled row per pair, a PNG, one JSON last line."""
    bench = _bench()
    off0 = _log(tmp_path, "off0.log", off_policy=_arm(60.0, 1.25, 0.025, 0))
    off1 = _log(tmp_path, "off1.log", seed=1, off_policy=_arm(50.0, 1.00, 0.02, 0))
    mix0 = _log(tmp_path, "mix0.log", on_policy=_arm(61.8, 1.10, 0.022, 2), on_clip=2.0, project="data")
    mix1 = _log(tmp_path, "mix1.log", seed=1, on_policy=_arm(54.0, 0.85, 0.02, 2), on_clip=2.0, project="data",
                on_max_entropy=3.0)
    png = tmp_path / "trade_off.png"
    args = bench.parse_args(["--compare", off0, mix0, off1, mix1, "--plot", str(png)])
    rows = bench.compare_many(list(zip(args.compare[::2], args.compare[1::2])), args.plot)
    lines = capsys.readouterr().out.strip().splitlines()
    out = json.loads(lines[-1])
    assert out["pairs"] == rows and out["plot"] == str(png)
    assert sum(line.startswith("{") for line in lines) == 1  # the pairs' own JSON lines are not printed
    assert [r["label"] for r in rows] == ["λ0.2 clip 2 project data", "λ0.2 clip 2 project data max-H 3"]
    assert rows[0]["ppl_change"] == pytest.approx(61.8 / 60.0 - 1) and rows[1]["ppl_change"] == pytest.approx(0.08)
    assert rows[1]["own_rkl_change"] == pytest.approx(-0.15) and rows[0]["seed"] == 0 and rows[1]["seed"] == 1
    assert (rows[0]["target_rkl_met"], rows[0]["target_ppl_met"]) == (True, True)
    assert (rows[1]["target_rkl_met"], rows[1]["target_ppl_met"]) == (True, False)
    assert any("not met" in line for line in lines) and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Each setting's trade-off: its one pair's ratio here; over several seeds, least squares through the origin.
    assert out["slopes"] == {rows[0]["label"]: pytest.approx((1.10 / 1.25 - 1) / (61.8 / 60.0 - 1)),
                             rows[1]["label"]: pytest.approx(-0.15 / 0.08)}
    xs, ys = [0.02, 0.08, -0.01], [-0.05, -0.15, -0.04]
    seeds = [{"ppl_change": x, "own_rkl_change": y} for x, y in zip(xs, ys)]
    assert bench.trade_off_slope(seeds) == pytest.approx((0.02 * -0.05 + 0.08 * -0.15) / (0.02**2 + 0.08**2))
    assert bench.trade_off_slope(seeds[2:]) is None  # perplexity fell: nothing was traded
    # Pairs trained from different students say which student in their labels.
    off2 = _log(tmp_path, "off2.log", student="runs/warm", off_policy=_arm(60.0, 1.25, 0.025, 0))
    mix2 = _log(tmp_path, "mix2.log", student="runs/warm", on_policy=_arm(61.8, 1.10, 0.022, 2))
    rows = bench.compare_many([(off0, mix0), (off2, mix2)], None)
    assert [r["label"] for r in rows] == ["λ0.2 clip 2 project data (s)", "λ0.2 (warm)"]
    capsys.readouterr()
    # A pair of mismatched settings fails as in the two-log form.
    with pytest.raises(SystemExit, match="differ in seed"):
        bench.compare_many([(off0, mix1)], None)


def test_compare_refuses_an_odd_number_of_logs_and_plot_without_logs(capsys):
    bench = _bench()
    with pytest.raises(SystemExit):
        bench.parse_args(["--compare", "a.log", "b.log", "c.log"])
    assert "in pairs (OFF MIX OFF MIX ...), got 3" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.parse_args(["--plot", "x.png"])
    assert "--plot draws the pairs of --compare" in capsys.readouterr().err


def test_compare_refuses_a_missing_log_and_an_unfinished_run_in_one_line(tmp_path):
    bench = _bench()
    off = _log(tmp_path, "off.log", init=None, off_policy=_arm(60.0, 1.25, 0.025, 0))
    running = tmp_path / "running.log"
    running.write_text("demo pair: ...\n    on-policy 0.2 step 7: off-policy, 4.1s (cpu), 6/130steps\n")
    (tmp_path / "empty.log").write_text("")
    for log, says in ((str(tmp_path / "absent.log"), "cannot read the bench log"),
                      (str(running), "does not end in the bench's JSON line"),
                      (str(tmp_path / "empty.log"), "does not end in the bench's JSON line")):
        with pytest.raises(SystemExit, match=says) as e:
            bench.compare(off, log)
        assert "\n" not in str(e.value)


def test_lr_schedule_is_the_recipes_warmup_cosine_over_the_budget():
    """Progress = share of the budget; with the step's share it is the recipe's ``warmup_cosine`` exactly."""
    import argparse

    from distill.training import warmup_cosine

    bench = _bench()
    args = argparse.Namespace(schedule="cosine", warmup=4, min_lr_ratio=0.1)
    recipe = warmup_cosine(4, 30, 0.1)
    for step in range(30):
        assert bench.lr_multiplier(args, step, max(0, step - 4) / 26) == pytest.approx(recipe(step))
    assert bench.lr_multiplier(args, 50, 1.3) == pytest.approx(0.1)  # past the budget: the floor
    assert bench.lr_multiplier(argparse.Namespace(schedule="constant"), 0, 0.5) == 1.0


def test_step_budget_charges_on_policy_steps_their_cost():
    bench = _bench()
    b = bench.Budget("steps", 3.0, on_cost=0.4)
    kinds = []
    for on in [False, True, True, False, True, False, False]:
        if not b.left():
            break
        assert b.progress() == pytest.approx(sum(0.4 if k else 1.0 for k in kinds) / 3.0)
        kinds.append(on)
        b.charge(on)
    assert kinds == [False, True, True, False, True]  # 1 + 0.4 + 0.4 + 1 + 0.4 = 3.2 >= 3 stops it
    off = bench.Budget("steps", 2.0)  # the off-policy arm needs no on-policy charge
    off.charge(False)
    off.charge(False)
    assert not off.left()
    with pytest.raises(ValueError, match="on-cost"):
        bench.Budget("steps", 3.0).charge(True)
    with pytest.raises(SystemExit):  # the CLI names the missing flag
        bench.parse_args(["--clock", "steps", "--arms", "mix", "--off-json", "x"])


def test_step_clock_arm_is_reproducible_and_spends_its_budget():
    """--clock steps: an arm rerun with the same seed gives the same numbers (nothing depends on the load),
    and the mix takes as many data and on-policy steps as the charge allows."""
    bench = _bench()
    teacher, student = _pair()
    tok = tiny_tokenizer()
    data = _tiny_data()
    common = ["--clock", "steps", "--budget", "6", "--prompt", "4", "--gen", "4", "--batch", "2", "--schedule",
              "cosine", "--warmup", "1", "--eval-blocks", "4", "--eval-prompts", "4"]
    args = bench.parse_args(common + ["--on-cost", "0.5", "--fraction", "0.5", "--gen-rows", "1"])
    prompts = bench.eval_windows(data.eval, args.prompt, args.eval_prompts)
    torch.set_num_threads(1)
    rows = [bench.run_arm("mix", 0.5, args, teacher, student, tok, data, prompts) for _ in range(2)]
    keep = ("steps", "on_steps", "off_steps", "ppl", "own_rkl", "own_rkl_se")
    assert {k: rows[0][k] for k in keep} == {k: rows[1][k] for k in keep}
    assert rows[0]["off_steps"] + 0.5 * rows[0]["on_steps"] >= 6 > rows[0]["off_steps"] + 0.5 * rows[0]["on_steps"] - 1
    assert rows[0]["on_steps"] > 0 and rows[0]["off_steps"] > 0
    off = bench.run_arm("off", 0.0, bench.parse_args(common + ["--arms", "off"]), teacher, student, tok, data, prompts)
    assert off["steps"] == off["off_steps"] == 6 and off["on_steps"] == 0
    assert off["ppl"] != rows[0]["ppl"]  # the rollouts changed the student


def test_project_conflict_removes_only_a_conflicting_component():
    """--project: g <- g - (g.r / |r|^2) r when g.r < 0 (PCGrad), over all tensors at once; untouched otherwise."""
    bench = _bench()
    g = torch.Generator().manual_seed(0)
    shapes = [(3, 4), (5,), (2, 2, 2)]
    ref = [torch.randn(s, generator=g) for s in shapes]
    for sign in (-1.0, 1.0):
        params = [torch.zeros(s, requires_grad=True) for s in shapes]
        grads = [sign * r + 0.3 * torch.randn(s, generator=g) for r, s in zip(ref, shapes)]
        for p, gr in zip(params, grads):
            p.grad = gr.clone()
        flat_g, flat_r = torch.cat([x.flatten() for x in grads]).double(), torch.cat([x.flatten() for x in ref]).double()
        cos = bench.project_conflict(params, ref)
        assert cos == pytest.approx(float(flat_g @ flat_r / (flat_g.norm() * flat_r.norm())), rel=1e-5)
        want = flat_g - (flat_g @ flat_r) / (flat_r @ flat_r) * flat_r if sign < 0 else flat_g
        got = torch.cat([p.grad.flatten() for p in params]).double()
        assert torch.allclose(got, want, atol=1e-5)
        if sign < 0:
            assert abs(float(got @ flat_r)) < 1e-4  # what is left no longer points against the reference
    params = [torch.zeros(s, requires_grad=True) for s in shapes]
    for p, r in zip(params, ref):
        p.grad = -r.clone()
    assert bench.project_conflict(params, ref, apply=False) == pytest.approx(-1.0, abs=1e-6)
    assert all(torch.equal(p.grad, -r) for p, r in zip(params, ref))  # measured, not applied
    assert math.isnan(bench.project_conflict(params, [None] * len(params)))  # no reference yet


def test_projected_arms_run_the_same_steps_and_change_the_student_when_rollouts_conflict():
    """--project data / momentum: the same steps as none; on this pair rollouts conflict, and the projection then
    changes the trained student (that it leaves a non-conflicting gradient alone is
    test_project_conflict_removes_only_a_conflicting_component's)."""
    bench = _bench()
    teacher, student = _pair()
    tok = tiny_tokenizer()
    data = _tiny_data()
    common = ["--clock", "steps", "--budget", "6", "--prompt", "4", "--gen", "4", "--batch", "2", "--eval-blocks", "4",
              "--eval-prompts", "4", "--on-cost", "0.5", "--fraction", "0.5", "--gen-rows", "1"]
    prompts = bench.eval_windows(data.eval, 4, 4)
    torch.set_num_threads(1)
    rows = {how: bench.run_arm("mix", 0.5, bench.parse_args(common + ["--project", how]), teacher, student, tok, data,
                               prompts) for how in ("none", "data", "momentum")}
    for how, row in rows.items():
        assert (row["steps"], row["on_steps"]) == (rows["none"]["steps"], rows["none"]["on_steps"])
        assert -1 <= row["rollout_cos"] <= 1, how
        if how != "none":
            assert row["rollout_conflicts"] > 0, how  # the tiny pair conflicts: the projection is exercised
            assert row["ppl"] != rows["none"]["ppl"], how


def _trained_state(bench, tmp_path, student, extra: list[str], fraction: float) -> dict[str, torch.Tensor]:
    """Run one tiny arm with ``--save`` and return the trained student's state dict."""
    teacher, tok, data = _pair()[0], tiny_tokenizer(), _tiny_data()
    save = tmp_path / "_".join(extra + [str(fraction)])
    common = ["--clock", "steps", "--budget", "4", "--prompt", "4", "--gen", "4", "--batch", "2", "--eval-blocks", "4",
              "--eval-prompts", "4", "--on-cost", "1", "--gen-rows", "1", "--save", str(save)]
    torch.set_num_threads(1)
    bench.run_arm("mix", fraction, bench.parse_args(common + extra), teacher, student, tok, data,
                  bench.eval_windows(data.eval, 4, 4))
    return torch.load(next(save.iterdir()))


def test_on_params_picks_which_side_of_the_decoder_layers_the_rollout_steps_move(tmp_path):
    """--on-params blocks: rollout steps move only the decoder layers; head: only what lies outside them
    (embeddings, final norm, head); all (the default) moves everything."""
    bench = _bench()
    student = _pair()[1]
    before = {k: v.clone() for k, v in student.state_dict().items()}
    outside = {k for k in before if ".layers." not in k}
    assert outside and outside != set(before)  # the tiny model has parameters on both sides
    for how in ("blocks", "head", "all"):
        after = _trained_state(bench, tmp_path, student, ["--on-params", how], fraction=1.0)
        moved = {k for k in before if not torch.equal(before[k], after[k])}
        assert bool(moved & outside) == (how != "blocks"), (how, moved & outside)
        assert bool(moved - outside) == (how != "head"), (how, moved - outside)


def test_on_opt_separate_keeps_its_own_adamw_state(tmp_path):
    """--on-opt separate: with only rollout steps it is the shared optimizer (one AdamW either way), while in a
    mix the rollout steps no longer share moments with the data steps, so the trained student differs."""
    bench = _bench()
    student = _pair()[1]
    only_on = [_trained_state(bench, tmp_path, student, ["--on-opt", how], fraction=1.0) for how in ("shared", "separate")]
    assert all(torch.equal(only_on[0][k], only_on[1][k]) for k in only_on[0])
    mixed = [_trained_state(bench, tmp_path, student, ["--on-opt", how], fraction=0.5) for how in ("shared", "separate")]
    assert any(not torch.equal(mixed[0][k], mixed[1][k]) for k in mixed[0])


def test_on_end_trains_the_last_share_of_the_budget_on_data_only(capsys):
    """--on-end 0.5: on-policy steps only while less than half the step budget is spent, off-policy after."""
    bench = _bench()
    teacher, student = _pair()
    tok, data = tiny_tokenizer(), _tiny_data()
    args = bench.parse_args(["--clock", "steps", "--budget", "8", "--prompt", "4", "--gen", "4", "--batch", "2",
                             "--eval-blocks", "4", "--eval-prompts", "4", "--on-cost", "0.5", "--gen-rows", "1",
                             "--fraction", "0.5", "--on-end", "0.5"])
    torch.set_num_threads(1)
    row = bench.run_arm("mix", 0.5, args, teacher, student, tok, data, bench.eval_windows(data.eval, 4, 4))
    kinds = [line.split(": ")[1].split("-")[0] for line in capsys.readouterr().out.splitlines() if " step " in line]
    spent, seen_off_after = 0.0, False
    for kind in kinds:  # the budget spent before each step decides whether it may be on-policy
        if spent >= 4:
            assert kind == "off"
            seen_off_after = True
        spent += 0.5 if kind == "on" else 1.0
    assert "on" in kinds and seen_off_after and row["on_steps"] == kinds.count("on")
    with pytest.raises(SystemExit):
        bench.parse_args(["--on-start", "0.5", "--on-end", "0.5"])


def test_sequence_rkl_returns_equal_naive_discounted_sums():
    bench = _bench()
    g = torch.Generator().manual_seed(0)
    kl, valid = torch.rand(3, 6, generator=g), torch.ones(3, 6, dtype=torch.bool)
    valid[1, 4:] = False  # a row that stopped early
    got = bench.SequenceRKL.returns(kl * valid, valid, 0.8)
    for r in range(3):
        for t in range(6):
            ref = sum(0.8 ** (s - t) * float(kl[r, s]) for s in range(t + 1, 6) if valid[r, s]) if valid[r, t] else 0.0
            assert float(got[r, t]) == pytest.approx(ref, abs=1e-6)


def test_sequence_rkl_gradient_in_expectation_is_the_sequence_level_reverse_kl_gradient():
    """Over every continuation y (exact enumeration, weighted by q(y)), the expected gradient of --on-seq's loss
    equals the gradient of J = E_q[sum_t KL_t(y_<t)] / n, whatever the (sample-independent) baseline; the
    token-level loss alone (weight 0) misses J's policy-gradient part."""
    bench = _bench()
    teacher, student = _pair()
    student.eval()  # no dropout in these models; eval only to make that explicit
    prompt, gen = [5, 7, 4], 2
    seqs = [[a, b] for a in range(VOCAB) for b in range(VOCAB)]
    params = [q for q in student.parameters()]
    ids = torch.tensor([prompt + s for s in seqs])
    # exact J / n: q(y) and each KL_t, differentiable
    log_q = student(input_ids=ids).logits[:, len(prompt) - 1: -1].log_softmax(-1)  # [seqs, gen, vocab]
    with torch.no_grad():
        log_p = teacher(input_ids=ids).logits[:, len(prompt) - 1: -1].log_softmax(-1)
    kl = (log_q.exp() * (log_q - log_p)).sum(-1)  # [seqs, gen]
    logq_y = log_q.gather(-1, torch.tensor(seqs).unsqueeze(-1)).squeeze(-1).sum(-1)  # [seqs]
    exact = torch.autograd.grad((logq_y.exp() * kl.sum(-1)).sum() / gen, params)
    weights = logq_y.detach().exp()
    assert float(weights.sum()) == pytest.approx(1.0, abs=1e-5)

    def expected_grad(weight: float) -> list[torch.Tensor]:
        seq = bench.SequenceRKL(weight, 1.0, gen, decay=1.0)  # decay 1: baseline and scale stay as set
        seq.baseline, seq.rms = torch.tensor([0.3, -0.2]), 1.0
        acc = [torch.zeros_like(q) for q in params]
        for s, w in zip(seqs, weights):
            from distill.on_policy import rollout_batch

            loss = seq.loss(student, teacher, rollout_batch([prompt], [s], 0))[0]
            for a, gr in zip(acc, torch.autograd.grad(loss, params)):
                a.add_(gr, alpha=float(w))
        return acc

    def rel(a, b):
        num = sum(float((x - y).square().sum()) for x, y in zip(a, b))
        return math.sqrt(num / sum(float(y.square().sum()) for y in b))

    assert rel(expected_grad(1.0), exact) < 1e-4
    assert rel(expected_grad(0.0), exact) > 0.01  # 0.033 here: one later position, small but far above 1e-4


def test_on_max_entropy_keeps_only_positions_where_the_teacher_is_sure():
    """--on-max-entropy: the rollout loss is the mean token-level reverse KL over the generated positions whose
    teacher entropy is below the cap (naive per-position loop), with the matching gradient; no cap keeps all."""
    bench = _bench()
    teacher, student = _pair()
    student.eval()
    prompts, conts, batch = _rollout_rows()
    params = list(student.parameters())

    def naive(cap: float) -> tuple[torch.Tensor, int, list[float]]:
        """Each generated position's KL and teacher entropy from its own prefix; the mean KL where entropy < cap."""
        positions = _naive_positions(student, teacher, prompts, conts)
        terms = [kl for kl, ent in positions if ent < cap]
        return torch.stack(terms).mean(), len(terms), [ent for _, ent in positions]

    uncapped = naive(math.inf)  # every position, and each one's teacher entropy
    ents = uncapped[2]
    cap = statistics.median(ents)  # a cap between the positions' teacher entropies, so some are dropped
    for limit, kept in ((cap, sum(e < cap for e in ents)), (math.inf, len(ents))):
        ref, n, _ = naive(limit) if limit < math.inf else uncapped
        assert n == kept and 0 < n
        got = bench.SequenceRKL(0.0, 1.0, 5, max_entropy=limit).loss(student, teacher, batch)[0]
        assert float(got.detach()) == pytest.approx(float(ref.detach()), rel=1e-5)
        for a, b in zip(torch.autograd.grad(got, params), torch.autograd.grad(ref, params)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert sum(e < cap for e in ents) < len(ents)
    with pytest.raises(SystemExit):
        bench.parse_args(["--on-max-entropy", "0"])


def test_on_teacher_temp_teaches_the_rollouts_the_teachers_tempered_distribution():
    """--on-teacher-temp: the rollout loss is the mean reverse KL to softmax(teacher logits / T), the student's at
    T = 1 (naive per-position loop), with the matching gradient; at T = 1 it is the plain reverse KL."""
    bench = _bench()
    teacher, student = _pair()
    student.eval()
    prompts, conts, batch = _rollout_rows()
    params = list(student.parameters())
    losses = {}
    for temp in (1.0, 0.7):
        ref = torch.stack([kl for kl, _ in _naive_positions(student, teacher, prompts, conts, temp)]).mean()
        got = bench.SequenceRKL(0.0, 1.0, 5, teacher_temp=temp).loss(student, teacher, batch)[0]
        assert float(got.detach()) == pytest.approx(float(ref.detach()), rel=1e-5)
        for a, b in zip(torch.autograd.grad(got, params), torch.autograd.grad(ref, params)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
        losses[temp] = float(got.detach())
    assert losses[0.7] != pytest.approx(losses[1.0], rel=1e-3)  # the temperature reaches the loss
    with pytest.raises(SystemExit):
        bench.parse_args(["--on-teacher-temp", "0", "--on-kind", "reverse_kl"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--on-teacher-temp", "0.8"])  # the default divergence is forward KL


def test_on_prompt_grad_keeps_the_loss_and_scales_only_the_prompts_path():
    """--on-prompt-grad 0: the same loss as the full forward; its gradient equals the full forward's with every
    layer's keys and values at the prompt positions (but the last, whose logit predicts the first generated token)
    detached, the only way those positions reach the loss, and differs from the full gradient. --on-prompt-grad S:
    the gradient is the detached one plus S times the prompt's part (full minus detached), the loss unchanged."""
    bench = _bench()
    teacher, student = _pair()
    student.eval()
    batch = _rollout_rows()[2]
    params = list(student.parameters())
    cut = 3  # positions 0..2 are constants; position 3 (the prompt's last token) predicts the first generated one

    def detach_prompt(_module, _inputs, out):  # k_proj / v_proj output [rows, seq, kv_heads * head_dim]
        return torch.cat([out[:, :cut].detach(), out[:, cut:]], 1)

    full = bench.SequenceRKL(0.0, 1.0, 5).loss(student, teacher, batch)[0]
    hooks = [proj.register_forward_hook(detach_prompt) for layer in student.model.layers
             for proj in (layer.self_attn.k_proj, layer.self_attn.v_proj)]
    try:
        ref = bench.SequenceRKL(0.0, 1.0, 5).loss(student, teacher, batch)[0]
    finally:
        for h in hooks:
            h.remove()
    got = bench.SequenceRKL(0.0, 1.0, 5, prompt_grad=0.0).loss(student, teacher, batch)[0]
    assert float(got.detach()) == pytest.approx(float(full.detach()), rel=1e-5)
    g_got, g_ref, g_full = (torch.autograd.grad(x, params) for x in (got, ref, full))
    for a, b in zip(g_got, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert max(float((a - b).abs().max()) for a, b in zip(g_got, g_full)) > 1e-4
    for scale in (0.5, 2.0):
        got = bench.SequenceRKL(0.0, 1.0, 5, prompt_grad=scale).loss(student, teacher, batch)[0]
        assert float(got.detach()) == pytest.approx(float(full.detach()), rel=1e-5)
        for a, d, f in zip(torch.autograd.grad(got, params), g_ref, g_full):
            torch.testing.assert_close(a, d + scale * (f - d), rtol=1e-4, atol=1e-6)
    assert not any(m._forward_hooks for m in student.modules())  # the scaling hooks are gone after the loss
    with pytest.raises(SystemExit):
        bench.parse_args(["--on-prompt-grad", "0"])  # the default divergence is forward KL
    with pytest.raises(SystemExit):
        bench.parse_args(["--on-prompt-grad", "-1", "--on-kind", "reverse_kl"])


def test_bench_rollout_loss_trains_like_the_recipes_and_its_options_change_the_student(tmp_path):
    """Rollout steps through the bench's own loss (SequenceRKL, forced by a cap no position reaches) train the same
    student as the recipe's OnPolicy path; --on-teacher-temp and --on-prompt-grad run end to end and change it."""
    bench = _bench()
    student = _pair()[1]
    rkl = ["--on-kind", "reverse_kl"]
    recipe = _trained_state(bench, tmp_path, student, rkl, fraction=1.0)
    own = _trained_state(bench, tmp_path, student, rkl + ["--on-max-entropy", "1e9"], fraction=1.0)
    for k in recipe:
        torch.testing.assert_close(own[k], recipe[k], rtol=1e-4, atol=1e-5)
    for extra in (["--on-teacher-temp", "0.5"], ["--on-prompt-grad", "0"], ["--on-prompt-grad", "3"]):
        other = _trained_state(bench, tmp_path, student, rkl + extra, fraction=1.0)
        assert any(not torch.allclose(other[k], recipe[k], rtol=1e-4, atol=1e-5) for k in recipe), extra


def test_on_joint_makes_one_update_of_the_clipped_data_and_rollout_gradients(monkeypatch):
    """--on-joint: each on-policy step is the data step the off-policy arm takes there (the same gradient, clipped to
    1) plus a rollout gradient clipped to --on-clip, summed into one AdamW update and charged 1 + --on-cost; with
    --project data the rollout gradient is projected off that same data gradient."""
    bench = _bench()
    teacher, student = _pair()
    tok, data = tiny_tokenizer(), _tiny_data()
    clipped: list[list[torch.Tensor]] = []  # each clip call's gradients after clipping
    stepped: list[list[torch.Tensor]] = []  # the gradients each optimizer step applied
    clip, adam_step = torch.nn.utils.clip_grad_norm_, torch.optim.AdamW.step

    def record_clip(parameters, max_norm, *a, **k):
        parameters = [q for q in parameters if q.grad is not None]
        norm = clip(parameters, max_norm, *a, **k)
        clipped.append([q.grad.detach().clone() for q in parameters])
        return norm

    def record_step(self, *a, **k):
        stepped.append([q.grad.detach().clone() for g in self.param_groups for q in g["params"] if q.grad is not None])
        return adam_step(self, *a, **k)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", record_clip)
    monkeypatch.setattr(torch.optim.AdamW, "step", record_step)
    common = ["--clock", "steps", "--prompt", "4", "--gen", "4", "--batch", "2", "--eval-blocks", "4",
              "--eval-prompts", "4", "--gen-rows", "1", "--seed", "4"]  # seed 4: rollout and data gradients conflict
    prompts = bench.eval_windows(data.eval, 4, 4)
    torch.set_num_threads(1)
    bench.run_arm("off", 0.0, bench.parse_args(common + ["--budget", "1", "--arms", "off"]), teacher, student, tok,
                  data, prompts)
    off_data = clipped[0]
    clipped.clear(), stepped.clear()
    args = bench.parse_args(common + ["--budget", "6", "--on-cost", "0.5", "--fraction", "1", "--on-joint",
                                      "--on-clip", "0.5", "--project", "data"])
    row = bench.run_arm("mix", 1.0, args, teacher, student, tok, data, prompts)
    assert row["steps"] == row["on_steps"] == row["off_steps"] == 4  # 4 × (1 + 0.5) = 6
    assert row["rollout_conflicts"] > 0  # so the projection below had something to remove
    assert len(clipped) == 2 * len(stepped) == 8
    for i, applied in enumerate(stepped):
        d, r = clipped[2 * i], clipped[2 * i + 1]
        assert math.sqrt(sum(float(g.pow(2).sum()) for g in d)) <= 1 + 1e-5
        assert math.sqrt(sum(float(g.pow(2).sum()) for g in r)) <= 0.5 + 1e-5
        assert sum(float((a * b).sum()) for a, b in zip(d, r)) >= -1e-6  # no conflicting component left
        for got, a, b in zip(applied, d, r):
            torch.testing.assert_close(got, a + b)
    for a, b in zip(clipped[0], off_data):  # the first data part is the off-policy arm's first step
        torch.testing.assert_close(a, b)
    with pytest.raises(SystemExit):
        bench.parse_args(["--on-joint", "--on-opt", "separate"])


def test_ce_weight_sets_both_arms_data_loss_and_must_match_to_compare(tmp_path, monkeypatch, capsys):
    """--ce-weight reaches the data loss of the arm (the recipe's ce_weight); --compare refuses arms trained with
    different weights and reads logs older than the key as weight 1."""
    import distill.model

    bench = _bench()
    seen = []
    real = distill.model.LossConfig

    def spy(**kw):
        seen.append(kw["ce_weight"])
        return real(**kw)

    monkeypatch.setattr(distill.model, "LossConfig", spy)
    teacher, student = _pair()
    tok, data = tiny_tokenizer(), _tiny_data()
    args = bench.parse_args(["--clock", "steps", "--budget", "1", "--batch", "2", "--prompt", "4", "--gen", "4",
                             "--eval-blocks", "4", "--eval-prompts", "4", "--arms", "off", "--ce-weight", "0"])
    bench.run_arm("off", 0.0, args, teacher, student, tok, data, bench.eval_windows(data.eval, 4, 4))
    assert seen == [0.0]
    with pytest.raises(SystemExit):
        bench.parse_args(["--ce-weight", "-1"])
    off = _log(tmp_path, "off.log", init=None, off_policy=_arm(60.0, 1.25, 0.025, 0))  # no ce_weight: an older log
    mix = _log(tmp_path, "mix.log", ce_weight=1.0, on_policy=_arm(61.8, 1.10, 0.022, 2))
    assert bench.compare(off, mix, emit_json=False)["ce_weight"] == 1.0
    kd_only = _log(tmp_path, "kd.log", ce_weight=0.0, on_policy=_arm(61.8, 1.10, 0.022, 2))
    with pytest.raises(SystemExit, match="differ in ce_weight"):
        bench.compare(off, kd_only)


def test_on_gen_sets_the_training_rollouts_length_and_the_eval_keeps_gen(tmp_path, monkeypatch):
    """--on-gen: the training rollouts generate that many tokens; the eval's continuations keep --gen, so arms
    with different rollout lengths are measured alike (and --compare accepts them as a pair)."""
    import distill.on_policy

    bench = _bench()
    lengths, eval_lengths = [], []
    real_settings, real_eval = distill.on_policy.OnPolicySettings, bench.own_continuation_rkl

    def spy_settings(**kw):
        lengths.append(kw["max_new_tokens"])
        return real_settings(**kw)

    def spy_eval(student, teacher, tokenizer, prompts, new_tokens, *a, **k):
        eval_lengths.append(new_tokens)
        return real_eval(student, teacher, tokenizer, prompts, new_tokens, *a, **k)

    monkeypatch.setattr(distill.on_policy, "OnPolicySettings", spy_settings)
    monkeypatch.setattr(bench, "own_continuation_rkl", spy_eval)
    teacher, student = _pair()
    tok, data = tiny_tokenizer(), _tiny_data()
    generated = []
    real_generate = distill.on_policy.OnPolicy.generate

    def spy_generate(self, *a, **k):
        out = real_generate(self, *a, **k)
        generated.append(int(out["labels"].ne(-100).sum(dim=1).max()))  # tokens the loss sees per row
        return out

    monkeypatch.setattr(distill.on_policy.OnPolicy, "generate", spy_generate)
    args = bench.parse_args(["--clock", "steps", "--budget", "2", "--on-cost", "1", "--fraction", "1", "--batch", "2",
                             "--prompt", "4", "--gen", "6", "--on-gen", "3", "--gen-rows", "1", "--eval-blocks", "4",
                             "--eval-prompts", "4"])
    torch.set_num_threads(1)
    row = bench.run_arm("mix", 1.0, args, teacher, student, tok, data, bench.eval_windows(data.eval, 4, 4))
    assert row["on_steps"] == 2
    assert lengths == [3] and eval_lengths == [6]
    assert generated and max(generated) == 3  # at most 3 (a row may stop early)
    with pytest.raises(SystemExit):
        bench.parse_args(["--on-gen", "0"])
    off = _log(tmp_path, "off.log", init=None, off_policy=_arm(60.0, 1.25, 0.025, 0))  # an older log: no on_gen
    mix = _log(tmp_path, "mix.log", on_gen=32, on_policy=_arm(61.8, 1.10, 0.022, 2))
    out = bench.compare(off, mix, emit_json=False)
    assert out["on_gen"] == 32 and "rollout tokens 32" in bench.mix_label(out)


def test_teacher_corrected_replaces_exactly_the_generated_tokens_outside_the_teachers_top_k():
    """--on-correct: against a naive loop over positions, only generated tokens the teacher does not rank in its top
    K change, each to a token of the teacher's support; the prompt and padding stay as they were."""
    bench = _bench()
    teacher = _pair()[0]
    prompts, conts, batch = _rollout_rows()
    with torch.no_grad():
        logits = teacher(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    for k in (1, 3, VOCAB):
        got, n = bench.teacher_corrected(batch, teacher, k, torch.Generator().manual_seed(0))
        expect = 0
        for r, (p, c) in enumerate(zip(prompts, conts)):
            for j in range(len(c)):
                t = len(p) + j  # the generated token's position; logits[t - 1] predict it
                top = set(logits[r, t - 1].topk(k).indices.tolist())
                if c[j] in top:
                    assert got["input_ids"][r, t] == c[j] and got["labels"][r, t] == c[j]
                else:
                    expect += 1
                    assert got["input_ids"][r, t] == got["labels"][r, t] != -100
            assert got["input_ids"][r, :len(p)].tolist() == p
        assert n == expect
        assert torch.equal(got["labels"] == -100, batch["labels"] == -100)
        assert torch.equal(got["input_ids"][batch["attention_mask"] == 0], batch["input_ids"][batch["attention_mask"] == 0])
    assert bench.teacher_corrected(batch, teacher, VOCAB, torch.Generator())[1] == 0  # top-V holds every token
    assert bench.teacher_corrected(batch, teacher, 1, torch.Generator())[1] > 0  # the tiny teacher disagrees somewhere


def test_on_correct_trains_on_the_teacher_vetted_rollouts(tmp_path):
    """--on-correct K reaches the rollout steps: K = the vocabulary replaces nothing and trains the same student as
    no vetting; K = 1 replaces tokens (its share is logged) and trains another; a negative K is refused."""
    bench = _bench()
    student = _pair()[1]
    rkl = ["--on-kind", "reverse_kl"]
    plain = _trained_state(bench, tmp_path, student, rkl, fraction=1.0)
    whole = _trained_state(bench, tmp_path, student, rkl + ["--on-correct", str(VOCAB)], fraction=1.0)
    for k in plain:
        torch.testing.assert_close(whole[k], plain[k], rtol=0, atol=0)
    vetted = _trained_state(bench, tmp_path, student, rkl + ["--on-correct", "1"], fraction=1.0)
    assert any(not torch.allclose(vetted[k], plain[k], rtol=1e-4, atol=1e-5) for k in plain)
    assert bench.mix_label({"fraction": 0.2, "on_correct": 5}) == "λ0.2 teacher top-5"  # the compare table names it
    with pytest.raises(SystemExit):
        bench.parse_args(["--on-correct", "-1"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--on-correct", "5", "--on-seq", "0.5", "--on-kind", "reverse_kl"])


def test_ema_scores_the_moving_average_of_the_weight_trajectory(tmp_path):
    """--ema d: the arm's saved (and scored) weights are e_t = d e_(t-1) + (1 - d) w_t over the steps, from the
    starting weights, with w_t from runs of 1..4 steps (constant lr: each a prefix of the next); --ema 0 is the
    last weights, and a decay outside [0, 1) is refused."""
    bench = _bench()
    student = _pair()[1]
    start = {k: v.clone() for k, v in student.state_dict().items()}
    path = [_trained_state(bench, tmp_path, student, ["--budget", str(n)], fraction=0.0) for n in (1, 2, 3, 4)]
    decay = 0.6
    expect = {k: v.clone() for k, v in start.items()}
    for weights in path:
        for k in expect:
            expect[k] = decay * expect[k] + (1 - decay) * weights[k]
    got = _trained_state(bench, tmp_path, student, ["--ema", str(decay)], fraction=0.0)
    moved = [k for k in start if not torch.equal(start[k], path[-1][k])]
    assert moved  # the steps moved the weights, so the average differs from the last ones
    for k in start:
        torch.testing.assert_close(got[k], expect[k], rtol=1e-5, atol=1e-6)
    assert any(not torch.allclose(got[k], path[-1][k], rtol=1e-4, atol=1e-5) for k in moved)
    last = _trained_state(bench, tmp_path, student, ["--ema", "0"], fraction=0.0)
    for k in start:
        torch.testing.assert_close(last[k], path[-1][k], rtol=0, atol=0)
    assert bench.mix_label({"fraction": 0.2, "ema": 0.9}) == "λ0.2 EMA 0.9"
    for bad in ("1", "-0.1"):
        with pytest.raises(SystemExit):
            bench.parse_args(["--ema", bad])
