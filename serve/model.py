"""A compact decoder forward over a Hugging Face causal LM's own modules, with our preallocated caches.

Why not ``model.generate``: its default cache grows by concatenation (a copy of the whole history at
every step) and the mask machinery is rebuilt per step. Here the weights, norms, MLPs and rotary
embedding are the HF modules themselves (no conversion, no copies); only the attention loop is ours,
reading and writing :class:`serve.kv_cache.KVCache`. Two swap-in pieces do all the work:
:meth:`DecoderModel.prefill` (one row, one chunk of the prompt) and :meth:`DecoderModel.decode_one_token`
(one token for each row of a contiguous block of rows).

Decode is bound by reading the weights once per step. On CPU, small decode batches therefore read
*fused, transposed* copies of the projections (q|k|v and gate|up as one matrix each, stored
``[in, out]``): MKL's matrix-vector kernel streams that layout markedly faster than the ``[out, in]``
one (SmolLM2-135M, 2 cores: the 49152×576 head in 5.4 vs 9.8 ms, all projections of the 30 layers in
37 vs 46 ms). Larger batches run the matrix-matrix kernel, which prefers the original layout, so both
are kept: ``gemv_rows=0`` turns the copies off and saves their memory (one more copy of the
projection and head weights).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from attention.masks import allowed
from attention.spec import CONFIG_KEY, HybridAttentionConfig
from serve.kv_cache import KVCache

SUPPORTED = ("llama", "mistral", "qwen2")


def hybrid_spec(config) -> HybridAttentionConfig | None:
    """The hybrid attention spec stored in a model config under ``"hybrid_attention"``, else None (dense)."""
    d = getattr(config, CONFIG_KEY, None)
    if d is None:
        return None
    return d if isinstance(d, HybridAttentionConfig) else HybridAttentionConfig.from_dict(dict(d))


def _check_supported(config) -> None:
    mt = getattr(config, "model_type", None)
    if mt not in SUPPORTED:
        raise ValueError(f"model_type {mt!r} is not supported by the serving engine; supported: {', '.join(SUPPORTED)}")
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


class _GemvWeights:
    """Transposed, fused copies of one layer's projections for matrix-vector decode steps.

    ``qkv``: ``[hidden, (heads + 2 * kv_heads) * head_dim]``; ``gate_up``: ``[hidden, 2 * inter]``;
    ``o``: ``[heads * head_dim, hidden]``; ``down``: ``[inter, hidden]``; biases fused alike (or None).
    """

    def __init__(self, layer: nn.Module) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv, self.qkv_bias = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
        self.o, self.o_bias = _fuse([attn.o_proj])
        self.gate_up, self.gate_up_bias = _fuse([mlp.gate_proj, mlp.up_proj])
        self.down, self.down_bias = _fuse([mlp.down_proj])


def _fuse(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``([in, sum(out)]`` contiguous weight, fused bias or None) of linears sharing their input."""
    w = torch.cat([m.weight.detach() for m in linears], dim=0).t().contiguous()
    if all(m.bias is None for m in linears):
        return w, None
    bias = [m.bias.detach() if m.bias is not None else m.weight.new_zeros(m.out_features) for m in linears]
    return w, torch.cat(bias)


def _mm(x: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ w_t (+ bias)`` for ``x`` ``[..., in]`` and a transposed weight ``[in, out]``."""
    return F.linear(x, w_t.t(), bias)


class DecoderModel(nn.Module):
    """Wraps an HF ``*ForCausalLM`` (Llama / Mistral / Qwen2) for cached decoding.

    Args:
        hf_model: the model; its modules are used in place (weights are not copied, except below).
        gemv_rows: decode steps of at most this many rows use the fused transposed weight copies
            (CPU only; 0 disables them and their memory). See the module docstring.
    """

    def __init__(self, hf_model: nn.Module, *, gemv_rows: int | None = None) -> None:
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
        on_cpu = self.lm_head.weight.device.type == "cpu"
        self.gemv_rows = (2 if on_cpu else 0) if gemv_rows is None else gemv_rows
        self._gemv: list[_GemvWeights] = []
        self._head_t: torch.Tensor | None = None
        if self.gemv_rows > 0:
            with torch.no_grad():
                self._gemv = [_GemvWeights(layer) for layer in self.layers]
                self._head_t, self._head_bias = _fuse([self.lm_head])

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def new_cache(self, rows: int, max_seq_len: int, *, dense: bool = False) -> KVCache:
        """A cache of ``rows`` sequences up to ``max_seq_len`` tokens (bounded for hybrid models)."""
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

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h)).float()

    @torch.inference_mode()
    def prefill(self, cache: KVCache, row: int, ids: torch.Tensor, start: int) -> torch.Tensor:
        """Run one chunk of one row's prompt through the model and store its keys/values.

        Args:
            ids: ``[chunk]`` token ids at absolute positions ``start .. start + chunk - 1``; the cache
                row already holds positions ``< start``.
        Returns:
            ``[vocab]`` fp32 logits of the chunk's last position.
        """
        t = ids.shape[0]
        pos = torch.arange(start, start + t, device=ids.device)
        h = self.embed(ids)[None]  # [1, t, hidden]
        cos, sin = self.rotary(h, pos[None])
        # Keys already cached (positions < start), then the chunk itself under the hybrid/causal rule.
        n_old = cache.used_slots(start - 1) if start > 0 else 0
        w = int(cache.window[row])
        i, j = pos[:, None], pos[None, :]
        chunk_mask = j <= i
        if cache.bounded:
            chunk_mask = allowed(pos, pos, cache.spec, w)
        mask = chunk_mask
        if n_old:
            old = cache.visible(pos[None], slice(row, row + 1), n_old)[0, 0]  # [t, n_old]
            mask = torch.cat([old, chunk_mask], dim=-1)
        mask = mask[None, None]
        idx, slot = cache.prefill_slots(row, pos)
        for li, layer in enumerate(self.layers):
            x = layer.input_layernorm(h)
            q, k, v = self._qkv(layer.self_attn, x, cos, sin)
            if n_old:
                kk = torch.cat([cache.k[li, row, :, :n_old][None], k], dim=2)
                vv = torch.cat([cache.v[li, row, :, :n_old][None], v], dim=2)
            else:
                kk, vv = k, v
            o = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, scale=layer.self_attn.scaling,
                                               enable_gqa=self.n_kv != self.n_heads)
            cache.write_prefill(li, row, idx, slot, k[0], v[0])
            h = self._finish_layer(layer, h, o)
        cache.commit_prefill(row, pos, idx, slot)
        return self._logits(h[:, -1])[0]

    @torch.inference_mode()
    def decode_one_token(self, cache: KVCache, tokens: torch.Tensor, pos: torch.Tensor, n_slots: int
                         ) -> torch.Tensor:
        """One decode step for cache rows ``0 .. batch - 1``.

        Args:
            tokens: ``[batch]`` the last token of each row; ``pos``: ``[batch]`` its absolute position.
            n_slots: attend over the first ``n_slots`` cache slots (all rows' keys live there).
        Returns:
            ``[batch, vocab]`` fp32 logits.
        """
        b = tokens.shape[0]
        rows = slice(0, b)
        h = self.embed(tokens)[:, None]  # [b, 1, hidden]
        cos, sin = self.rotary(h, pos[:, None])
        ring_slot, pslot = cache.decode_slots(rows, pos)
        mask = cache.visible(pos[:, None], rows, n_slots)  # [b, 1, 1, n_slots]
        gemv = self._gemv if b <= self.gemv_rows else None
        q_width, kv_width = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        for li, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            if gemv is not None:
                w = gemv[li]
                q, k, v = _mm(x, w.qkv, w.qkv_bias).split([q_width, kv_width, kv_width], dim=-1)
                q = _rope(q.view(b, 1, self.n_heads, self.head_dim).transpose(1, 2), cos, sin)
                k = _rope(k.view(b, 1, self.n_kv, self.head_dim).transpose(1, 2), cos, sin)
                v = v.view(b, 1, self.n_kv, self.head_dim).transpose(1, 2)
            else:
                q, k, v = self._qkv(attn, x, cos, sin)
            cache.write_decode(li, rows, ring_slot, pslot, k[:, :, 0], v[:, :, 0])
            o = F.scaled_dot_product_attention(q, cache.k[li, rows, :, :n_slots], cache.v[li, rows, :, :n_slots],
                                               attn_mask=mask, scale=attn.scaling,
                                               enable_gqa=self.n_kv != self.n_heads)
            if gemv is None:
                h = self._finish_layer(layer, h, o)
                continue
            h = h + _mm(o.transpose(1, 2).reshape(b, 1, -1), w.o, w.o_bias)
            gate, up = _mm(layer.post_attention_layernorm(h), w.gate_up, w.gate_up_bias).chunk(2, dim=-1)
            h = h + _mm(layer.mlp.act_fn(gate) * up, w.down, w.down_bias)
        h = self.norm(h[:, 0])
        if gemv is not None:
            return _mm(h, self._head_t, self._head_bias).float()
        return self.lm_head(h).float()
