"""A compact decoder forward over a Hugging Face causal LM's own modules, with our preallocated caches.

Why not ``model.generate``: its default cache grows by concatenation (a copy of the whole history at
every step) and the mask machinery is rebuilt per step. Here the weights, norms, MLPs and rotary
embedding are the HF modules themselves (no conversion, no copies); only the attention loop is ours,
reading and writing :class:`serve.kv_cache.KVCache`. Two swap-in pieces do all the work:
:meth:`DecoderModel.prefill` (one row, one chunk of the prompt) and :meth:`DecoderModel.decode_one_token`
(one token for each row of a contiguous block of rows).

Decode is bound by reading the weights once per step, and on CPU the layout of those weights decides
how fast they stream. With ``fast_weights`` (the CPU default) each layer's projections are fused
(q|k|v and gate|up become one matrix each, as do o and down alone) and reordered once into oneDNN's
blocked layout for small batches; decode steps then run oneDNN's linear directly on ordinary tensors
(the op PyTorch's own compiler emits for frozen CPU linears). SmolLM2-135M on 2 cores, all
projections of the 30 layers plus the head: 24 ms at 1 or at 8 rows, against 33 ms for MKL's
matrix-vector kernel at 1 row and 41 ms at 8 rows for a oneDNN linear that converts its input and
output at every call.

Prefill runs through the same copies: the blocked layout beats MKL on the model's own weights at
prompt-sized row counts too (SmolLM2-135M-class student, 1 thread, interleaved medians: 1.6x per token
in 64-token chunks, 1.7x in 512-token ones; ``bench/prefill.py``), and a short prompt's prefill is
most of its time to first token. The reordered copies cost one more copy of the projection and head
weights; ``fast_weights=False`` runs with the model's weights and holds nothing extra. Without oneDNN
the fused weights run through ``F.linear``.

A W8A8 export (``quantize=w8a8``, :mod:`serve.quantize`) gets fused copies of its int8 weights instead,
prepacked for oneDNN's int8 GEMM (``onednn.qlinear_pointwise``); each call quantizes its input per token
(:func:`quantize_per_token`, torchao's own rule) and scales the int32 result back, which is torchao's
W8A8 linear computed faster (its CPU path and its weight-only sibling are slower than fp32 here). Prefill
goes through them too; the head stays fp32. A weight-only int8 export (``quantize=int8``) gets fused copies of its
int8 weights run by ``torch._weight_int8pack_mm`` with activations rounded to bf16 (its fast CPU kernel;
with fp32 activations it is a slow reference loop). Other torchao layouts run through torchao's linears.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from attention.integration import SUPPORTED_MODEL_TYPES
from attention.kernel import cpu_flash_op, merge_partial_attention
from attention.masks import allowed
from attention.spec import CONFIG_KEY, HybridAttentionConfig
from serve.kv_cache import KVCache, MixedKVCache


def hybrid_spec(config) -> HybridAttentionConfig | None:
    """The hybrid attention spec stored in a model config under ``"hybrid_attention"``, else None (dense)."""
    d = getattr(config, CONFIG_KEY, None)
    if d is None:
        return None
    return d if isinstance(d, HybridAttentionConfig) else HybridAttentionConfig.from_dict(dict(d))


def attention_spans(row_slots: Sequence[int], n_slots: int, *, min_saving: float = 0.25
                    ) -> list[tuple[int, int, int]] | None:
    """Contiguous spans of rows ``(start, end, slots)`` for one decode step, each attending over the most
    slots any of its rows needs, or None to attend over ``n_slots`` all together.

    Cost model: a span costs the bytes it reads, ``rows * slots``, plus a fixed overhead of one row's
    worth of ``n_slots / 32`` per extra attention call. Rows are cut where it saves at least ``min_saving``
    of the batched read: one row per span unless two neighbours need nearly the same. ``row_slots``:
    ``[batch]`` slots each row needs.
    """
    b = len(row_slots)
    if b < 2:
        return None
    batched = b * n_slots
    spans: list[tuple[int, int, int]] = []
    for r, n in enumerate(row_slots):
        n = max(1, min(int(n), n_slots))
        if spans:
            a, e, m = spans[-1]
            merged = (e - a + 1) * max(m, n)
            if merged <= (e - a) * m + n + n_slots / 32:  # joining costs less than another call
                spans[-1] = (a, r + 1, max(m, n))
                continue
        spans.append((r, r + 1, n))
    cost = sum((e - a) * m for a, e, m in spans) + (len(spans) - 1) * n_slots / 32
    return spans if len(spans) > 1 and cost <= (1 - min_saving) * batched else None


def _check_supported(config) -> None:
    mt = getattr(config, "model_type", None)
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {mt!r} is not supported by the serving engine; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    sliding = getattr(config, "sliding_window", None) if mt == "mistral" else None
    if mt == "qwen2" and getattr(config, "use_sliding_window", False):
        sliding = config.sliding_window
    if sliding is not None and sliding < config.max_position_embeddings:
        raise ValueError(f"{mt} sliding_window={sliding} is not served; store it as a hybrid spec "
                         f"(sink_tokens=0, window={sliding}, global_every=0) under {CONFIG_KEY!r} instead")


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[b, heads, t, d]`` by ``cos``/``sin`` ``[b, t, d]`` (rotate-half convention of HF)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin


@functools.cache
def _onednn_linear_available() -> bool:
    """Whether this build has oneDNN's prepacked linear (``torch.ops.mkldnn._linear_pointwise``)."""
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(2, 2), _PACK_ROWS)
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(1, 2), w, None, "none", [], "")
        return bool(torch.equal(out, torch.full((1, 2), 2.0)))
    except (AttributeError, RuntimeError):
        return False


_PACK_ROWS = 8  # the row count oneDNN tunes the layout for; measured as good from 1 to 64 rows


@functools.cache
def _onednn_int8_available() -> bool:
    """Whether this build and CPU have a correct oneDNN int8 linear (``torch.ops.onednn.qlinear_pointwise``).

    Probed at the extremes, through the u8 form the engine uses: on CPUs without VNNI (AVX2 only) oneDNN's
    u8 x s8 kernels sum pairs of products in int16 and saturate (measured here on an AVX2-only AMD EPYC: 54 %
    of outputs wrong, by up to 10x), so there the engine keeps torchao's own W8A8 linear.
    """
    try:
        xq = torch.tensor([[127] * 64, [-128, 127] * 32], dtype=torch.int8)  # [2, 64]
        wq = torch.tensor([[127] * 64, [-128] * 64, [127, -128] * 32], dtype=torch.int8)  # [3, 64]
        w = torch.ops.onednn.qlinear_prepack(wq, None)
        u8 = (xq.to(torch.int16) + 128).to(torch.uint8)
        out = _qlinear(u8, w, torch.ones(3), torch.zeros(3, dtype=torch.long))
        exact = (xq.long() @ wq.long().T).float()  # [2, 3], every value exact in fp32
        return bool(torch.equal(out, exact))
    except (AttributeError, RuntimeError):
        return False


_ONE, _ZERO, _U8_ZERO = torch.ones(()), torch.zeros((), dtype=torch.long), torch.full((), 128, dtype=torch.long)


def _qlinear(xq: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, w_zp: torch.Tensor) -> torch.Tensor:
    """oneDNN int8 GEMM -> fp32: ``(xq @ wq.T) * w_scale`` (exact int32 accumulation, then one scale).

    ``xq`` ``[rows, in]``: int8, or uint8 holding int8 + 128 (zero point 128; the same result, and
    oneDNN's fast u8 x s8 kernels: with s8 activations it falls back to a reference kernel ~100x slower,
    measured); ``w`` from ``qlinear_prepack``; ``w_scale`` ``[out]`` fp32.
    """
    zp = _U8_ZERO if xq.dtype == torch.uint8 else _ZERO
    return torch.ops.onednn.qlinear_pointwise.tensor(xq, _ONE, zp, w, w_scale, w_zp, None, 1.0, 0,
                                                     torch.float32, "none", [None], "")


def int8_w8a8_parts(linear: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(qdata [out, in] int8, scale [out] fp32)`` of a torchao W8A8 linear, else None.

    W8A8 = torchao's ``Int8DynamicActivationInt8WeightConfig`` as :mod:`serve.quantize` exports it:
    symmetric int8 weights with one scale per output row, activations quantized per token (symmetric
    int8, dynamic). Anything else (weight-only int8, static or asymmetric activations, groups) is None
    and keeps running through torchao's own linear.
    """
    w = getattr(linear, "weight", None)
    kw = getattr(w, "act_quant_kwargs", None)
    qdata, scale = getattr(w, "qdata", None), getattr(w, "scale", None)
    if kw is None or qdata is None or scale is None or qdata.dtype != torch.int8 or qdata.dim() != 2:
        return None
    static = getattr(w, "act_quant_scale", None) is not None or getattr(w, "act_pre_scale", None) is not None
    zp = getattr(w, "zero_point", None)
    symmetric = str(getattr(kw, "mapping_type", "")).endswith("SYMMETRIC") and not str(kw.mapping_type).endswith(
        "ASYMMETRIC")
    per_token = type(getattr(kw, "granularity", None)).__name__ == "PerRow" and not getattr(kw, "reduce_range", False)
    per_row_w = list(getattr(w, "block_size", [])) == [1, qdata.shape[1]] and scale.numel() == qdata.shape[0]
    if static or not symmetric or not per_token or not per_row_w or (zp is not None and bool(zp.any())):
        return None
    return qdata.detach(), scale.detach().reshape(-1).float()


def int8_weight_only_parts(linear: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(qdata [out, in] int8, scale [out] fp32)`` of a torchao weight-only int8 linear, else None.

    Weight-only = torchao's ``Int8WeightOnlyConfig`` as :mod:`serve.quantize` exports it (``quantize=int8``):
    symmetric int8 weights, one scale per output row, activations left in floating point.
    """
    w = getattr(linear, "weight", None)
    qdata, scale = getattr(w, "qdata", None), getattr(w, "scale", None)
    if qdata is None or scale is None or qdata.dtype != torch.int8 or qdata.dim() != 2:
        return None
    if getattr(w, "act_quant_kwargs", None) is not None or getattr(w, "act_pre_scale", None) is not None:
        return None
    zp = getattr(w, "zero_point", None)
    if list(getattr(w, "block_size", [])) != [1, qdata.shape[1]] or scale.numel() != qdata.shape[0] or (
            zp is not None and bool(zp.any())):
        return None
    return qdata.detach(), scale.detach().reshape(-1).float()


_INT8PACK_K = 16  # in_features must be a multiple (torch 2.13 CPU kernel, checked: other K segfault)


@functools.cache
def _int8pack_available() -> bool:
    """Whether this build has a CPU ``torch._weight_int8pack_mm`` for bf16 activations (int8 weights, one
    scale per row): the kernel that makes weight-only int8 decode fast (with fp32 activations it is a slow
    reference loop on CPU, measured ~10x slower than the fp32 linear)."""
    try:  # K = 16: the CPU kernel reads K in blocks of 16 and crashes (segfault) on other K; see _Fused
        out = torch._weight_int8pack_mm(torch.ones(1, _INT8PACK_K, dtype=torch.bfloat16),
                                        torch.ones(2, _INT8PACK_K, dtype=torch.int8), torch.ones(2, dtype=torch.bfloat16))
        return bool(torch.equal(out.float(), torch.full((1, 2), float(_INT8PACK_K))))
    except (AttributeError, RuntimeError):
        return False


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row of ``x`` ``[rows, in]`` -> (int8 ``[rows, in]``, fp32 scale ``[rows, 1]``).

    The same rule as torchao's dynamic int8 activations (``choose_qparams_affine`` symmetric: scale =
    max |x| / 127.5, at least fp32 eps; values rounded and clamped to [-128, 127]), so the engine's
    int8 path computes what the exported model computes when transformers loads it.
    """
    q, scale = _quantize_per_token_u8(x)
    return (q.to(torch.int16) - 128).to(torch.int8), scale


def _quantize_per_token_u8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_per_token` shifted by 128 into uint8 (what :func:`_qlinear` runs fast)."""
    # torchao: the scale in x's dtype, stored fp32; x * (1 / scale) then promotes to fp32 (bf16 x too)
    scale = (x.abs().amax(-1, keepdim=True) / 127.5).clamp_min(torch.finfo(torch.float32).eps).float()
    q = torch.round(x * (1.0 / scale)).clamp_(-128, 127).add_(128)
    return q.to(torch.uint8), scale


def row_bucket(rows: int) -> int:
    """The row count a prepacked oneDNN linear runs ``rows`` input rows at (the rest are zero padding).

    oneDNN builds and keeps one primitive per input shape (its primitive cache, up to 1024, each ~0.6 MB
    of kernels here), so every new prefill chunk length used to add resident memory that is never given
    back: a single 3,900-token prompt's 43 distinct chunk lengths added ~100 MB (a 10-minute soak's
    "growth"), and each new length cost a kernel build in some request's time to first token. Up to 8
    rows (decode batches) run as they are; longer inputs are padded to a multiple of 8 up to 256 rows and
    of 64 beyond: 27 shapes up to the server's largest chunk (160 rows), for at most 7 padding rows there
    (a 128-token chunk: none; 97- and 113-token prompts: 104 and 120 rows, 7 % and 6 % more time on 2
    threads; 70 tokens: 72 rows, no measurable change).
    """
    if rows <= 8:
        return rows
    step = 8 if rows <= 256 else 64
    return -(-rows // step) * step


def row_buckets(max_rows: int) -> list[int]:
    """Every :func:`row_bucket` value for inputs of 1 .. ``max_rows`` rows."""
    return sorted({row_bucket(r) for r in range(1, max_rows + 1)})


class _Fused:
    """Linears that share their input, fused into one matrix in the decode layout (module docstring).

    ``weight``: the fused ``[sum(out), in]`` matrix, reordered for oneDNN when ``packed`` (an opaque
    tensor only ``_linear_pointwise`` reads), plain otherwise; ``bias``: fused, or None when no part
    has one.
    """

    def __init__(self, linears: list[nn.Linear]) -> None:
        parts = [int8_w8a8_parts(m) for m in linears]
        self.int8 = all(p is not None for p in parts) and _onednn_int8_available()
        wo = [int8_weight_only_parts(m) for m in linears]
        # Weight-only int8: int8 weights, activations rounded to bf16 for torch's int8-weight GEMM.
        self.w8 = not self.int8 and _Fused._w8_fusable(wo)
        if self.int8:  # int8 weights stay int8: oneDNN's int8 GEMM (VNNI where the CPU has it)
            q = torch.cat([p[0] for p in parts], dim=0)
            self.scale = torch.cat([p[1] for p in parts])
            self._zp = torch.zeros(q.shape[0], dtype=torch.long, device=q.device)
            self._out, self._in = q.shape
            self.weight = torch.ops.onednn.qlinear_prepack(q, None)
        elif self.w8:
            self.weight = torch.cat([p[0] for p in wo], dim=0).contiguous()
            self.scale = torch.cat([p[1] for p in wo]).to(torch.bfloat16)
            self._out, self._in = self.weight.shape
        else:
            w = torch.cat([m.weight.detach() for m in linears], dim=0)  # [out, in]
            self._out, self._in = w.shape
        self.bias: torch.Tensor | None = None
        if any(m.bias is not None for m in linears):
            ref = next(m.bias for m in linears if m.bias is not None).detach()
            self.bias = torch.cat([m.bias.detach() if m.bias is not None else ref.new_zeros(m.out_features)
                                   for m in linears])
            if self.int8 or self.w8:  # added to an fp32 result
                self.bias = self.bias.float()
        self.packed = False
        if not self.int8 and not self.w8:
            self.packed = w.device.type == "cpu" and w.dtype == torch.float32 and _onednn_linear_available()
            self.weight = torch.ops.mkldnn._reorder_linear_weight(w, _PACK_ROWS) if self.packed else w

    @staticmethod
    def fusable(linears: list[nn.Module]) -> bool:
        """Whether ``linears`` can be fused: all plain weights, or all torchao W8A8 (:func:`int8_w8a8_parts`)."""
        plain = [type(m.weight) in (torch.Tensor, nn.Parameter) for m in linears]
        return (all(plain) or (all(int8_w8a8_parts(m) is not None for m in linears) and _onednn_int8_available())
                or _Fused._w8_fusable([int8_weight_only_parts(m) for m in linears]))

    @staticmethod
    def _w8_fusable(parts: list[tuple[torch.Tensor, torch.Tensor] | None]) -> bool:
        """Weight-only int8 parts that torch's int8-weight kernel can run (CPU, in_features % 16 == 0)."""
        return (all(p is not None and p[0].device.type == "cpu" and p[0].shape[1] % _INT8PACK_K == 0 for p in parts)
                and _int8pack_available())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[rows, t, in]`` -> ``[rows, t, sum(out)]``."""
        if self.int8:
            xq, xs = _quantize_per_token_u8(x.reshape(-1, self._in))
            y = _qlinear(xq, self.weight, self.scale, self._zp) * xs
            y = y if self.bias is None else y + self.bias
            return y.to(x.dtype).view(*x.shape[:-1], self._out)  # fp32 result: back to the model's dtype
        if self.w8:  # bf16 in, bf16 out (fp32 accumulation inside); the residual stream keeps its dtype
            y = torch._weight_int8pack_mm(x.reshape(-1, self._in).to(torch.bfloat16), self.weight, self.scale).float()
            y = y if self.bias is None else y + self.bias
            return y.to(x.dtype).view(*x.shape[:-1], self._out)
        if self.packed:
            x2 = x.reshape(-1, self._in)
            rows = x2.shape[0]
            padded = row_bucket(rows)
            if padded != rows:
                x2 = torch.cat([x2, x2.new_zeros(padded - rows, self._in)])
            y = torch.ops.mkldnn._linear_pointwise(x2.contiguous(), self.weight, self.bias, "none", [], "")
            return y[:rows].view(*x.shape[:-1], self._out)
        return F.linear(x, self.weight, self.bias)

    @property
    def out_features(self) -> int:
        return self._out

    def nbytes(self) -> int:
        if self.int8:  # the prepacked int8 weight (an opaque layout of out x in bytes) and its scales
            return self._out * self._in + self.scale.numel() * 4
        if self.w8:
            return self._out * self._in + self.scale.numel() * 2
        return self.weight.numel() * self.weight.element_size()


class _LayerWeights:
    """One decoder layer's fused projections."""

    def __init__(self, layer: nn.Module) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv = _Fused([attn.q_proj, attn.k_proj, attn.v_proj])
        self.o = _Fused([attn.o_proj])
        self.gate_up = _Fused([mlp.gate_proj, mlp.up_proj])
        self.down = _Fused([mlp.down_proj])

    @staticmethod
    def fusable(layer: nn.Module) -> bool:
        attn, mlp = layer.self_attn, layer.mlp
        return all(_Fused.fusable(g) for g in ([attn.q_proj, attn.k_proj, attn.v_proj], [attn.o_proj],
                                               [mlp.gate_proj, mlp.up_proj], [mlp.down_proj]))


class _LayerRoles:
    """Index tensors of one layer's full and streaming heads (query heads follow their KV head)."""

    def __init__(self, full: tuple[int, ...], n_kv: int, n_heads: int, device: torch.device) -> None:
        group = n_heads // n_kv
        stream = [h for h in range(n_kv) if h not in full]
        self.n_full, self.n_stream = len(full), len(stream)
        self.kv_full = torch.tensor(full, dtype=torch.long, device=device)
        self.kv_stream = torch.tensor(stream, dtype=torch.long, device=device)
        q_of = lambda kv: [h * group + j for h in kv for j in range(group)]  # noqa: E731
        self.q_full = torch.tensor(q_of(full), dtype=torch.long, device=device)
        self.q_stream = torch.tensor(q_of(stream), dtype=torch.long, device=device)
        # Outputs come back as [full heads, streaming heads]: this puts them in the model's head order.
        self.inverse = torch.argsort(torch.cat([self.q_full, self.q_stream]))

    def split(self, x: torch.Tensor, query: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``[b, heads, t, d]`` -> (full part, streaming part) along the head dim."""
        f, s = (self.q_full, self.q_stream) if query else (self.kv_full, self.kv_stream)
        if not self.n_stream:
            return x, x[:, :0]
        if not self.n_full:
            return x[:, :0], x
        return x.index_select(1, f), x.index_select(1, s)

    def join(self, full: torch.Tensor | None, stream: torch.Tensor | None) -> torch.Tensor:
        if stream is None:
            return full
        if full is None:
            return stream
        return torch.cat([full, stream], 1).index_select(1, self.inverse)


class DecoderModel(nn.Module):
    """Wraps an HF ``*ForCausalLM`` (Llama / Mistral / Qwen2) for cached decoding.

    Args:
        hf_model: the model; its modules are used in place (weights are not copied, except below).
        fast_weights: prefill and decode through fused copies of the projections in CPU-friendly layouts (default:
            on for CPU, off elsewhere); they cost one more copy of those weights. Module docstring.
    """

    def __init__(self, hf_model: nn.Module, *, fast_weights: bool | None = None) -> None:
        super().__init__()
        config = hf_model.config
        _check_supported(config)
        self.hf = hf_model.eval()
        self.config = config
        self.spec = hybrid_spec(config)
        self.n_heads = config.num_attention_heads
        self.n_kv = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.n_heads
        inner = hf_model.model
        self.embed = inner.embed_tokens
        self.layers = inner.layers
        self.norm = inner.norm
        self.rotary = inner.rotary_emb
        self.lm_head = hf_model.lm_head
        if fast_weights is None:
            fast_weights = self.lm_head.weight.device.type == "cpu"
        # Per-head roles: which query / KV heads of each layer are full, which stream (None: no roles).
        self._roles: list[_LayerRoles] | None = None
        if self.spec is not None and self.spec.has_head_roles:
            self.spec.check_model(len(self.layers), self.n_kv)
            self._roles = [_LayerRoles(self.spec.full_kv_heads(li, self.n_kv), self.n_kv, self.n_heads,
                                       self.embed.weight.device) for li in range(len(self.layers))]
        self._fast: list[_LayerWeights] = []
        self._fast_head: _Fused | None = None
        if fast_weights and all(_LayerWeights.fusable(layer) for layer in self.layers):
            with torch.no_grad():
                self._fast = [_LayerWeights(layer) for layer in self.layers]
                if _Fused.fusable([self.lm_head]):
                    self._fast_head = _Fused([self.lm_head])
        # Prefill through the fused copies as well (module docstring); for int8 (torchao W8A8) layers
        # that is the same math as torchao's linear, in oneDNN's int8 GEMM instead of its slower CPU path.
        self._prefill_fast = bool(self._fast)

    def refresh_fast_weights(self) -> None:
        """Rebuild the decode copies from the model's current weights (no-op without ``fast_weights``).

        The copies are snapshots: a caller that changes the weights in place (a trainer decoding from
        the live student, :mod:`distill.on_policy`) calls this after each change, before decoding.
        The old copies are dropped first, so memory never holds two sets.
        """
        if not self._fast:  # the layers' copies decide (a head that cannot be fused has none of its own)
            return
        fused_head = self._fast_head is not None
        self._fast, self._fast_head = [], None
        with torch.no_grad():
            self._fast = [_LayerWeights(layer) for layer in self.layers]
            self._fast_head = _Fused([self.lm_head]) if fused_head else None

    @torch.no_grad()
    def warm_kernels(self, max_prefill_rows: int, max_batch: int) -> int:
        """Build every oneDNN linear primitive serving will use now, on the calling thread (:func:`row_bucket`).

        One layer's fused projections at each padded prefill length up to ``max_prefill_rows`` and each
        decode batch up to ``max_batch`` (the primitives are shared by every layer of one shape), and the
        fused head at the decode batches (a prefill's last-position logits are batch 1). Their memory is then resident before
        the first request instead of arriving with it. Returns how many shapes ran (0 without fast weights).
        """
        if not self._fast:
            return 0
        w = self._fast[0]
        rows = sorted(set(row_buckets(max_prefill_rows)) | set(range(1, max_batch + 1)))
        for r in rows:
            for f in (w.qkv, w.o, w.gate_up, w.down):
                f(self.embed.weight.new_zeros(1, r, f._in))
        if self._fast_head is not None:
            for r in range(1, max_batch + 1):
                self._fast_head(self.embed.weight.new_zeros(r, 1, self._fast_head._in))
        return len(rows)

    def fast_weight_bytes(self) -> int:
        """Memory held by the decode weight copies (0 with ``fast_weights=False``)."""
        parts = ([self._fast_head] if self._fast_head is not None else []) + [
            f for w in self._fast for f in (w.qkv, w.o, w.gate_up, w.down)]
        return sum(f.nbytes() for f in parts)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def new_cache(self, rows: int, max_seq_len: int, *, dense: bool = False) -> KVCache | MixedKVCache:
        """A cache of ``rows`` sequences up to ``max_seq_len`` tokens (bounded for hybrid models).

        With per-head roles: a :class:`MixedKVCache`, full for the full heads, bounded for the rest.
        """
        if not dense and self._roles is not None:
            return MixedKVCache(layers=len(self.layers), rows=rows, kv_heads=self.n_kv, head_dim=self.head_dim,
                                max_seq_len=max_seq_len, spec=self.spec, dtype=self.dtype, device=self.device)
        return KVCache(layers=len(self.layers), rows=rows, kv_heads=self.n_kv, head_dim=self.head_dim,
                       max_seq_len=max_seq_len, spec=None if dense else self.spec, dtype=self.dtype,
                       device=self.device)

    def _qkv(self, attn: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        b, t, _ = x.shape
        q = attn.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        return _rope(q, cos, sin), _rope(k, cos, sin), v

    def _finish_layer(self, layer: nn.Module, h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = o.shape
        h = h + layer.self_attn.o_proj(o.transpose(1, 2).reshape(b, t, -1))
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def _qkv_fast(self, w: _LayerWeights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """:meth:`_qkv` (``x`` ``[b, t, hidden]``) through the fused q|k|v copy."""
        b, t, _ = x.shape
        q_width, kv_width = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        q, k, v = w.qkv(x).split([q_width, kv_width, kv_width], dim=-1)
        q = q.reshape(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.reshape(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        return _rope(q, cos, sin), _rope(k, cos, sin), v.reshape(b, t, self.n_kv, self.head_dim).transpose(1, 2)

    def _finish_layer_fast(self, w: _LayerWeights, layer: nn.Module, h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """:meth:`_finish_layer` through the fused o, gate|up and down copies."""
        h = h + w.o(o.transpose(1, 2).reshape(h.shape[0], h.shape[1], -1))
        gate, up = w.gate_up(layer.post_attention_layernorm(h)).chunk(2, dim=-1)
        return h + w.down(layer.mlp.act_fn(gate) * up)

    def _qkv_prefill(self, li: int, layer: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Prefill projections: the fused copies when the model has them, else its own weights."""
        if self._prefill_fast:
            return self._qkv_fast(self._fast[li], x, cos, sin)
        return self._qkv(layer.self_attn, x, cos, sin)

    def _finish_prefill(self, li: int, layer: nn.Module, h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        if self._prefill_fast:
            return self._finish_layer_fast(self._fast[li], layer, h, o)
        return self._finish_layer(layer, h, o)

    def _chunk_logits(self, h: torch.Tensor, which: bool | str) -> torch.Tensor | None:
        """A prefill chunk's ``[1, t, hidden]`` -> the logits :meth:`prefill` returns for ``which``."""
        if which == "all":
            return self._logits(h[0])
        return self._logits(h[:, -1])[0] if which else None

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """A prefill's positions ``[n, hidden]`` (its last alone: ``n`` 1) -> ``[n, vocab]`` fp32 logits.

        Through the fused head when prefill uses the fused copies: at one row the head is a matrix-vector
        product bound by reading the whole vocabulary matrix, which oneDNN's packed layout does faster than
        the plain weight (``bench/prefill.py``), and its batch-1 kernel is already built for decode.
        """
        h = self.norm(h)
        if self._prefill_fast and self._fast_head is not None:
            return self._fast_head(h[:, None])[:, 0].float()
        return self.lm_head(h).float()

    @staticmethod
    def _dense_chunk_attention(flash, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, old_k: torch.Tensor,
                               old_v: torch.Tensor, scale: float) -> torch.Tensor:
        """Causal attention of a prefill chunk over the keys before it plus its own, for a dense cache.

        A boolean mask over all those keys slows the fused CPU kernel down (the last 512-token chunk of
        an 8K prompt, one layer, 2 cores: 105 ms with the mask, 82 ms without). Instead: one causal
        call over the chunk's own keys and, when keys came before, one unmasked call over those,
        merged by log-sum-exp.

        Args:
            q: ``[1, heads, t, d]``; k, v: ``[1, kv_heads, t, d]``; old_k, old_v: ``[1, kv_heads, n_old, d]``.
        Returns:
            ``[1, heads, t, d]``.
        """
        o, lse = flash(q, k, v, is_causal=True, scale=scale)
        if old_k.shape[2]:
            merge_partial_attention(o, lse, *flash(q, old_k, old_v, scale=scale))
        return o

    @torch.inference_mode()
    def prefill(self, cache: KVCache, row: int, ids: torch.Tensor, start: int, logits: bool | str = True,
                between: Callable[[], None] | None = None) -> torch.Tensor | None:
        """Run one chunk of one row's prompt through the model and store its keys/values.

        Args:
            ids: ``[chunk]`` token ids at absolute positions ``start .. start + chunk - 1``; the cache
                row already holds positions ``< start``.
            logits: compute the last position's logits (False for a chunk that does not end the
                prompt: the head is a full read of the embedding matrix, skipped when unused); ``"all"``:
                every position's (a prompt's own log-probabilities).
            between: called after every layer but the last (the engine's overtaking,
                :meth:`serve.engine.Engine.overtake`); it may run forwards of other cache rows, never
                of ``row``.
        Returns:
            ``[vocab]`` fp32 logits of the chunk's last position (``[chunk, vocab]`` with ``"all"``), or None
            without ``logits``.
        """
        if isinstance(cache, MixedKVCache):
            return self._prefill_mixed(cache, row, ids, start, logits, between)
        t = ids.shape[0]
        pos = torch.arange(start, start + t, device=ids.device)
        h = self.embed(ids)[None]  # [1, t, hidden]
        cos, sin = self.rotary(h, pos[None])
        # Keys already cached (positions < start), then the chunk itself under the hybrid/causal rule.
        n_old = cache.used_slots(start - 1) if start > 0 else 0
        flash = cpu_flash_op() if not cache.bounded and h.device.type == "cpu" else None
        mask = None
        if flash is None:
            i, j = pos[:, None], pos[None, :]
            mask = allowed(pos, pos, cache.spec, int(cache.window[row])) if cache.bounded else j <= i
            if n_old:
                old = cache.visible(pos[None], slice(row, row + 1), n_old)[0, 0]  # [t, n_old]
                mask = torch.cat([old, mask], dim=-1)
            mask = mask[None, None]
        idx, slot = cache.prefill_slots(row, pos)
        for li, layer in enumerate(self.layers):
            x = layer.input_layernorm(h)
            q, k, v = self._qkv_prefill(li, layer, x, cos, sin)
            scale = layer.self_attn.scaling
            old_k, old_v = cache.k[li, row, :, :n_old][None], cache.v[li, row, :, :n_old][None]
            if flash is not None:
                o = self._dense_chunk_attention(flash, q, k, v, old_k, old_v, scale)
            else:
                kk, vv = (torch.cat([old_k, k], dim=2), torch.cat([old_v, v], dim=2)) if n_old else (k, v)
                o = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, scale=scale,
                                                   enable_gqa=self.n_kv != self.n_heads)
            cache.write_prefill(li, row, idx, slot, k[0], v[0])
            h = self._finish_prefill(li, layer, h, o)
            if between is not None and li < len(self.layers) - 1:
                between()
        cache.commit_prefill(row, pos, idx, slot)
        return self._chunk_logits(h, logits)

    @torch.inference_mode()
    def decode_one_token(self, cache: KVCache, tokens: torch.Tensor, pos: torch.Tensor, n_slots: int,
                         row_slots: Sequence[int] | None = None, between: Callable[[], None] | None = None
                         ) -> torch.Tensor:
        """One decode step for cache rows ``0 .. batch - 1``.

        Args:
            tokens: ``[batch]`` the last token of each row; ``pos``: ``[batch]`` its absolute position.
            n_slots: attend over the first ``n_slots`` cache slots (all rows' keys live there).
            row_slots: optional ``[batch]`` slots each row needs (``<= n_slots``). With a dense cache, when
                they are uneven enough (:func:`attention_spans`), the attention runs per span of rows over
                that span's own slots instead of every row over ``n_slots``: one long request then no longer
                makes every row read a long cache (decode is bound by the bytes it reads). Same result.
            between: called after every layer but the last; it may run forwards of cache rows ``>= batch``
                only (:meth:`prefill`).
        Returns:
            ``[batch, vocab]`` fp32 logits.
        """
        if isinstance(cache, MixedKVCache):
            return self._decode_mixed(cache, tokens, pos, n_slots, between)
        b = tokens.shape[0]
        rows = slice(0, b)
        h = self.embed(tokens)[:, None]  # [b, 1, hidden]
        cos, sin = self.rotary(h, pos[:, None])
        ring_slot, pslot = cache.decode_slots(rows, pos)
        spans = attention_spans(row_slots, n_slots) if row_slots is not None and not cache.bounded else None
        spans = spans or [(0, b, n_slots)]
        masks = [cache.visible(pos[a:e, None], slice(a, e), n) for a, e, n in spans]  # [e - a, 1, 1, n] each
        for li, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            fast = self._fast[li] if self._fast else None
            q, k, v = self._qkv(attn, x, cos, sin) if fast is None else self._qkv_fast(fast, x, cos, sin)
            cache.write_decode(li, rows, ring_slot, pslot, k[:, :, 0], v[:, :, 0])
            parts = [F.scaled_dot_product_attention(q[a:e], cache.k[li, a:e, :, :n], cache.v[li, a:e, :, :n],
                                                    attn_mask=m, scale=attn.scaling,
                                                    enable_gqa=self.n_kv != self.n_heads)
                     for (a, e, n), m in zip(spans, masks)]
            o = parts[0] if len(parts) == 1 else torch.cat(parts)
            h = self._finish_layer(layer, h, o) if fast is None else self._finish_layer_fast(fast, layer, h, o)
            if between is not None and li < len(self.layers) - 1:
                between()
        h = self.norm(h)
        head = self.lm_head if self._fast_head is None else self._fast_head
        return head(h)[:, 0].float()

    # ---- per-head roles: full heads over the dense cache, streaming heads over the bounded one ----------

    @torch.inference_mode()
    def _prefill_mixed(self, cache: MixedKVCache, row: int, ids: torch.Tensor, start: int, logits: bool | str = True,
                       between: Callable[[], None] | None = None) -> torch.Tensor | None:
        """:meth:`prefill` for a :class:`MixedKVCache` (same arguments and result)."""
        fc, sc = cache.full, cache.stream
        t = ids.shape[0]
        pos = torch.arange(start, start + t, device=ids.device)
        h = self.embed(ids)[None]
        cos, sin = self.rotary(h, pos[None])
        n_old_f = fc.used_slots(start - 1) if start > 0 else 0
        n_old_s = sc.used_slots(start - 1) if start > 0 else 0
        flash = cpu_flash_op() if h.device.type == "cpu" else None
        smask = allowed(pos, pos, sc.spec, int(sc.window[row]))
        if n_old_s:
            smask = torch.cat([sc.visible(pos[None], slice(row, row + 1), n_old_s)[0, 0], smask], dim=-1)
        fmask = None
        if flash is None:
            fmask = pos[None, :] <= pos[:, None]
            if n_old_f:
                fmask = torch.cat([fc.visible(pos[None], slice(row, row + 1), n_old_f)[0, 0], fmask], dim=-1)
            fmask = fmask[None, None]
        smask = smask[None, None]
        idx_f, slot_f = fc.prefill_slots(row, pos)
        idx_s, slot_s = sc.prefill_slots(row, pos)
        for li, layer in enumerate(self.layers):
            roles = self._roles[li]
            x = layer.input_layernorm(h)
            q, k, v = self._qkv_prefill(li, layer, x, cos, sin)
            scale = layer.self_attn.scaling
            (qf, qs), (kf, ks), (vf, vs) = roles.split(q, True), roles.split(k, False), roles.split(v, False)
            of = os = None
            if roles.n_full:
                a, b = cache.full_range[li]
                old_k, old_v = fc.k[0, row, a:b, :n_old_f][None], fc.v[0, row, a:b, :n_old_f][None]
                if flash is not None:
                    of = self._dense_chunk_attention(flash, qf, kf, vf, old_k, old_v, scale)
                else:
                    of = F.scaled_dot_product_attention(qf, torch.cat([old_k, kf], 2), torch.cat([old_v, vf], 2),
                                                        attn_mask=fmask, scale=scale, enable_gqa=roles.n_full != qf.shape[1])
                fc.write_prefill(0, row, idx_f, slot_f, kf[0], vf[0], heads=slice(a, b))
            if roles.n_stream:
                c, d = cache.stream_range[li]
                old_k, old_v = sc.k[0, row, c:d, :n_old_s][None], sc.v[0, row, c:d, :n_old_s][None]
                os = F.scaled_dot_product_attention(qs, torch.cat([old_k, ks], 2), torch.cat([old_v, vs], 2),
                                                    attn_mask=smask, scale=scale,
                                                    enable_gqa=roles.n_stream != qs.shape[1])
                sc.write_prefill(0, row, idx_s, slot_s, ks[0], vs[0], heads=slice(c, d))
            h = self._finish_prefill(li, layer, h, roles.join(of, os))
            if between is not None and li < len(self.layers) - 1:
                between()
        fc.commit_prefill(row, pos, idx_f, slot_f)
        sc.commit_prefill(row, pos, idx_s, slot_s)
        return self._chunk_logits(h, logits)

    @torch.inference_mode()
    def _decode_mixed(self, cache: MixedKVCache, tokens: torch.Tensor, pos: torch.Tensor, n_slots: int,
                      between: Callable[[], None] | None = None) -> torch.Tensor:
        """:meth:`decode_one_token` for a :class:`MixedKVCache`; ``n_slots`` counts the full cache's slots."""
        fc, sc = cache.full, cache.stream
        b = tokens.shape[0]
        rows = slice(0, b)
        h = self.embed(tokens)[:, None]
        cos, sin = self.rotary(h, pos[:, None])
        ring_f, p_f = fc.decode_slots(rows, pos)
        ring_s, p_s = sc.decode_slots(rows, pos)
        mask_f = fc.visible(pos[:, None], rows, n_slots)
        n_s = sc.used_slots(0)
        mask_s = sc.visible(pos[:, None], rows, n_s)
        for li, layer in enumerate(self.layers):
            roles, attn = self._roles[li], layer.self_attn
            x = layer.input_layernorm(h)
            fast = self._fast[li] if self._fast else None
            q, k, v = self._qkv(attn, x, cos, sin) if fast is None else self._qkv_fast(fast, x, cos, sin)
            (qf, qs), (kf, ks), (vf, vs) = roles.split(q, True), roles.split(k, False), roles.split(v, False)
            of = os = None
            if roles.n_full:
                a, e = cache.full_range[li]
                fc.write_decode(0, rows, ring_f, p_f, kf[:, :, 0], vf[:, :, 0], heads=slice(a, e))
                of = F.scaled_dot_product_attention(qf, fc.k[0, rows, a:e, :n_slots], fc.v[0, rows, a:e, :n_slots],
                                                    attn_mask=mask_f, scale=attn.scaling,
                                                    enable_gqa=roles.n_full != qf.shape[1])
            if roles.n_stream:
                c, d = cache.stream_range[li]
                sc.write_decode(0, rows, ring_s, p_s, ks[:, :, 0], vs[:, :, 0], heads=slice(c, d))
                os = F.scaled_dot_product_attention(qs, sc.k[0, rows, c:d, :n_s], sc.v[0, rows, c:d, :n_s],
                                                    attn_mask=mask_s, scale=attn.scaling,
                                                    enable_gqa=roles.n_stream != qs.shape[1])
            o = roles.join(of, os)
            h = self._finish_layer(layer, h, o) if fast is None else self._finish_layer_fast(fast, layer, h, o)
            if between is not None and li < len(self.layers) - 1:
                between()
        h = self.norm(h)
        head = self.lm_head if self._fast_head is None else self._fast_head
        return head(h)[:, 0].float()
