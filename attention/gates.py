"""DuoAttention-style learned gates: which KV heads need the whole context, learned on the frozen model.

Xiao et al. 2024 ("DuoAttention"): give every (layer, KV head) one gate ``α ∈ [0, 1]`` and let the
head's output be ``α · full + (1 − α) · streaming``; with every weight frozen, train only the gates so
that the last hidden states under the gated mix match those under full attention on synthetic
pass-key data, plus an L1 penalty that pushes gates to 0. Heads whose gate stays high are the ones
whose loss of context changes what the model retrieves; they keep full attention.

Unlike the training-free retrieval score (``attention.heads``), which looks at where a head's top-1
attention lands, the gates measure each head's effect on the model's output, so they also find heads
that feed retrieval without attending to the copied token themselves (measured on the demo model:
the retrieval score misses heads in early-middle layers the pass key needs).

Kept cheap enough for minutes on a CPU:

* training samples are short (about 1K tokens), with the needle outside the streaming horizon;
* queries before ``sink + window`` see every earlier key under both patterns, so their hidden states
  do not depend on the gates: that prefix runs once per sample (no grad) and its keys/values are
  stored; every step runs only the rest of the sample, with gradients for the gates alone;
* the targets (hidden states under full attention) are computed once per sample.

Tensors: ``gates`` are ``[layers, kv_heads]``; attention inputs ``q [b, heads, q_len, d]``,
``k, v [b, kv_heads, k_len, d]``.
"""

from __future__ import annotations

import dataclasses
import random

import torch
import torch.nn.functional as F

from attention.errors import HybridAttentionError
from attention.functional import resolve_window
from attention.integration import attention_swapped
from attention.masks import query_key_mask
from attention.spec import HybridAttentionConfig

GATE_IMPLEMENTATION = "hybrid_gates"


@dataclasses.dataclass
class GateResult:
    gates: torch.Tensor  # [layers, kv_heads] in [0, 1], after the last step
    pressure: torch.Tensor  # [layers, kv_heads]: −∂MSE/∂α averaged over the second half (ranks the gates at 0)
    history: list[dict]  # per step: relative MSE and the mean gate
    multikey: int = 0  # named keys per multi-key sample (0: none), set by attention.heads.learn_gates


def gated_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: HybridAttentionConfig,
                    alpha: torch.Tensor, *, window: int | None = None, scale: float | None = None) -> torch.Tensor:
    """``α · full + (1 − α) · streaming`` per KV head; queries are the last ``q_len`` keys.

    Args:
        q: ``[b, heads, q_len, d]``; k, v: ``[b, kv_heads, k_len, d]`` (no padding).
        alpha: ``[kv_heads]`` gates (any real values; the trainer keeps them in [0, 1]).
        window: the streaming window (default: the spec's for ``k_len``).
    Returns:
        ``[b, heads, q_len, d]``.

    Both patterns run as masked SDPA: the ``[q_len, k_len]`` masks are small at the training
    lengths, and the streaming mask is the reference one (``masks.query_key_mask``), so the mix is
    exactly the served pattern at α = 0.
    """
    heads, kv_heads, q_len, k_len = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    if alpha.shape != (kv_heads,):
        raise HybridAttentionError(f"gates must be [kv_heads] = [{kv_heads}], got {tuple(alpha.shape)}")
    w = resolve_window(spec, k_len, window)
    qs = k_len - q_len
    causal = (torch.arange(k_len, device=q.device) <= torch.arange(qs, k_len, device=q.device).unsqueeze(1))
    stream_mask = query_key_mask(q_len, k_len, spec.streaming(), window=w, device=q.device)
    gqa = heads != kv_heads
    full = F.scaled_dot_product_attention(q, k, v, attn_mask=causal, scale=scale, enable_gqa=gqa)
    stream = F.scaled_dot_product_attention(q, k, v, attn_mask=stream_mask, scale=scale, enable_gqa=gqa)
    a = alpha.to(q.dtype).repeat_interleave(heads // kv_heads).view(1, heads, 1, 1)
    return stream + a * (full - stream)


class _GatedInterface:
    """``AttentionInterface`` entry running :func:`gated_attention` with stored prefix keys/values.

    For the trainer's unpadded single samples only: ``attention_mask`` is not read.

    ``prefix`` (per layer, ``[1, kv_heads, P, d]`` each) is prepended to the layer's keys/values:
    the model then runs only the tokens after the prefix (``position_ids`` start at ``P``).
    ``record`` collects each layer's keys/values of the whole input instead.
    """

    def __init__(self, spec: HybridAttentionConfig, gates: torch.Tensor) -> None:
        self.spec, self.gates = spec, gates
        self.prefix: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.record: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None

    def __call__(self, module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        layer = module.layer_idx
        if self.record is not None:  # targets: plain full causal attention over the whole sample
            self.record[layer] = (key.detach(), value.detach())
            out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling,
                                                 enable_gqa=query.shape[1] != key.shape[1])
            return out.transpose(1, 2).contiguous(), None
        if layer in self.prefix:
            pk, pv = self.prefix[layer]
            key, value = torch.cat([pk, key], 2), torch.cat([pv, value], 2)
        out = gated_attention(query, key, value, self.spec, self.gates[layer], scale=scaling)
        return out.transpose(1, 2).contiguous(), None


def _gated(model, interface: _GatedInterface):
    """Context manager: ``model`` runs ``interface``'s gated attention inside the block."""
    return attention_swapped(model, GATE_IMPLEMENTATION, interface)


def _decoder(model):
    """The decoder stack (``model.model`` for ``*ForCausalLM``): its output is the last hidden state."""
    return getattr(model, "model", model)


CONTEXTS = ("gated", "dense")


def train_gates(model, samples: list, spec: HybridAttentionConfig, *, steps: int = 120, lr: float = 0.05,
                l1: float = 0.05, seed: int = 0, progress: bool = True, context: str = "gated") -> GateResult:
    """Learn one gate per (layer, KV head) on the frozen ``model`` (gates start at 1: full attention).

    Args:
        samples: ``attention.heads.NeedleSample`` s (the loss covers ``question_start`` onwards: the
            question and the answer, where the needle must be retrieved).
        spec: the streaming pattern (sinks, window, globals) a head gets at α = 0.
        steps: optimizer steps, one sample each (cycling through a seeded shuffle).
        lr: Adam learning rate on the gates (projected back into [0, 1] after each step).
        l1: weight of the mean gate value in the loss (the MSE is relative to the target's mean square).
        context: ``"gated"`` (exact): every token after the streaming horizon runs under the gated mix at
            every step, so a step costs the whole sample past ``sink + window``. ``"dense"``: the text before
            the question keeps its full-attention keys/values and only the question and answer run gated;
            a step then costs those few tokens whatever the sample's length (what makes 4K–8K samples
            affordable on a CPU), at the price of ignoring how streaming changes the context's own states.
    The model's weights get no gradients; its attention implementation is restored afterwards.
    """
    from tqdm.auto import tqdm

    if steps < 1 or lr <= 0 or l1 < 0:
        raise HybridAttentionError(f"gate training needs steps >= 1, lr > 0, l1 >= 0; got {steps}, {lr}, {l1}")
    if context not in CONTEXTS:
        raise HybridAttentionError(f"unknown gate context {context!r}; use one of {', '.join(CONTEXTS)}")
    cfg = model.config
    layers = cfg.num_hidden_layers
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    device = next(model.parameters()).device
    gates = torch.ones(layers, kv_heads, device=device, requires_grad=True)
    interface = _GatedInterface(spec, gates)
    frozen = [p for p in model.parameters() if p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    history: list[dict] = []
    pressure = torch.zeros(layers, kv_heads)
    try:
        with _gated(model, interface):
            prepared = _prepare(model, interface, samples, spec, device, progress, context)
            opt = torch.optim.Adam([gates], lr=lr)
            order = list(range(len(prepared)))
            rng = random.Random(seed)
            bar = tqdm(range(steps), desc="head gates", disable=not progress, dynamic_ncols=True)
            for step in bar:
                if step % len(order) == 0:
                    rng.shuffle(order)
                mse = _gate_loss(model, interface, prepared[order[step % len(order)]])
                opt.zero_grad(set_to_none=True)
                mse.backward()
                with torch.no_grad():
                    if step >= steps // 2:  # how much reopening each head would lower the error, here
                        pressure -= gates.grad.cpu()
                    gates.grad += l1 / gates.numel()  # d(l1 · mean gate) / dα
                opt.step()
                with torch.no_grad():
                    gates.clamp_(0.0, 1.0)
                history.append({"mse": mse.item(), "mean_gate": gates.mean().item()})
                bar.set_postfix(mse=f"{history[-1]['mse']:.4f}", gate=f"{history[-1]['mean_gate']:.3f}")
    finally:
        for p in frozen:
            p.requires_grad_(True)
    return GateResult(gates.detach().cpu(), pressure / (steps - steps // 2), history)


def _prepare(model, interface: _GatedInterface, samples: list, spec: HybridAttentionConfig, device,
             progress: bool, context: str = "gated") -> list[dict]:
    """Per sample: the prefix's keys/values (gate-independent; with ``context="dense"`` everything before
    the question) and the full-attention targets (no grad)."""
    from tqdm.auto import tqdm

    prepared = []
    try:
        for s in tqdm(samples, desc="gate targets", disable=not progress, dynamic_ncols=True):
            n = len(s.ids)
            # Queries before sink + window see every earlier key in the streaming pattern too.
            horizon = spec.sink_tokens + resolve_window(spec, n)
            start = s.question_start if context == "dense" else min(horizon, s.question_start)
            if start <= 0 or s.question_start >= n:
                raise HybridAttentionError("a gate-training sample has no question after the streaming horizon; "
                                           "use longer samples")
            ids = torch.tensor([s.ids], device=device)
            interface.record, interface.prefix = {}, {}
            with torch.no_grad():
                hidden = _decoder(model)(input_ids=ids, use_cache=False).last_hidden_state[0]
            prefix = {li: (k[:, :, :start], v[:, :, :start]) for li, (k, v) in interface.record.items()}
            interface.record = None
            target = hidden[s.question_start:].float()
            prepared.append({"ids": ids[:, start:], "start": start, "loss_from": s.question_start - start,
                             "prefix": prefix, "target": target, "scale": target.pow(2).mean()})
    finally:
        interface.record = None
    return prepared


def _gate_loss(model, interface: _GatedInterface, item: dict) -> torch.Tensor:
    """Relative MSE between the gated model's last hidden states and the full-attention targets."""
    interface.prefix = item["prefix"]
    ids = item["ids"]
    positions = torch.arange(item["start"], item["start"] + ids.shape[1], device=ids.device).unsqueeze(0)
    hidden = _decoder(model)(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state[0]
    interface.prefix = {}
    return (hidden[item["loss_from"]:].float() - item["target"]).pow(2).mean() / item["scale"]
