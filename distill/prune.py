"""Structured pruning by importance (depth + width, Minitron-style) and a prune → short-distill search.

    python -m distill.prune --model smollm2-135m-instruct --target-ratio 0.33 --out runs/pruned
    python -m distill.prune --model DIR --target-params 36e6 --axes depth,mlp --search-steps 20 --out DIR2

How a student is cut decides how far distillation can take it. This module scores every prunable
unit of a Llama / Mistral / Qwen2 teacher from calibration forward passes (no gradients):

* **blocks** — block influence (ShortGPT): ``BI = 1 − E[cos(x_in, x_out)]`` of each decoder layer;
  a block that barely turns the residual stream matters little;
* **attention heads** — the mean L2 norm of each query head's contribution to the residual stream
  (its slice of the attention output through its columns of ``o_proj``); a KV group scores the sum
  of the query heads kept in it, so grouped-query attention stays valid: whole KV groups go, and
  every group keeps the same number of query heads;
* **MLP neurons** — mean ``|act(gate)·up|`` times the norm of the neuron's ``down_proj`` column;
* **hidden channels** — mean ``|x_c|`` of every RMSNorm output (both norms of every layer and the
  final norm). A channel is cut from the embeddings, every norm, every projection and the head alike;
  tied embeddings stay tied.

The search enumerates architectures with uniform per-layer widths (so the result is a plain HF
config) within ±3 % of the budget, prunes each from the scores, ranks them by held-out KL to the
teacher (successive halving: every candidate on one block, the best on ``eval_blocks``), short-
distills the best ``top_k`` with the toolkit's own ``DistillModel`` and picks the winner by held-out
KL after that (rankings flip after light retraining: Minitron). ``iterative`` cuts at most
``max_round_cut`` of the current size per round and distills between rounds (ModelOpt's advice for
cuts beyond ~50 %).

**Budget.** Counted as *non-embedding* parameters by default (decoder layers + final norm; the
embeddings and head scale with the vocabulary, not with the architecture). ``count_embeddings``
counts everything. Both numbers are always printed.

**Output.** An HF directory loading with ``AutoModelForCausalLM.from_pretrained``. Its config holds
``distill_kept_layers`` (so the ``"derived"`` hidden-state map pairs student and teacher layers) and
``distill_pruning``: kept layers, channels, query / KV heads and neurons (teacher indices), the
method and the calibration data. ``DistillModel`` starts the hidden-state projector of a
width-pruned student as the channel scatter of the kept channels.

**Memory.** Calibration is a plain forward pass under ``no_grad`` with hooks that fold each layer's
statistics into running sums (``[hidden]``, ``[heads]``, ``[intermediate]`` per layer) as it runs:
peak ≈ the model + one layer's activations for one micro-batch (+ one head's ``[batch, seq, hidden]``
contribution). ``distill.plan.calibration_bytes`` gives the estimate that ``python -m distill.plan`` prints.
A 17B-class teacher is calibrated either on one 80 GB GPU in bf16 (``--dtype bf16 --device cuda``; for
the planner's ``deepseek-17b`` preset 25.6 GiB of weights + 1 GiB of activations at 1×4096 tokens, as
``python -m distill.plan --config recipes/configs/deepseek_17b_to_7b.yaml`` prints), or, on smaller GPUs, with the teacher
loaded through accelerate's ``device_map="auto"`` offload (``--offload``): accelerate moves each
layer's weights onto the GPU when its forward runs, the hooks and the candidates read offloaded weights
through accelerate's hooks (``align_module_device``; they sit on ``meta`` in between), and GPU memory is
one layer's weights + activations. Candidates of a 17B teacher are then built on CPU and evaluated one
at a time; the search cost is dominated by the ``top_k × search_steps`` distillation steps.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import align_module_device
from torch import nn
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from attention.integration import SUPPORTED_MODEL_TYPES as SUPPORTED
from core import checkpoint as ckpt
from core.config import ConfigError
from core.fsio import is_saved_model, replace_dir, restore_aside
from core.models import load_causal_lm, load_tokenizer, peek_config, resolve_device, resolve_dtype
from distill.config import DistillConfig
from distill.data import BlockOrder, build_data, parse_sources
from distill.model import DistillModel, LossConfig
from distill.plots import plot_search
from distill.student import KEPT_KEY, PRUNE_KEY, cast_params
from distill.training import target_count, warmup_cosine
from eval.metrics import LMStats, batch_stats

AXES = ("depth", "mlp", "heads", "hidden")
RECORD_KEY = PRUNE_KEY
TOLERANCE = 0.03


class PruneError(ConfigError):
    """A pruning request that cannot be met; the message names the feasible choice."""


# --------------------------------------------------------------------------------------------
# Shapes and parameter counts
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Arch:
    """A uniform-width decoder shape: every layer has the same widths (a plain HF config)."""
    layers: int
    hidden: int
    kv_heads: int
    group: int  # query heads per KV head
    intermediate: int

    @property
    def heads(self) -> int:
        return self.kv_heads * self.group

    def label(self) -> str:
        return f"L{self.layers} h{self.hidden} q{self.heads}/kv{self.kv_heads} mlp{self.intermediate}"


@dataclass(frozen=True)
class Family:
    """What does not change under pruning: head size, vocabulary, biases, tying."""
    head_dim: int
    vocab: int
    tied: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    heads_divide_hidden: bool = False  # the config class refuses a hidden size no multiple of the heads (Llama)

    def accepts(self, hidden: int, heads: int) -> bool:
        """Whether the config class takes this hidden size and query-head count."""
        return not (self.heads_divide_hidden and hidden % heads)

    def counts(self, a: Arch) -> tuple[int, int]:
        """``(non_embedding, embedding)`` parameter counts of ``a``."""
        q, kv = a.heads * self.head_dim, a.kv_heads * self.head_dim
        attn = a.hidden * (q + 2 * kv) + q * a.hidden
        attn += (q + 2 * kv) * self.qkv_bias + a.hidden * self.o_bias
        mlp = 3 * a.hidden * a.intermediate + (2 * a.intermediate + a.hidden) * self.mlp_bias
        per_layer = attn + mlp + 2 * a.hidden
        emb = self.vocab * a.hidden * (1 if self.tied else 2)
        return a.layers * per_layer + a.hidden, emb


def check_supported(model: PreTrainedModel) -> None:
    kind = getattr(model.config, "model_type", type(model).__name__)
    if kind not in SUPPORTED or not isinstance(getattr(getattr(model, "model", None), "layers", None), nn.ModuleList):
        raise PruneError(f"architecture '{kind}' is not supported for pruning; use one of {', '.join(SUPPORTED)} "
                         "(DeepSeek-LLM is Llama)")


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _heads_divide_hidden(config) -> bool:
    """Whether ``config``'s class refuses a hidden size that is no multiple of the query heads even with
    ``head_dim`` given (transformers' ``LlamaConfig``, on init and on save): such a student saves and loads nowhere."""
    def accepts(hidden: int) -> bool:
        try:
            type(config)(hidden_size=hidden, num_attention_heads=2, num_key_value_heads=1, head_dim=2,
                         intermediate_size=4)
        except Exception:  # huggingface_hub's StrictDataclassClassValidationError is no ValueError
            return False
        return True
    return accepts(4) and not accepts(3)


def family_of(model: PreTrainedModel) -> Family:
    c = model.config
    attn = model.model.layers[0].self_attn
    mlp = model.model.layers[0].mlp
    return Family(head_dim=head_dim_of(c), vocab=c.vocab_size, tied=bool(getattr(c, "tie_word_embeddings", False)),
                  qkv_bias=attn.q_proj.bias is not None, o_bias=attn.o_proj.bias is not None,
                  mlp_bias=mlp.down_proj.bias is not None, heads_divide_hidden=_heads_divide_hidden(c))


def arch_of(model: PreTrainedModel) -> Arch:
    c = model.config
    return Arch(layers=c.num_hidden_layers, hidden=c.hidden_size, kv_heads=c.num_key_value_heads,
                group=c.num_attention_heads // c.num_key_value_heads, intermediate=c.intermediate_size)


def count_params(model: PreTrainedModel) -> tuple[int, int]:
    """``(non_embedding, embedding)`` of a real model, counting tied weights once."""
    seen, emb, total = set(), 0, 0
    embed_ids = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        if id(p) in embed_ids:
            emb += p.numel()
    return total - emb, emb


# --------------------------------------------------------------------------------------------
# Importance from calibration passes
# --------------------------------------------------------------------------------------------

@dataclass
class Scores:
    """Importance of every prunable unit (higher = keep). Tensors are fp32 on CPU."""
    blocks: torch.Tensor  # [layers] block influence, or loss increase when skipped (block_score="loss")
    heads: torch.Tensor  # [layers, kv_heads, group] query-head contribution norm
    neurons: torch.Tensor  # [layers, intermediate]
    channels: torch.Tensor  # [hidden]
    tokens: int = 0


def _first(x):
    return x[0] if isinstance(x, tuple) else x


def input_device(model: PreTrainedModel) -> torch.device:
    """Where ``model``'s input ids go: its first parameter's device, or, when accelerate offloaded that
    parameter (``device_map`` with ``"cpu"`` / ``"disk"`` entries leaves it on ``meta``), the device
    accelerate runs the embeddings on."""
    device = next(model.parameters()).device
    if device.type != "meta":
        return device
    run_on = getattr(getattr(model.get_input_embeddings(), "_hf_hook", None), "execution_device", None)
    return torch.device(run_on) if run_on is not None else torch.device("cpu")


BLOCK_SCORES = ("bi", "loss")


@torch.no_grad()
def block_loss_increase(model: PreTrainedModel, blocks: torch.Tensor, batch_size: int = 4,
                        progress: bool = True) -> torch.Tensor:
    """``[layers]``: mean next-token CE on ``blocks`` ``[n, seq]`` with each decoder layer skipped, minus the
    full model's.

    A skipped layer passes its input through unchanged (a forward hook replaces its output), which is
    exactly the model with that layer deleted. One forward per layer per micro-batch: ``layers + 1``
    times the cost of block influence, and it measures what pruning the block does to the loss rather
    than how much the block turns the residual stream (a block can turn it a lot and matter little).
    """
    check_supported(model)
    layers = model.model.layers
    device = input_device(model)
    skip: list[int | None] = [None]
    seen: dict[int, torch.Tensor] = {}

    def pre(i):
        def hook(_m, args, kwargs):
            if skip[0] == i:
                seen[i] = args[0] if args else kwargs["hidden_states"]
        return hook

    def post(i):
        def hook(_m, _args, _kwargs, out):
            if skip[0] != i:
                return None
            x = seen.pop(i)
            return (x, *out[1:]) if isinstance(out, tuple) else x
        return hook

    handles = [h for i, layer in enumerate(layers)
               for h in (layer.register_forward_pre_hook(pre(i), with_kwargs=True),
                         layer.register_forward_hook(post(i), with_kwargs=True))]
    was = model.training
    model.eval()
    losses = torch.zeros(len(layers) + 1, dtype=torch.float64)  # [layers + 1]; the last: nothing skipped
    try:
        for j in tqdm(range(len(layers) + 1), desc="skip blocks", disable=not progress, leave=False):
            skip[0] = j if j < len(layers) else None
            for s in range(0, blocks.shape[0], batch_size):
                ids = blocks[s:s + batch_size].to(device)
                logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
                losses[j] += nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                         ids[:, 1:].reshape(-1), reduction="sum").double().cpu()
    finally:
        for h in handles:
            h.remove()
        model.train(was)
    n = max(blocks.shape[0] * (blocks.shape[1] - 1), 1)
    return ((losses[:-1] - losses[-1]) / n).float()


@torch.no_grad()
def importance(model: PreTrainedModel, blocks: torch.Tensor, batch_size: int = 4,
               progress: bool = True, block_score: str = "bi") -> Scores:
    """Score heads, neurons, channels and blocks of ``model`` over calibration ``blocks`` ``[n, seq]``.

    One forward per micro-batch; hooks fold every layer's statistics into running sums while the
    layer runs, so nothing bigger than one layer's activations is ever held. ``block_score="loss"``
    scores blocks by the loss increase when each is skipped (``block_loss_increase``) instead of
    block influence.
    """
    if block_score not in BLOCK_SCORES:
        raise PruneError(f"block_score must be one of {', '.join(BLOCK_SCORES)}, got {block_score!r}")
    check_supported(model)
    c = model.config
    L, H, KV, hd, inter = (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, head_dim_of(c),
                           c.intermediate_size)
    layers = model.model.layers
    bi = torch.zeros(L, dtype=torch.float64)
    heads = torch.zeros(L, H, dtype=torch.float64)
    neurons = torch.zeros(L, inter, dtype=torch.float64)
    channels = torch.zeros(c.hidden_size, dtype=torch.float64)
    tokens = [0]
    inputs: dict[int, torch.Tensor] = {}
    handles = []

    def layer_pre(i):
        def hook(_m, args, kwargs):
            inputs[i] = args[0] if args else kwargs["hidden_states"]
        return hook

    def layer_post(i):
        def hook(_m, _args, _kwargs, out):
            y = _first(out).float()
            x = inputs.pop(i).float().to(y.device)  # a layer accelerate runs on another device moved its input
            cos = nn.functional.cosine_similarity(x, y, dim=-1)  # [batch, seq]
            bi[i] += (1 - cos).sum().double().cpu()
        return hook

    def norm_post(_m, _args, out):
        channels.add_(out.float().abs().sum(dim=(0, 1)).double().cpu())

    def o_pre(i, proj: nn.Linear):
        def hook(_m, args):
            x = args[0]
            b, s, _ = x.shape
            x = x.view(b, s, H, hd)
            # This hook runs before accelerate's own pre-forward, so an offloaded weight is still on meta here:
            # read it through accelerate's hook (a no-op for a weight in memory).
            with align_module_device(proj):
                weight = proj.weight
            w = weight.to(x.device).view(weight.shape[0], H, hd)
            for h in range(H):  # one head's [batch, seq, hidden] contribution at a time
                contrib = x[:, :, h].float() @ w[:, h].float().t()
                heads[i, h] += contrib.norm(dim=-1).sum().double().cpu()
        return hook

    def down_pre(i, proj: nn.Linear):
        with align_module_device(proj):  # an offloaded weight: materialized by accelerate for this read
            col_norm = proj.weight.float().norm(dim=0)  # [intermediate]

        def hook(_m, args):
            a = args[0].float().abs().sum(dim=(0, 1))
            neurons[i] += (a * col_norm.to(a.device)).double().cpu()
        return hook

    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(layer_pre(i), with_kwargs=True))
        handles.append(layer.register_forward_hook(layer_post(i), with_kwargs=True))
        handles.append(layer.input_layernorm.register_forward_hook(norm_post))
        handles.append(layer.post_attention_layernorm.register_forward_hook(norm_post))
        handles.append(layer.self_attn.o_proj.register_forward_pre_hook(o_pre(i, layer.self_attn.o_proj)))
        handles.append(layer.mlp.down_proj.register_forward_pre_hook(down_pre(i, layer.mlp.down_proj)))
    handles.append(model.model.norm.register_forward_hook(norm_post))
    device = input_device(model)
    was = model.training
    model.eval()
    try:
        for s in tqdm(range(0, blocks.shape[0], batch_size), desc="calibrate", disable=not progress, leave=False):
            ids = blocks[s:s + batch_size].to(device)
            model.model(input_ids=ids, use_cache=False)
            tokens[0] += ids.numel()
    finally:
        for h in handles:
            h.remove()
        model.train(was)
    n = max(tokens[0], 1)
    block_scores = (bi / n).float() if block_score == "bi" else block_loss_increase(model, blocks, batch_size,
                                                                                    progress)
    return Scores(blocks=block_scores, heads=(heads / n).float().view(L, KV, H // KV),
                  neurons=(neurons / n).float(), channels=(channels / n).float(), tokens=tokens[0])


# --------------------------------------------------------------------------------------------
# Selections and the pruned model
# --------------------------------------------------------------------------------------------

@dataclass
class Selection:
    """Indices kept, relative to the model being pruned (layer lists are per kept layer)."""
    layers: list[int]
    channels: list[int]
    kv_heads: list[list[int]]  # per kept layer: kept KV heads
    q_heads: list[list[int]]  # per kept layer: kept query heads (original numbering, grouped by kept KV head)
    neurons: list[list[int]]


def _top(scores: torch.Tensor, k: int) -> list[int]:
    """Indices of the ``k`` largest scores, in ascending index order (stable on ties: lower index wins)."""
    order = sorted(range(scores.numel()), key=lambda j: (-float(scores[j]), j))
    return sorted(order[:k])


def select(scores: Scores, arch: Arch) -> Selection:
    """Which units ``arch`` keeps: the top-scoring blocks, channels, heads and neurons."""
    L, KV, G = scores.heads.shape
    layers = _top(scores.blocks, arch.layers)
    channels = _top(scores.channels, arch.hidden)
    kv_sel, q_sel, n_sel = [], [], []
    for i in layers:
        per_group = [_top(scores.heads[i, g], arch.group) for g in range(KV)]
        group_score = torch.tensor([float(scores.heads[i, g, per_group[g]].sum()) for g in range(KV)])
        groups = _top(group_score, arch.kv_heads)
        kv_sel.append(groups)
        q_sel.append([g * G + q for g in groups for q in per_group[g]])
        n_sel.append(_top(scores.neurons[i], arch.intermediate))
    return Selection(layers=layers, channels=channels, kv_heads=kv_sel, q_heads=q_sel, neurons=n_sel)


def _onloaded(model: nn.Module, key: str, w: torch.Tensor) -> torch.Tensor:
    """``w`` (``model.state_dict()[key]``) with its data. A weight accelerate offloaded (``device_map`` with
    ``"cpu"`` / ``"disk"`` entries) sits on ``meta`` outside its module's forward: it is read through the
    module's hook onto the CPU, one module at a time."""
    if w.device.type != "meta":
        return w
    owner, _, name = key.rpartition(".")
    module = model.get_submodule(owner)
    with align_module_device(module, torch.device("cpu")):
        return getattr(module, name)


def _rows(idx: list[int], width: int) -> torch.Tensor:
    """Row indices of heads ``idx`` each ``width`` rows wide."""
    return torch.tensor([h * width + d for h in idx for d in range(width)], dtype=torch.long)


def prune_model(model: PreTrainedModel, sel: Selection, arch: Arch, record: dict[str, Any] | None = None
                ) -> PreTrainedModel:
    """A new model of shape ``arch`` holding the kept slices of ``model``'s weights (no shared storage).

    ``record`` is the pruning record stored under ``config.distill_pruning`` (already in the
    teacher's numbering; see :func:`compose`).
    """
    check_supported(model)
    c = model.config
    hd = head_dim_of(c)
    config = copy.deepcopy(c)
    config.num_hidden_layers = arch.layers
    config.hidden_size = arch.hidden
    config.intermediate_size = arch.intermediate
    config.num_attention_heads = arch.heads
    config.num_key_value_heads = arch.kv_heads
    config.head_dim = hd  # explicit: hidden / heads no longer gives it
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = [config.layer_types[i] for i in sel.layers]
    if record is not None:
        setattr(config, KEPT_KEY, list(record["kept_layers"]))
        setattr(config, RECORD_KEY, record)
    ch = torch.tensor(sel.channels, dtype=torch.long)
    src = model.state_dict()
    dst: dict[str, torch.Tensor] = {}
    for key, w in src.items():
        if not key.startswith("model.layers."):
            w = _onloaded(model, key, w)
            if key in ("model.embed_tokens.weight", "lm_head.weight"):
                dst[key] = w[:, ch]
            elif key == "model.norm.weight":
                dst[key] = w[ch]
            else:
                raise PruneError(f"unexpected weight {key} in a {c.model_type} model; supported: {', '.join(SUPPORTED)}")
            continue
        _, _, old, rest = key.split(".", 3)
        if int(old) not in sel.layers:
            continue
        j = sel.layers.index(int(old))
        w = _onloaded(model, key, w)
        q = _rows(sel.q_heads[j], hd)
        kv = _rows(sel.kv_heads[j], hd)
        n = torch.tensor(sel.neurons[j], dtype=torch.long)
        new = f"model.layers.{j}.{rest}"
        module, _, kind = rest.rpartition(".")
        if rest in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            dst[new] = w[ch]
        elif module == "self_attn.q_proj":
            dst[new] = w[q][:, ch] if kind == "weight" else w[q]
        elif module in ("self_attn.k_proj", "self_attn.v_proj"):
            dst[new] = w[kv][:, ch] if kind == "weight" else w[kv]
        elif module == "self_attn.o_proj":
            dst[new] = w[ch][:, q] if kind == "weight" else w[ch]
        elif module in ("mlp.gate_proj", "mlp.up_proj"):
            dst[new] = w[n][:, ch] if kind == "weight" else w[n]
        elif module == "mlp.down_proj":
            dst[new] = w[ch][:, n] if kind == "weight" else w[ch]
        else:
            raise PruneError(f"unexpected weight {key} in a {c.model_type} model; supported: {', '.join(SUPPORTED)}")
    dtype = next(model.parameters()).dtype
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers
        from transformers.modeling_utils import no_init_weights
    with no_init_weights():  # every weight is overwritten below: skip the random init
        pruned = type(model)(config)
    cast_params(pruned, dtype)  # the rotary inv_freq stays fp32, as from_pretrained keeps it
    with torch.no_grad():
        pruned.load_state_dict({k: v.detach().clone().contiguous() for k, v in dst.items()}, strict=True)
    if getattr(config, "tie_word_embeddings", False):
        pruned.tie_weights()
    pruned.generation_config = copy.deepcopy(model.generation_config)
    return pruned.to(input_device(model))


def identity_record(model: PreTrainedModel) -> dict[str, Any]:
    """The record of an unpruned model (or the record it already carries from an earlier round)."""
    rec = getattr(model.config, RECORD_KEY, None)
    if rec is not None:
        return copy.deepcopy(dict(rec))
    c = model.config
    L, H, KV = c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads
    return {"kept_layers": list(range(L)), "kept_channels": list(range(c.hidden_size)),
            "kept_kv_heads": [list(range(KV))] * L, "kept_q_heads": [list(range(H))] * L,
            "kept_neurons": [list(range(c.intermediate_size))] * L,
            "teacher_shape": asdict(arch_of(model)), "rounds": []}


def compose(parent: dict[str, Any], sel: Selection, info: dict[str, Any]) -> dict[str, Any]:
    """The record of a model pruned by ``sel`` from one whose record is ``parent`` (teacher numbering)."""
    pl = parent["kept_layers"]
    return {
        "kept_layers": [pl[i] for i in sel.layers],
        "kept_channels": [parent["kept_channels"][c] for c in sel.channels],
        "kept_kv_heads": [[parent["kept_kv_heads"][i][g] for g in sel.kv_heads[j]] for j, i in enumerate(sel.layers)],
        "kept_q_heads": [[parent["kept_q_heads"][i][q] for q in sel.q_heads[j]] for j, i in enumerate(sel.layers)],
        "kept_neurons": [[parent["kept_neurons"][i][n] for n in sel.neurons[j]] for j, i in enumerate(sel.layers)],
        "teacher_shape": parent["teacher_shape"],
        "rounds": [*parent.get("rounds", []), info],
    }


def prune_to(model: PreTrainedModel, scores: Scores, arch: Arch, info: dict[str, Any] | None = None
             ) -> PreTrainedModel:
    """Select by ``scores`` and build the pruned model with its composed record."""
    sel = select(scores, arch)
    record = compose(identity_record(model), sel, {"arch": asdict(arch), **(info or {})})
    return prune_model(model, sel, arch, record)


# --------------------------------------------------------------------------------------------
# Budget and candidate architectures
# --------------------------------------------------------------------------------------------

def parse_axes(axes: str | Sequence[str]) -> tuple[str, ...]:
    items = [a.strip() for a in (axes.split(",") if isinstance(axes, str) else axes) if a.strip()]
    bad = [a for a in items if a not in AXES]
    if bad or not items:
        raise PruneError(f"unknown prune axes {bad or items}; use a comma list of {', '.join(AXES)}")
    return tuple(dict.fromkeys(items))


def _steps(full: int, small: int, big: int) -> int:
    """Width granularity: hardware-friendly multiples on real models, fine steps on tiny ones."""
    return big if full >= 8 * big else max(1, small)


def option_grid(base: Arch, fam: Family, axes: Sequence[str]) -> tuple[list[int], list[int], list[tuple[int, int]]]:
    """Depths, hidden widths and (kv_heads, group) pairs the search may use."""
    depths = list(range(1, base.layers + 1)) if "depth" in axes else [base.layers]
    if "hidden" in axes:
        step = _steps(base.hidden, base.hidden // 8, 64)
        hiddens = sorted({h for h in range(base.hidden, max(step, base.hidden // 4) - 1, -step)} | {base.hidden})
    else:
        hiddens = [base.hidden]
    if "heads" in axes:
        heads = [(kv, g) for kv in range(1, base.kv_heads + 1) for g in range(1, base.group + 1)]
    else:
        heads = [(base.kv_heads, base.group)]
    return depths, hiddens, heads


def mlp_widths(base: Arch, axes: Sequence[str]) -> list[int]:
    if "mlp" not in axes:
        return [base.intermediate]
    step = _steps(base.intermediate, base.intermediate // 16, 32)
    return sorted({w for w in range(step, base.intermediate + 1, step)} | {base.intermediate})


def budget_of(fam: Family, a: Arch, count_embeddings: bool) -> int:
    ne, emb = fam.counts(a)
    return ne + emb if count_embeddings else ne


def feasible_range(base: Arch, fam: Family, axes: Sequence[str], count_embeddings: bool) -> tuple[int, int]:
    depths, hiddens, heads = option_grid(base, fam, axes)
    widths = mlp_widths(base, axes)
    lo = min(budget_of(fam, Arch(min(depths), h, kv, g, min(widths)), count_embeddings)
             for h in hiddens for kv, g in heads if fam.accepts(h, kv * g))
    return lo, budget_of(fam, base, count_embeddings)


def candidates(base: Arch, fam: Family, target: int, axes: Sequence[str], count_embeddings: bool = False,
               tolerance: float = TOLERANCE, accepted_only: bool = True) -> list[Arch]:
    """Every uniform-width architecture within ``±tolerance`` of ``target`` on the allowed axes (that the config
    class accepts, a Llama's hidden size a multiple of its query heads; ``accepted_only=False``: those too).

    For each depth / hidden / heads choice the MLP width is solved for the budget (the nearest
    multiples below and above), so the list stays in the hundreds, not the tens of thousands.
    """
    depths, hiddens, heads = option_grid(base, fam, axes)
    widths = mlp_widths(base, axes)
    lo_b, hi_b = target * (1 - tolerance), target * (1 + tolerance)
    out: list[Arch] = []
    for layers, hidden, (kv, g) in itertools.product(depths, hiddens, heads):
        if accepted_only and not fam.accepts(hidden, kv * g):
            continue
        zero = budget_of(fam, Arch(layers, hidden, kv, g, 0), count_embeddings)
        per_neuron = budget_of(fam, Arch(layers, hidden, kv, g, 1), count_embeddings) - zero
        ideal = (target - zero) / per_neuron
        pos = next((k for k, w in enumerate(widths) if w >= ideal), len(widths))
        for w in widths[max(0, pos - 1): pos + 1]:
            a = Arch(layers, hidden, kv, g, w)
            if lo_b <= budget_of(fam, a, count_embeddings) <= hi_b:
                out.append(a)
    return sorted(set(out), key=lambda a: (-a.layers, -a.hidden, -a.heads, -a.kv_heads, -a.intermediate))


def shortlist(archs: list[Arch], fam: Family, n: int) -> list[Arch]:
    """At most ``n`` of ``archs`` (sorted by depth, then widths), evenly over the list, each one the config class
    accepts: a pick it refuses moves to the nearest accepted one not picked. The spacing runs over the whole list,
    refused shapes included, so that the accepted picks are those a list without the refusal would give."""
    ok = [fam.accepts(a.hidden, a.heads) for a in archs]
    if sum(ok) <= n:
        return [a for a, good in zip(archs, ok) if good]
    step = (len(archs) - 1) / (n - 1)
    chosen: set[int] = set()
    for i in (round(k * step) for k in range(n)):
        near = sorted((j for j in range(len(archs)) if ok[j] and j not in chosen), key=lambda j: (abs(j - i), j))
        if near:
            chosen.add(near[0])
    return [archs[j] for j in sorted(chosen)]


def resolve_target(model: PreTrainedModel, target_params: float | None, target_ratio: float | None,
                   axes: Sequence[str], count_embeddings: bool) -> int:
    """The budget in counted parameters; bad budgets fail with the feasible range."""
    base, fam = arch_of(model), family_of(model)
    lo, hi = feasible_range(base, fam, axes, count_embeddings)
    what = "parameters (embeddings counted)" if count_embeddings else "non-embedding parameters"
    if (target_params is None) == (target_ratio is None):
        raise PruneError("give exactly one of --target-params (absolute) or --target-ratio (of the teacher)")
    target = int(target_params) if target_params is not None else int(round(target_ratio * hi))
    if not lo * (1 - TOLERANCE) <= target <= hi:
        raise PruneError(f"target {target:,} {what} is outside what axes {','.join(axes)} can reach for this "
                         f"{base.layers}-layer teacher; choose {lo:,}..{hi:,} (ratio {lo / hi:.4f}..1)")
    return target


# --------------------------------------------------------------------------------------------
# Held-out scoring and the short distillation
# --------------------------------------------------------------------------------------------

@dataclass
class LossMasks:
    """Completion-only targets of chat data (``completion_only``), as the distill recipe trains and scores them.

    ``heldout``: ``[m, seq]`` bool beside the held-out blocks (``PackedData.eval_mask``); ``train``: the
    training blocks' masks, a ``[k, seq]`` bool tensor beside them or a function of block indices
    (``Blocks.loss_mask``). True where the token is a target; None (or a function giving None): every token.
    """
    heldout: torch.Tensor | None = None
    train: torch.Tensor | Callable[[torch.Tensor], torch.Tensor | None] | None = None


class HeldOut:
    """Held-out blocks with the teacher's final hidden states cached, for KL / perplexity of candidates.

    Teacher logits are formed from the cached ``[n, seq, hidden]`` states one batch at a time, so
    nothing of ``[tokens, vocab]`` size is kept between candidates. ``mask`` ``[n, seq]`` bool
    (completion-only chat data): only positions whose label is a target count, as in the recipe's
    held-out evaluation; the other tokens stay in the input as context. None: every token.
    """
    def __init__(self, teacher: PreTrainedModel, blocks: torch.Tensor, batch_size: int = 4,
                 mask: torch.Tensor | None = None):
        self.teacher, self.blocks, self.batch_size = teacher, blocks, batch_size
        self.mask = None if mask is None else mask.bool()
        if self.mask is not None and tuple(self.mask.shape) != tuple(blocks.shape):
            raise PruneError(f"held-out mask {tuple(self.mask.shape)} does not match the blocks {tuple(blocks.shape)}")
        # Blocks that the first ranking stage scores: one, or with a mask as many as reach the first target.
        self.rank_blocks = 1
        if self.mask is not None:
            scored = self.mask[:, 1:].any(dim=1).nonzero()
            if scored.numel() == 0:
                raise PruneError("the held-out blocks hold no completion target (completion_only masks every token); "
                                 "raise prune_eval_blocks or seq_len, or set completion_only=false")
            self.rank_blocks = int(scored[0]) + 1
        device = input_device(teacher)
        with torch.no_grad():
            self.hidden = torch.cat([teacher.model(input_ids=blocks[s:s + batch_size].to(device), use_cache=False)
                                     .last_hidden_state.cpu() for s in range(0, blocks.shape[0], batch_size)])

    @torch.no_grad()
    def stats(self, model: PreTrainedModel, n_blocks: int | None = None):
        """``eval.metrics.LMStats`` of ``model`` (perplexity, KL and top-1 agreement to the teacher)."""
        device = next(model.parameters()).device
        head = self.teacher.get_output_embeddings()
        total = LMStats()
        was = model.training
        model.eval()
        n = self.blocks.shape[0] if n_blocks is None else min(n_blocks, self.blocks.shape[0])
        for s in range(0, n, self.batch_size):
            e = min(s + self.batch_size, n)
            ids = self.blocks[s:e].to(device)
            ref = head(self.hidden[s:e].to(device))
            total.add(batch_stats(model(input_ids=ids, use_cache=False).logits, ids, None, ref,
                                  loss_mask=None if self.mask is None else self.mask[s:e]))
        model.train(was)
        return total


def default_loss_config() -> LossConfig:
    """The built-in demo's terms (the distill recipe's defaults): logits KD + CE + the hidden term."""
    return DistillConfig().losses()


def short_distill(student: PreTrainedModel, teacher: PreTrainedModel, blocks: torch.Tensor, steps: int, *,
                  loss_config=None, lr: float = 3e-4, batch_size: int = 4, warmup: int = 4, seed: int = 0,
                  progress: str | None = None,
                  loss_mask: torch.Tensor | Callable[[torch.Tensor], torch.Tensor | None] | None = None
                  ) -> PreTrainedModel:
    """Train ``student`` in place for ``steps`` AdamW steps on ``blocks`` ``[n, seq]`` with ``DistillModel``.

    The same module, terms and schedule as ``recipes/distill.py`` (warmup + cosine to 0.1·lr, clip
    1.0), without its run folder, so the search can rank candidates after light retraining.
    ``loss_mask`` (completion-only chat data, :attr:`LossMasks.train`): ``[n, seq]`` bool beside ``blocks``,
    or a function of a micro-batch's block indices (``Blocks.loss_mask``); passed to ``DistillModel`` as the
    recipe does, so only targets train. None: every token.
    """
    if steps <= 0:
        return student
    torch.manual_seed(seed)
    model = DistillModel(student, teacher, loss_config or default_loss_config())
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(min(warmup, steps - 1), steps, 0.1))
    order = BlockOrder(blocks.shape[0], min(batch_size, blocks.shape[0]), seed)
    device = next(student.parameters()).device
    student.train()
    try:
        for step in tqdm(range(steps), desc=progress, disable=progress is None, leave=False):
            for index, ids in order.micro_batches(blocks, step, 0, 1, order.global_batch):
                mask = loss_mask(index) if callable(loss_mask) else None if loss_mask is None else loss_mask[index]
                out = model(input_ids=ids.to(device), loss_mask=None if mask is None else mask.to(device))
                # The recipe's token weight (distill.training.token_weights) of a step's only micro-batch: 1, or
                # 0 when completion-only masks leave it no target (the attention-map term would still train).
                (out.loss if mask is None or target_count(mask, tuple(ids.shape)) > 0 else out.loss * 0).backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
    finally:
        model.remove_hooks()
    student.eval()
    return student


# --------------------------------------------------------------------------------------------
# The search
# --------------------------------------------------------------------------------------------

@dataclass
class Candidate:
    arch: Arch
    params: int  # non-embedding
    params_total: int
    kl_init: float = math.nan  # on the first held-out block (stage 1)
    kl_eval: float = math.nan  # on all search held-out blocks (stage 2)
    ppl_eval: float = math.nan
    kl_distilled: float = math.nan
    ppl_distilled: float = math.nan

    def row(self) -> dict[str, Any]:
        """The candidate as JSON: a stage it did not reach is null (JSON has no NaN; jq and most readers refuse it)."""
        scores = {"kl_init_1block": self.kl_init, "kl_init": self.kl_eval, "ppl_init": self.ppl_eval,
                  "kl_distilled": self.kl_distilled, "ppl_distilled": self.ppl_distilled}
        return {"arch": self.arch.label(), **asdict(self.arch), "params_non_embedding": self.params,
                "params_total": self.params_total, **{k: None if math.isnan(v) else v for k, v in scores.items()}}


@dataclass
class SearchSettings:
    target_params: float | None = None
    target_ratio: float | None = None
    count_embeddings: bool = False
    axes: tuple[str, ...] = AXES
    top_k: int = 3  # candidates short-distilled
    finalists: int = 12  # candidates scored on every search held-out block
    max_candidates: int = 64  # beyond this, an evenly spaced subset of the sorted list is ranked
    search_steps: int = 20
    lr: float = 3e-4
    batch_size: int = 4
    seed: int = 0
    iterative: bool = False
    block_score: str = "bi"  # how blocks are scored: "bi" (block influence) | "loss" (loss increase when skipped)
    max_round_cut: float = 0.3
    calibration: dict[str, Any] = field(default_factory=dict)
    loss_config: LossConfig | None = None  # the short distillation's terms (None: the distill recipe's defaults)


@dataclass
class SearchResult:
    model: PreTrainedModel
    winner: Candidate
    table: list[Candidate]
    target: int
    seconds: float
    rounds: int = 1

    def to_json(self) -> dict[str, Any]:
        return {"target": self.target, "winner": self.winner.row(), "rounds": self.rounds,
                "seconds": round(self.seconds, 1), "candidates": [c.row() for c in self.table]}


def _fmt(x: float) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:,.3f}" if x < 100 else f"{x:,.0f}"


def format_table(table: list[Candidate], winner: Candidate | None = None) -> str:
    head = f"{'':2}{'architecture':34} {'non-emb':>12} {'total':>12} {'KL@1blk':>9} {'KL init':>9} " \
           f"{'ppl init':>10} {'KL dist':>9} {'ppl dist':>10}"
    lines = [head, "-" * len(head)]
    for c in table:
        mark = "* " if winner is not None and c is winner else "  "
        lines.append(f"{mark}{c.arch.label():34} {c.params:>12,} {c.params_total:>12,} {_fmt(c.kl_init):>9} "
                     f"{_fmt(c.kl_eval):>9} {_fmt(c.ppl_eval):>10} {_fmt(c.kl_distilled):>9} "
                     f"{_fmt(c.ppl_distilled):>10}")
    return "\n".join(lines)


def search_round(model: PreTrainedModel, teacher: PreTrainedModel, calib: torch.Tensor, heldout: HeldOut,
                 train: torch.Tensor, target: int, s: SearchSettings, log: Callable[[str], None] = print,
                 scores: Scores | None = None, train_mask: torch.Tensor | Callable | None = None,
                 must_cut: bool = False) -> tuple[PreTrainedModel, Candidate, list[Candidate]]:
    """One prune: score ``model`` (unless ``scores`` are given), rank the candidates at ``target``,
    short-distill the best (on the targets of ``train_mask``, :attr:`LossMasks.train`), pick one.
    ``must_cut``: ``model``'s own shape is no candidate (an intermediate iterative round must shrink it)."""
    base, fam = arch_of(model), family_of(model)
    archs = [a for a in candidates(base, fam, target, s.axes, s.count_embeddings, accepted_only=False)
             if not (must_cut and a == base)]
    if not any(fam.accepts(a.hidden, a.heads) for a in archs):
        lo, hi = feasible_range(base, fam, s.axes, s.count_embeddings)
        raise PruneError(f"no architecture on axes {','.join(s.axes)} lies within ±{TOLERANCE:.0%} of {target:,} "
                         f"(reachable {lo:,}..{hi:,}); allow more axes (e.g. --axes depth,mlp) or move the target")
    archs = shortlist(archs, fam, s.max_candidates)
    t0 = time.time()
    if scores is None:
        scores = importance(model, calib, s.batch_size, block_score=s.block_score)
        log(f"calibrated on {scores.tokens:,} tokens in {time.time() - t0:.0f}s")
    log(f"{len(archs)} candidate architectures")
    blocks_by = "BI blocks" if s.block_score == "bi" else "blocks by loss increase when skipped"
    info = {"method": f"importance: {blocks_by}, head/neuron contribution norms, norm-output channels",
            "calibration": s.calibration}
    table = []
    for a in archs:
        ne, emb = fam.counts(a)
        table.append(Candidate(arch=a, params=ne, params_total=ne + emb))

    # Successive halving: one held-out block for everyone (with completion-only masks, up to the first block
    # holding a target), every block for the finalists.
    for c in tqdm(table, desc="rank", leave=False):
        st = heldout.stats(prune_to(model, scores, c.arch, info), n_blocks=heldout.rank_blocks)
        c.kl_init = st.kl
    finalists = sorted(table, key=lambda c: c.kl_init)[: max(s.finalists, s.top_k)]
    for c in finalists:
        st = heldout.stats(prune_to(model, scores, c.arch, info))
        c.kl_eval, c.ppl_eval = st.kl, st.perplexity
    best = sorted(finalists, key=lambda c: c.kl_eval)[: s.top_k]
    winner, winner_model = None, None
    for i, c in enumerate(best):
        student = prune_to(model, scores, c.arch, {**info, "search_steps": s.search_steps})
        short_distill(student, teacher, train, s.search_steps, loss_config=s.loss_config, lr=s.lr,
                      batch_size=s.batch_size, seed=s.seed, loss_mask=train_mask, progress=f"distill {i + 1}/{len(best)}")
        st = heldout.stats(student)
        c.kl_distilled, c.ppl_distilled = st.kl, st.perplexity
        if winner is None or c.kl_distilled < winner.kl_distilled:
            winner, winner_model = c, student
    return winner_model, winner, table


def search(teacher: PreTrainedModel, calib: torch.Tensor, heldout_blocks: torch.Tensor, train: torch.Tensor,
           s: SearchSettings, log: Callable[[str], None] = print, scores: Scores | None = None,
           heldout: HeldOut | None = None, masks: LossMasks | None = None) -> SearchResult:
    """Prune ``teacher`` to the budget by importance + search (iteratively when ``s.iterative``).

    Args:
        calib: ``[n, seq]`` calibration blocks (training text).
        heldout_blocks: ``[m, seq]`` held-out blocks ranking the candidates.
        train: ``[k, seq]`` blocks for the short distillation.
        scores / heldout: the teacher's importance scores and cached held-out states, when already
            computed (the first round reuses them).
        masks: completion-only targets of chat data (:class:`LossMasks`): held-out KL / perplexity count
            only the held-out targets and the short distillation trains on the training targets, as the
            distill recipe does. None: every token. Calibration keeps every token (see :func:`calibration_data`).
    """
    check_supported(teacher)
    t0 = time.time()
    target = resolve_target(teacher, s.target_params, s.target_ratio, s.axes, s.count_embeddings)
    fam, base = family_of(teacher), arch_of(teacher)
    ne, emb = fam.counts(base)
    log(f"teacher {base.label()}: {ne:,} non-embedding + {emb:,} embedding = {ne + emb:,} parameters")
    log(f"target {target:,} {'parameters (embeddings counted)' if s.count_embeddings else 'non-embedding parameters'}")
    masks = masks or LossMasks()
    heldout = heldout or HeldOut(teacher, heldout_blocks, s.batch_size, mask=masks.heldout)
    model, table, rounds = teacher, [], 0
    while True:
        current = budget_of(fam, arch_of(model), s.count_embeddings)
        # an intermediate round aims above current·(1 - cut) by the tolerance, so no accepted candidate (within
        # -TOLERANCE of its target) cuts more than max_round_cut; it must cut something (a small max_round_cut puts the
        # current shape in its window, and a round it won would start the next one where it did, without end)
        step_target = (max(target, int(current * (1 - s.max_round_cut) / (1 - TOLERANCE))) if s.iterative
                       else target)
        rounds += 1
        if s.iterative:
            log(f"round {rounds}: {current:,} → {step_target:,}")
        model, winner, round_table = search_round(model, teacher, calib, heldout, train, step_target, s, log,
                                                  scores if rounds == 1 else None, train_mask=masks.train,
                                                  must_cut=step_target != target)
        table.extend(round_table)
        if step_target == target:
            break
    return SearchResult(model=model, winner=winner, table=table, target=target, seconds=time.time() - t0,
                        rounds=rounds)


def save_pruned(model: PreTrainedModel, tokenizer, out: Path, overwrite: bool = False,
                extra: dict[str, Any] | None = None) -> None:
    """Write the pruned model (+ tokenizer, + ``search.json`` and its plot ``search.png``) atomically; never
    replaces what we did not write."""
    out = Path(out)
    if (aside := restore_aside(out, is_saved_model)) is not None:  # a kill inside replace_dir's two renames
        print(f"restored {out} from {aside.name}, where a killed run had moved it", flush=True)
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise PruneError(f"{out} is not empty; choose another --out or pass --overwrite")
        if not _written_by_prune(out):
            raise PruneError(f"{out} holds files distill.prune did not write; refusing to replace it, choose "
                             "another --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".tmp-{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if extra is not None:
            (tmp / "search.json").write_text(json.dumps(extra, indent=1))
            if extra.get("candidates"):
                plot_search(extra["candidates"], extra.get("winner"), tmp / "search.png",
                            f"prune search: {len(extra['candidates'])} candidates at {extra['target']:,} parameters")
        replace_dir(tmp, out)  # fsynced, then renamed; an old folder goes only once the new one is in place
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _written_by_prune(folder: Path) -> bool:
    """A model folder this module saved: its ``search.json``, or the pruning record in ``config.json``."""
    if (folder / "search.json").is_file():
        return True
    try:
        return "distill_pruning" in json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False


# --------------------------------------------------------------------------------------------
# Recipe entry point and CLI
# --------------------------------------------------------------------------------------------

def calibration_data(tokenizer, dataset: str | None, seq_len: int, calib_blocks: int, eval_blocks: int,
                     train_blocks: int | None = None, text_field: str = "text", *, seed: int = 0,
                     with_masks: bool = False, reported_blocks: int = 0, **data_args: Any):
    """``(calibration, held-out, distill)`` blocks from a dataset (the distill recipe's data rules).

    ``data_args``: the rest of :func:`~distill.data.build_data`'s data keys (``datasets``, ``eval_dataset``,
    ``data_cache``, ...; ``DistillConfig.data_args()``), so a recipe prunes on the data it trains on.
    ``seed``: the recipe's, for a mixture's draw. ``with_masks``: a fourth item, the completion-only
    :class:`LossMasks` of chat data (every mask None for plain text), for :func:`search`.
    ``reported_blocks``: how many held-out blocks the run reports its perplexity on (the recipe's
    ``eval_blocks``: the first ones of each source's held-out split). The ``[eval_blocks, seq]`` held-out
    blocks that rank the candidates are then the ones after those, source by source, so the student is not
    picked on the text that scores it; too few held-out blocks for both is an error. 0: the first ones.
    """
    data = build_data(tokenizer, dataset=dataset, seq_len=seq_len, eval_blocks=reported_blocks or eval_blocks,
                      text_field=text_field, **data_args)
    held, held_mask = data.eval, data.eval_mask
    if reported_blocks:
        # Built again for reported + ranking blocks, each source's segment of the held-out tensor is a longer
        # prefix of the same prepared split, so the ranking blocks are taken past the run's own in each segment.
        # Shared by weight over what each source has spare: the largest-remainder split of reported + ranking can
        # give a source fewer blocks than that of reported alone, so the wider tensor is not simply a suffix.
        from distill.data.corpus import _split_eval

        wide = build_data(tokenizer, dataset=dataset, seq_len=seq_len, eval_blocks=reported_blocks + eval_blocks,
                          text_field=text_field, progress=False, **data_args)
        if data_args.get("eval_dataset"):  # one held-out source, read whole from its start
            weights, ran, got = [1.0], [data.eval.shape[0]], [wide.eval.shape[0]]
        else:
            weights = data.weights
            ran, got = [r.eval_blocks for r in data.sources], [r.eval_blocks for r in wide.sources]
        spare = [max(0, g - r) for r, g in zip(ran, got)]
        if sum(spare) < eval_blocks:
            raise PruneError(f"the held-out text has {wide.eval.shape[0]} blocks of {seq_len} tokens, fewer than "
                             f"eval_blocks {reported_blocks} (the run's) + prune_eval_blocks {eval_blocks} (the "
                             "search's, kept apart); lower prune_eval_blocks, eval_blocks or seq_len, or add held-out text")
        starts = [0, *itertools.accumulate(got)]
        rows = torch.cat([torch.arange(s + r, s + r + k, dtype=torch.long)
                          for s, r, k in zip(starts, ran, _split_eval(eval_blocks, weights, spare))])
        held, held_mask = wide.eval[rows], None if wide.eval_mask is None else wide.eval_mask[rows]
    # Calibration and distillation both use training text; the held-out split only ranks. A mixture's blocks
    # are its sources one after another: calibrate on a weighted draw, the one the recipe's order (same
    # weights, same seed) takes for a first step of that many blocks, so every source's calibration blocks
    # are the first ones the recipe trains on from it. At most every block (one global batch of the order).
    if len(data.weights) == 1:
        calib = data.train[:calib_blocks]
    else:
        calib = data.train[data.order(min(calib_blocks, data.train.shape[0]), seed).step_indices(0)]
    train = data.train if train_blocks is None else data.train[:train_blocks]
    if not with_masks:
        return calib, held, train
    # Calibration keeps every token, masks or not: importance measures how much each block, head, neuron and
    # channel carries of the activations, and prompt tokens run through the same units and feed the
    # assistant's tokens through attention (their keys and values), so units that matter on the prompt matter
    # for the targets too; only the held-out ranking and the short distillation, which measure and train the
    # loss, count targets alone, as the recipe does.
    masks = LossMasks(heldout=held_mask, train=data.train.loss_mask)  # loss_mask(index): None for plain text
    return calib, held, train, masks


DEFAULT_RATIO = 1 / 3  # the recipe's budget when it names none: a third of the teacher's non-embedding size


PRUNED_DIR = "pruned"  # under a recipe's output_dir: the student its search picked, read back on resume


def check_recipe_search(cfg: Any) -> None:
    """What a recipe config's search (:func:`prune_for_recipe`) needs that the config alone decides: one process,
    known ``prune_axes``, prepared (not streamed) data. One-line :class:`PruneError`; the recipe calls it before the
    teacher loads."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # ranks could pick different students on a GPU
        raise PruneError("student_init=prune runs in one process; prune once with python -m distill.prune "
                         "--out DIR, then launch with student=DIR")
    parse_axes(cfg.prune_axes)
    specs = parse_sources(cfg.datasets, cfg.dataset, text_field=cfg.text_field, streaming=cfg.streaming)
    if any(s.streaming for s in specs):  # the search indexes and slices blocks; a stream has no length
        raise PruneError("student_init=prune calibrates on prepared blocks, and a streamed source has none: set "
                         "streaming=false, or prune once with python -m distill.prune and pass student=DIR")


def prune_for_recipe(teacher: PreTrainedModel, tokenizer, cfg: Any, log: Callable[[str], None] = print
                     ) -> PreTrainedModel:
    """``student_init: prune`` in ``recipes/distill.py``: search a student at the config's budget.

    The search decides the student's shape and which teacher layers the ``"derived"`` hidden-state
    map pairs, and it need not land on the same student twice (other threads, another machine). So a
    fresh run saves its winner once to ``output_dir/pruned`` (an HF directory with ``search.json``),
    and a resume (``cfg.resume``) reads the student back instead of searching (:func:`resumed_student`).
    The search's short distillation trains the candidates with the run's own loss terms (``cfg.losses()``) on
    its completion-only targets. The result is also kept per process for the same settings.
    """
    if getattr(cfg, "resume", None) is not None and (student := resumed_student(teacher, cfg, log)) is not None:
        return student
    check_recipe_search(cfg)
    # Its terms train the candidates; eval_blocks decides which held-out blocks rank them.
    key = (*(str(getattr(cfg, k, None)) for k in _RECIPE_KEYS), repr(cfg.losses()), str(cfg.eval_blocks))
    if key in _recipe_memo:
        return copy.deepcopy(_recipe_memo[key])
    axes = parse_axes(cfg.prune_axes)
    data_args = cfg.data_args()
    specs = parse_sources(cfg.datasets, cfg.dataset, text_field=cfg.text_field, streaming=cfg.streaming)
    # Chat data with completion_only: the search ranks and short-distills on the assistant's tokens, as the
    # recipe trains and evaluates (calibration keeps every token: see calibration_data). The candidates are ranked
    # on held-out blocks after the run's eval_blocks, so the held-out perplexity the run reports is not the text
    # its student was picked on (the short distillation trains on training blocks only).
    calib, held, train, masks = calibration_data(tokenizer, seq_len=cfg.seq_len, calib_blocks=cfg.prune_calib_blocks,
                                                 eval_blocks=cfg.prune_eval_blocks, seed=cfg.seed, with_masks=True,
                                                 reported_blocks=cfg.eval_blocks, **data_args)
    ratio = cfg.target_ratio if cfg.target_params is not None or cfg.target_ratio is not None else DEFAULT_RATIO
    s = SearchSettings(target_params=cfg.target_params, target_ratio=ratio, axes=axes,
                       search_steps=cfg.prune_search_steps, top_k=cfg.prune_top_k, lr=cfg.lr,
                       max_candidates=getattr(cfg, "prune_max_candidates", 64),
                       block_score=getattr(cfg, "prune_block_score", "bi"),
                       batch_size=cfg.micro_batch_size, seed=cfg.seed, loss_config=cfg.losses(),
                       calibration={"dataset": ", ".join(s.source for s in specs), "blocks": int(calib.shape[0]),
                                    "seq_len": cfg.seq_len})
    result = search(teacher, calib, held, train, s, log, masks=masks)
    log(format_table(result.table, result.winner))
    log(f"pruned student: {result.winner.arch.label()} ({result.winner.params:,} non-embedding, "
        f"{result.winner.params_total:,} total) in {result.seconds:.0f}s")
    _recipe_memo.clear()
    _recipe_memo[key] = copy.deepcopy(result.model)
    if getattr(cfg, "output_dir", None):
        save_pruned(result.model, tokenizer, Path(cfg.output_dir) / PRUNED_DIR, overwrite=True,
                    extra=result.to_json())
    return result.model


def student_from_record(teacher: PreTrainedModel, record: dict[str, Any]) -> PreTrainedModel:
    """The student a pruning ``record`` (``config.distill_pruning``, teacher numbering) describes, cut from ``teacher``.

    Exactly the winner's shape and kept units, with the teacher's weights in them (not the weights the
    search's short distillation left): for a resume, whose checkpoint replaces them.
    """
    check_supported(teacher)
    if record.get("teacher_shape") != asdict(arch_of(teacher)):
        raise PruneError(f"the pruning record was cut from a {record.get('teacher_shape')} teacher, not this "
                         f"{asdict(arch_of(teacher))} one; resume with the teacher the run started with")
    sel = Selection(layers=list(record["kept_layers"]), channels=list(record["kept_channels"]),
                    kv_heads=[list(x) for x in record["kept_kv_heads"]],
                    q_heads=[list(x) for x in record["kept_q_heads"]], neurons=[list(x) for x in record["kept_neurons"]])
    kv = len(sel.kv_heads[0])
    arch = Arch(layers=len(sel.layers), hidden=len(sel.channels), kv_heads=kv, group=len(sel.q_heads[0]) // kv,
                intermediate=len(sel.neurons[0]))
    return prune_model(teacher, sel, arch, copy.deepcopy(record))


def resumed_student(teacher: PreTrainedModel, cfg: Any, log: Callable[[str], None] = print
                    ) -> PreTrainedModel | None:
    """The student a resumed ``student_init: prune`` run trained, without searching again (None: search).

    The checkpoint resumed from names it: its ``student/config.json`` holds the pruning record (kept
    layers, channels, heads, neurons). ``output_dir/pruned`` holds the very student the fresh run
    searched; when its record is the checkpoint's it is loaded, else (a run from before it was saved)
    the record is cut from the teacher again. A checkpoint without a record (an older run) searches
    again, with a warning: the search may pick another student than the one the checkpoint holds.
    """
    path = ckpt.resolve_resume(cfg.resume, cfg.output_dir)
    record = (ckpt.model_config(path) or {}).get(RECORD_KEY)
    if not record:
        log(f"warning: {path} holds no pruning record (an older run); searching the student again, which may "
            "not pick the one the checkpoint trained")
        return None
    saved = Path(cfg.output_dir) / PRUNED_DIR
    try:
        same = json.loads((saved / "config.json").read_text()).get(RECORD_KEY) == record
    except (OSError, ValueError):
        same = False
    if same:
        return load_causal_lm(str(saved), dtype=next(teacher.parameters()).dtype)
    return student_from_record(teacher, record)


_RECIPE_KEYS = ("teacher", "dataset", "datasets", "eval_dataset", "text_field", "max_train_blocks", "completion_only",
                "streaming", "data_cache", "seq_len", "target_params", "target_ratio", "prune_axes",
                "prune_search_steps", "prune_top_k", "prune_calib_blocks", "prune_eval_blocks",
                "prune_max_candidates", "prune_block_score", "lr",
                "micro_batch_size", "seed")
_recipe_memo: dict[tuple[str, ...], PreTrainedModel] = {}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m distill.prune", description=__doc__.split("\n\n")[2],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", required=True, help="teacher: HF directory, hub name or 'smollm2-135m-instruct'")
    p.add_argument("--out", required=True, help="output HF directory for the pruned student")
    p.add_argument("--target-params", type=float, help="budget in parameters (non-embedding unless --count-embeddings)")
    p.add_argument("--target-ratio", type=float, help="budget as a fraction of the teacher's counted parameters")
    p.add_argument("--count-embeddings", action="store_true", help="the budget counts embeddings and head too")
    p.add_argument("--axes", default=",".join(AXES), help=f"what may be cut: comma list of {', '.join(AXES)}")
    p.add_argument("--dataset", default="builtin:stdlib-docs", help="calibration / ranking / distill text")
    p.add_argument("--text-field", default="text", help="column holding the text")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per block")
    p.add_argument("--calib-blocks", type=int, default=32, help="calibration blocks (training split)")
    p.add_argument("--eval-blocks", type=int, default=8, help="held-out blocks that rank candidates")
    p.add_argument("--reported-blocks", type=int, default=16,
                   help="first held-out blocks kept out of the ranking: those recipes/distill.py student=DIR reports "
                        "its perplexity on (its eval_blocks) when it trains on the same --dataset and --seq-len, so the "
                        "student is not picked on the text that scores it (0: rank on the first blocks)")
    p.add_argument("--top-k", type=int, default=3, help="candidates short-distilled")
    p.add_argument("--finalists", type=int, default=12, help="candidates scored on every held-out block")
    p.add_argument("--max-candidates", type=int, default=64, help="rank at most this many (evenly spaced)")
    p.add_argument("--search-steps", type=int, default=20, help="short-distill steps per top-k candidate (0: rank at init)")
    p.add_argument("--lr", type=float, default=3e-4, help="short-distill peak learning rate")
    p.add_argument("--batch-size", type=int, default=4, help="blocks per forward")
    p.add_argument("--block-score", choices=BLOCK_SCORES, default="bi",
                   help="score blocks by block influence (one pass) or by the loss increase when each is skipped "
                        "(one pass per layer)")
    p.add_argument("--iterative", action="store_true", help="prune at most --max-round-cut per round, distill, repeat")
    p.add_argument("--max-round-cut", type=float, default=0.3, help="largest fraction cut per iterative round")
    p.add_argument("--dtype", choices=("auto", "fp32", "bf16"), default="auto",
                   help="model dtype; auto: bf16 on CUDA, fp32 on CPU (bf16 matmul is slow on CPUs)")
    p.add_argument("--device", default="auto", help="auto (cuda when torch sees a GPU, else cpu) | cpu | cuda | cuda:N")
    p.add_argument("--offload", action="store_true", help="load the teacher with device_map=auto (layer offload)")
    p.add_argument("--seed", type=int, default=0, help="seed for the short distillation")
    p.add_argument("--overwrite", action="store_true", help="replace an existing pruned model in --out")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from core.config import check_output_dir
    from distill.config import check_data_source

    try:
        if not 0 < args.max_round_cut < 1:
            raise PruneError(f"--max-round-cut must be in (0, 1), got {args.max_round_cut}")
        for name in ("seq_len", "calib_blocks", "eval_blocks", "top_k", "finalists", "batch_size"):
            if name == "finalists" and args.max_candidates < 2:
                raise PruneError(f"--max-candidates must be >= 2, got {args.max_candidates}")
            if getattr(args, name) < 1:
                raise PruneError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
        for name in ("search_steps", "reported_blocks"):
            if getattr(args, name) < 0:
                raise PruneError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
        # The budget, the learning rate, the data and --out: all refused here, not after the teacher loads.
        if (args.target_params is None) == (args.target_ratio is None):
            raise PruneError("give exactly one of --target-params (absolute) or --target-ratio (of the teacher)")
        if args.target_ratio is not None and not 0 < args.target_ratio <= 1:
            raise PruneError(f"--target-ratio must be in (0, 1], got {args.target_ratio}; choose a fraction of "
                             "the teacher's size, e.g. 0.5")
        if args.target_params is not None and not (math.isfinite(args.target_params) and args.target_params > 0):
            raise PruneError(f"--target-params must be a finite number > 0, got {args.target_params}; choose a "
                             "parameter count, e.g. 5e7")
        if not (math.isfinite(args.lr) and args.lr > 0):
            raise PruneError(f"--lr must be a finite number > 0, got {args.lr}")
        check_data_source(args.dataset, "--dataset")
        check_output_dir(args.out, "--out")
        out = Path(args.out)
        if out.exists() and any(out.iterdir()) and not args.overwrite:
            raise PruneError(f"{out} is not empty; choose another --out or pass --overwrite")
        if out.resolve() == Path(args.model).resolve():
            raise PruneError(f"--out {out} is the --model folder; choose another --out")
        axes = parse_axes(args.axes)
        limit = getattr(peek_config(args.model), "max_position_embeddings", None)  # None: judged by no config.json
        if limit is not None and args.seq_len > limit:  # it would rank and distill on positions it never learned
            raise PruneError(f"--seq-len {args.seq_len} exceeds the model's maximum of {limit} positions; lower --seq-len")

        device = resolve_device(args.device)
        dtype = resolve_dtype(args.dtype, device)
        # The data first: it needs only the tokenizer, and too little held-out text is refused before the
        # teacher's weights load (minutes at the target scale).
        try:
            tokenizer = load_tokenizer(args.model)
        except OSError as err:  # not a local folder, and not reachable on the hub (or not a model)
            raise PruneError(f"--model {args.model}: {str(err).strip().splitlines()[0]}") from None
        calib, held, train = calibration_data(tokenizer, args.dataset, args.seq_len, args.calib_blocks,
                                              args.eval_blocks, text_field=args.text_field,
                                              reported_blocks=args.reported_blocks)
        kw = {"device_map": "auto"} if args.offload else {}
        try:
            teacher = load_causal_lm(args.model, dtype=dtype, **kw)
        except OSError as err:
            raise PruneError(f"--model {args.model}: {str(err).strip().splitlines()[0]}") from None
        check_supported(teacher)
        if not args.offload:
            teacher.to(device)
        teacher.eval().requires_grad_(False)
        resolve_target(teacher, args.target_params, args.target_ratio, axes, args.count_embeddings)
        s = SearchSettings(target_params=args.target_params, target_ratio=args.target_ratio,
                           count_embeddings=args.count_embeddings, axes=axes, top_k=args.top_k,
                           finalists=args.finalists, max_candidates=args.max_candidates, search_steps=args.search_steps, lr=args.lr,
                           batch_size=args.batch_size, seed=args.seed, iterative=args.iterative,
                           block_score=args.block_score,
                           max_round_cut=args.max_round_cut,
                           calibration={"dataset": args.dataset, "blocks": int(calib.shape[0]),
                                        "seq_len": args.seq_len})
        result = search(teacher, calib, held, train, s)
        print(format_table(result.table, result.winner))
        save_pruned(result.model, tokenizer, out, args.overwrite, extra=result.to_json())
    except ConfigError as err:
        print(f"error: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    w = result.winner
    print(f"winner {w.arch.label()}: {w.params:,} non-embedding, {w.params_total:,} total parameters; "
          f"held-out KL {w.kl_eval:.3f} → {w.kl_distilled:.3f} after {args.search_steps} steps; "
          f"{result.seconds:.0f}s")
    print(f"saved {out}   (AutoModelForCausalLM.from_pretrained; search table in {out / 'search.json'})")
    print(json.dumps({"winner": w.row(), "target": result.target, "seconds": round(result.seconds, 1),
                      "out": str(out)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
