"""The teacher–student module: one forward, every loss term.

``DistillModel`` holds the trainable student and the projectors as submodules and the frozen
teacher *outside* the module tree, so ``state_dict()``, ``parameters()`` (hence the optimizer and
DDP) and checkpoints never see the teacher. Only the mapped layers are observed, through forward
hooks on those layers (hidden states) and on their ``q_proj`` / ``k_proj`` (attention maps); the
models keep their own attention implementation and never return every hidden state.

The logits term runs on final hidden states and output-head weights through
:func:`distill.losses.chunked_kd_loss`, so neither model's full ``[tokens, vocab]`` fp32 logits
are ever stored; the student's logits are formed only when a CE or focal term needs them.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from accelerate.utils import align_module_device
from torch import nn
from transformers import PreTrainedModel
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from attention.integration import SUPPORTED_MODEL_TYPES
from core.config import ConfigError
from distill import losses
from distill.layers import parse_layer_pairs
from distill.losses import KD_KINDS
from distill.student import kept_channels, kept_layers
from distill.teacher_cache import CachedTargets, cached_kd_loss

# nmse: per-token MSE divided by the teacher state's mean square. Residual streams of real LMs carry a few
# huge "massive activation" features (hundreds in SmolLM2), so raw MSE is in the thousands and
# swamps every other term; the normalized form is scale-free and comparable to KD.
HIDDEN_KINDS = ("nmse", "mse", "cosine")


class DistillSetupError(ConfigError):
    """A teacher/student pairing that cannot work; the message names the fix."""


@dataclass
class LossConfig:
    """Weights and settings of every term; a weight of 0 switches a term off (ablations).

    No defaults on purpose: a recipe builds it explicitly from its own config, the one place where
    each setting has a default.
    """

    kd_weight: float
    kd_kind: str
    temperature: float
    beta: float
    kd_chunk_size: int | None  # None: full logits through kd_loss (reference path)
    ce_weight: float
    focal_weight: float
    focal_alpha: float
    focal_gamma: float
    hidden_weight: float
    hidden_layers: list[str]
    hidden_kind: str
    attn_weight: float
    attn_layers: list[str]
    attn_num_queries: int

    def __post_init__(self) -> None:
        if self.kd_kind not in KD_KINDS:
            raise DistillSetupError(f"kd_kind '{self.kd_kind}' is unknown; use one of {', '.join(KD_KINDS)}")
        if self.temperature <= 0:
            raise DistillSetupError(f"temperature must be > 0, got {self.temperature}")
        if not 0.0 <= self.beta <= 1.0:
            raise DistillSetupError(f"beta must be in [0, 1], got {self.beta}")
        if self.hidden_kind not in HIDDEN_KINDS:
            raise DistillSetupError(f"hidden_kind '{self.hidden_kind}' is unknown; use {', '.join(HIDDEN_KINDS)}")
        weights = [self.kd_weight, self.ce_weight, self.focal_weight, self.hidden_weight, self.attn_weight]
        if any(w < 0 for w in weights):
            raise DistillSetupError("loss weights must be >= 0; set a weight to 0 to switch its term off")
        if sum(weights) == 0:
            raise DistillSetupError("every loss weight is 0; set at least one of kd/ce/focal/hidden/attn_weight")
        if self.attn_weight > 0 and not self.attn_layers:
            raise DistillSetupError("attn_weight > 0 needs attn_layers, e.g. attn_layers=[-1:-1]")
        if self.hidden_weight > 0 and not self.hidden_layers:  # no pair: the term would be 0, silently
            raise DistillSetupError("hidden_weight > 0 needs hidden_layers, e.g. hidden_layers=[relative]; or set "
                                    "hidden_weight=0")

    @property
    def needs_teacher(self) -> bool:
        return self.kd_weight > 0 or self.hidden_weight > 0 or self.attn_weight > 0


@dataclass
class DistillOutput:
    """Every term (unweighted, detached-free) and the weighted total that is backpropagated."""

    loss: torch.Tensor
    kd: torch.Tensor
    ce: torch.Tensor
    focal: torch.Tensor
    hidden: torch.Tensor
    attn: torch.Tensor
    tokens: int

    def terms(self) -> dict[str, float]:
        return {k: float(getattr(self, k).detach()) for k in ("loss", "kd", "ce", "focal", "hidden", "attn")}


def _base_model(model: PreTrainedModel) -> nn.Module:
    base = getattr(model, "model", None)
    if base is None or not hasattr(base, "layers"):
        raise DistillSetupError(
            f"{type(model).__name__} is not supported; use a decoder-only model of type {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return base


def check_pair(student: PreTrainedModel, teacher: PreTrainedModel, tokenizer_size: int | None = None) -> int:
    """Validate the pairing; returns the vocabulary size the logits term compares over."""
    for role, m in (("student", student), ("teacher", teacher)):
        if m.config.model_type not in SUPPORTED_MODEL_TYPES:
            raise DistillSetupError(
                f"{role} architecture '{m.config.model_type}' is unsupported; use one of {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
    vs, vt = student.config.vocab_size, teacher.config.vocab_size
    if vs == vt:
        return vs
    smaller = min(vs, vt)
    if tokenizer_size is not None and tokenizer_size <= smaller:
        warnings.warn(
            f"teacher vocab {vt} and student vocab {vs} differ only in padding rows beyond the tokenizer's "
            f"{tokenizer_size} tokens; comparing the first {smaller} logits", stacklevel=2,
        )
        return smaller
    raise DistillSetupError(
        f"teacher vocab_size {vt} != student vocab_size {vs}; distill between models that share a tokenizer "
        "(or pass tokenizer_size when the extra rows are padding)"
    )


class _Taps:
    """Forward hooks that keep the outputs of selected layers for one forward pass."""

    def __init__(self, model: PreTrainedModel, hidden_layers: Sequence[int], attn_layers: Sequence[int]):
        self.hidden: dict[int, torch.Tensor] = {}
        self.q: dict[int, torch.Tensor] = {}
        self.k: dict[int, torch.Tensor] = {}
        self.rope: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.handles = []
        self.enabled = True
        layers = _base_model(model).layers
        for i in hidden_layers:
            self.handles.append(layers[i].register_forward_hook(self._keep_hidden(i)))
        for i in attn_layers:
            attn = layers[i].self_attn
            self.handles.append(attn.register_forward_pre_hook(self._keep_rope(i), with_kwargs=True))
            self.handles.append(attn.q_proj.register_forward_hook(self._keep(self.q, i)))
            self.handles.append(attn.k_proj.register_forward_hook(self._keep(self.k, i)))

    def _keep_hidden(self, i: int):
        def hook(_module, _args, output):
            if self.enabled:
                self.hidden[i] = output[0] if isinstance(output, tuple) else output
        return hook

    def _keep(self, store: dict, i: int):
        def hook(_module, _args, output):
            if self.enabled:
                store[i] = output
        return hook

    def _keep_rope(self, i: int):
        def hook(_module, _args, kwargs):
            if self.enabled:
                self.rope[i] = kwargs["position_embeddings"]
        return hook

    def qk(self, i: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Post-RoPE ``q`` ``[batch, heads, seq, head_dim]`` and ``k`` ``[batch, kv_heads, seq, head_dim]``."""
        q, k = self.q[i], self.k[i]
        b, s, _ = q.shape
        q = q.view(b, s, -1, head_dim).transpose(1, 2)
        k = k.view(b, s, -1, head_dim).transpose(1, 2)
        cos, sin = self.rope[i]
        return apply_rotary_pos_emb(q, k, cos, sin)

    def clear(self) -> None:
        self.hidden.clear()
        self.q.clear()
        self.k.clear()
        self.rope.clear()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _kd_path(cfg: LossConfig, cached_teacher: bool, head_rows_shared: bool = True) -> str:
    """How the logits term is computed, decided once: none, cached, full, chunked or chunked+ce.

    ``head_rows_shared``: the student's head has no rows past the shared vocabulary. Only then can CE ride
    in the chunked KD pass, which sees the shared rows alone; CE is over the student's whole head either way.
    """
    if cfg.kd_weight == 0:
        return "none"
    if cached_teacher:
        return "cached"
    if cfg.kd_chunk_size is None:
        return "full"
    return "chunked+ce" if cfg.ce_weight > 0 and head_rows_shared else "chunked"


class DistillModel(nn.Module):
    """A trainable student, its projectors, and a frozen teacher hidden from the module tree.

    Args:
        student: the model being trained.
        teacher: the frozen reference; put in eval mode with ``requires_grad_(False)``. May be
            ``None`` when no term needs it (CE/focal only) or when logits come from a cache.
        losses: the term weights and settings.
        tokenizer_size: the tokenizer's length, to allow vocabularies that differ only in padding.
        cached_teacher: the logits term comes from cached teacher targets (top-k or sampled) passed to
            ``forward(teacher_topk=...)`` (``recipes/cache_teacher.py``); no live teacher.
        cached_vocab: the vocabulary the cached targets were drawn over (the cache's ``meta.json``): the student's
            softmax covers the first ``min(student's, cached_vocab)`` logits, as with a live teacher whose
            vocabulary differs from the student's only in padding rows (None: the student's whole vocabulary).
    """

    def __init__(self, student: PreTrainedModel, teacher: PreTrainedModel | None, loss_config: LossConfig,
                 tokenizer_size: int | None = None, cached_teacher: bool = False, cached_vocab: int | None = None):
        super().__init__()
        self.student = student
        self.loss_config = loss_config
        object.__setattr__(self, "_teacher", None)
        self.projectors = nn.ModuleDict()
        self.hidden_pairs: list[tuple[int, int]] = []
        self.attn_pairs: list[tuple[int, int]] = []
        self.vocab = student.config.vocab_size
        self.cached_teacher = cached_teacher
        if cached_teacher and cached_vocab is not None:  # padding rows past the cache's vocabulary take no mass
            self.vocab = min(self.vocab, cached_vocab)
        _base_model(student)
        if teacher is None:
            if cached_teacher and (loss_config.hidden_weight > 0 or loss_config.attn_weight > 0):
                raise DistillSetupError(
                    "a teacher cache holds logits only; set hidden_weight=0 and attn_weight=0 or load the teacher"
                )
            if loss_config.needs_teacher and not cached_teacher:
                raise DistillSetupError(
                    "kd/hidden/attn terms need a teacher; load one or set kd_weight, hidden_weight, attn_weight to 0"
                )
            self._student_taps = None
            return
        self.vocab = check_pair(student, teacher, tokenizer_size)
        teacher.eval().requires_grad_(False)
        object.__setattr__(self, "_teacher", teacher)
        n_s, n_t = student.config.num_hidden_layers, teacher.config.num_hidden_layers
        kept = kept_layers(student)
        if loss_config.hidden_weight > 0:
            self.hidden_pairs = parse_layer_pairs(loss_config.hidden_layers, n_s, n_t, kept)
        if loss_config.attn_weight > 0:
            self.attn_pairs = parse_layer_pairs(loss_config.attn_layers, n_s, n_t, kept)
        d_s, d_t = student.config.hidden_size, teacher.config.hidden_size
        channels = kept_channels(student)
        ref = next(student.parameters())  # projectors live beside the student: its dtype and device
        for s, t in self.hidden_pairs:
            # Equal widths compare directly: an identity start keeps the derived student's own features.
            self.projectors[f"s{s}_t{t}"] = (nn.Identity() if d_s == d_t else
                                             nn.Linear(d_s, d_t, bias=False, dtype=ref.dtype, device=ref.device))
            if d_s != d_t and channels is not None and len(channels) == d_s and max(channels) < d_t:
                # A width-pruned student (distill.prune): start by putting each kept channel back in its
                # teacher position, the same identity start as above.
                with torch.no_grad():
                    self.projectors[f"s{s}_t{t}"].weight.zero_()[channels, range(d_s)] = 1.0
        self._student_taps = _Taps(student, [s for s, _ in self.hidden_pairs], [s for s, _ in self.attn_pairs])
        self._teacher_taps = _Taps(teacher, [t for _, t in self.hidden_pairs], [t for _, t in self.attn_pairs])

    @property
    def teacher(self) -> PreTrainedModel | None:
        return self._teacher

    def set_teacher(self, teacher: nn.Module) -> None:
        """Swap in a wrapped teacher (e.g. a DeepSpeed inference engine) after preparation."""
        object.__setattr__(self, "_teacher", teacher)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None,
                teacher_topk: CachedTargets | tuple[torch.Tensor, torch.Tensor] | None = None,
                loss_mask: torch.Tensor | None = None) -> DistillOutput:
        """One teacher–student step.

        Args:
            input_ids: ``[batch, seq]``.
            attention_mask: ``[batch, seq]``, 1 = real token; padding never counts in any term.
            labels: ``[batch, seq]`` next-token targets aligned with ``input_ids`` (the usual HF
                convention: position t predicts ``labels[t+1]``); ``-100`` is ignored (e.g. prompt
                tokens of chat records). Defaults to ``input_ids`` with padding ignored.
            teacher_topk: cached teacher targets at each position, for ``cached_teacher`` models: a
                :class:`distill.teacher_cache.CachedTargets` (top-k or sampled) or a top-k pair
                ``([batch, seq, k] token ids, [batch, seq, k] log-probs)``.
            loss_mask: ``[batch, seq]`` bool, True where the token is a training target (completion-only
                chat data: the assistant's tokens). KD, CE, focal and hidden terms count only at the
                positions that predict a target; the other tokens stay in the input as context. The
                attention-map term keeps every real token (its keys are the context).
        """
        cfg = self.loss_config
        if labels is None:
            labels = input_ids if attention_mask is None else input_ids.masked_fill(attention_mask == 0, -100)
        # Position t predicts token t+1: the last position has no target.
        target = labels[:, 1:]
        valid = target != -100
        if attention_mask is not None:
            valid = valid & attention_mask[:, :-1].bool()
        if loss_mask is not None:
            valid = valid & loss_mask[:, 1:].bool()
        token_mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        # Hidden states count where their next token is a target (as for KD); attention maps keep every
        # real token, since their keys are the context.
        hidden_mask = token_mask if loss_mask is None else token_mask & torch.cat(
            [valid, valid.new_zeros(valid.shape[0], 1)], dim=1)
        zero = next(self.student.parameters()).new_zeros(())

        if self._student_taps is not None:
            self._student_taps.clear()
        h_s = self.student.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        h_t = self._teacher_states(input_ids, attention_mask) if self._live_teacher else None
        kd, fused, fused_ce = self._kd(h_s, h_t, target, valid, teacher_topk)
        ce, focal = self._ce_focal(h_s, target, valid, skip_ce=fused is not None)
        if fused_ce is not None:
            ce = fused_ce
        hidden = self._hidden_term(hidden_mask) if self.hidden_pairs else zero
        attn = self._attn_term(token_mask) if self.attn_pairs else zero
        for taps in (self._student_taps, getattr(self, "_teacher_taps", None)):
            if taps is not None:
                taps.clear()

        if fused is not None:  # kd_weight * (kd + ce_weight / kd_weight * ce), with one graph
            total = cfg.kd_weight * fused
        else:
            total = cfg.kd_weight * kd + cfg.ce_weight * ce
        total = total + cfg.focal_weight * focal + cfg.hidden_weight * hidden + cfg.attn_weight * attn
        return DistillOutput(loss=total, kd=kd, ce=ce, focal=focal, hidden=hidden, attn=attn,
                             tokens=int(valid.sum()))

    # ---- the pieces of a step -----------------------------------------------------------------
    @property
    def kd_path(self) -> str:
        """How the logits term is computed (:func:`_kd_path`); follows ``loss_config`` if it is swapped."""
        weight = self.student.get_output_embeddings().weight
        rows = getattr(weight, "ds_shape", weight.shape)[0]  # ZeRO-3 leaves an empty shard in .shape
        return _kd_path(self.loss_config, self.cached_teacher, head_rows_shared=rows == self.vocab)

    @property
    def _live_teacher(self) -> bool:
        return self.loss_config.needs_teacher and not self.cached_teacher

    def _teacher_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """``[batch, seq, d_t]`` last hidden states of the frozen teacher (its taps fill on the way)."""
        self._teacher_taps.clear()
        with torch.no_grad():
            return self._teacher_module().model(input_ids=input_ids, attention_mask=attention_mask,
                                                use_cache=False).last_hidden_state

    def _teacher_module(self) -> nn.Module:
        # A DeepSpeed inference engine wraps the model; its submodules keep the ZeRO-3 hooks.
        return getattr(self._teacher, "module", self._teacher)

    def _ce_focal(self, h_s: torch.Tensor, target: torch.Tensor, valid: torch.Tensor, skip_ce: bool
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """CE and focal terms from one pass of the student head (CE skipped when the KD pass fused it)."""
        cfg = self.loss_config
        zero = h_s.new_zeros(())
        want_ce = cfg.ce_weight > 0 and not skip_ce
        if not want_ce and cfg.focal_weight == 0:
            return zero, zero
        logits = self.student.get_output_embeddings()(h_s[:, :-1])
        labels = target.masked_fill(~valid, -100)
        ce = losses.ce_loss(logits, labels) if want_ce else zero
        focal = (losses.focal_loss(logits, labels, alpha=cfg.focal_alpha, gamma=cfg.focal_gamma)
                 if cfg.focal_weight > 0 else zero)
        return ce, focal

    def _kd(self, h_s: torch.Tensor, h_t: torch.Tensor | None, target: torch.Tensor, valid: torch.Tensor,
            teacher_topk: tuple[torch.Tensor, torch.Tensor] | None
            ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``(kd, fused_total or None, fused_ce or None)`` through the path chosen at construction."""
        cfg = self.loss_config
        zero = h_s.new_zeros(())
        head_s = self.student.get_output_embeddings()
        path = self.kd_path
        if path == "none":
            return zero, None, None
        if path == "cached":  # top-k or sampled teacher targets (distill.teacher_cache)
            if teacher_topk is None:
                raise DistillSetupError("this model distills from a teacher cache: pass teacher_topk=")
            targets = CachedTargets(*teacher_topk) if isinstance(teacher_topk, tuple) else teacher_topk
            kd = cached_kd_loss(head_s(h_s[:, :-1])[..., : self.vocab], targets.positions(slice(None, -1)), valid,
                                temperature=cfg.temperature)
            return kd, None, None
        head_t = self._teacher_module().get_output_embeddings()
        if path == "full":
            # Reference path; also the ZeRO-3 path, where head weights exist only inside the head's
            # own forward, so logits must come from calling the modules.
            lg_s = head_s(h_s[:, :-1])[..., : self.vocab]
            with torch.no_grad():
                lg_t = head_t(h_t[:, :-1])[..., : self.vocab]
            return losses.kd_loss(lg_s, lg_t, valid, kind=cfg.kd_kind, temperature=cfg.temperature,
                                  beta=cfg.beta), None, None
        # A teacher loaded with accelerate offload (device_map) keeps an offloaded head's weight on meta outside
        # the head's forward: read it through accelerate's hook (a no-op for a weight in memory).
        with align_module_device(head_t):
            w_t = head_t.weight[: self.vocab].detach()
        w_s = head_s.weight[: self.vocab]
        if path == "chunked+ce":  # CE rides along in the chunked KD pass: one head pass instead of two
            fused, kd, ce = losses.chunked_kd_ce_loss(
                h_s[:, :-1], w_s, h_t[:, :-1].detach(), w_t, target.clamp(min=0), valid,
                ce_weight=cfg.ce_weight / cfg.kd_weight, kind=cfg.kd_kind, temperature=cfg.temperature,
                beta=cfg.beta, chunk_size=cfg.kd_chunk_size)
            return kd, fused, ce
        kd = losses.chunked_kd_loss(h_s[:, :-1], w_s, h_t[:, :-1].detach(), w_t, valid, kind=cfg.kd_kind,
                                    temperature=cfg.temperature, beta=cfg.beta, chunk_size=cfg.kd_chunk_size)
        return kd, None, None

    def _hidden_term(self, token_mask: torch.Tensor) -> torch.Tensor:
        """Mean over layer pairs of the hidden-state distance (through the projectors)."""
        kind = self.loss_config.hidden_kind
        terms = []
        for s, t in self.hidden_pairs:
            h_t = self._teacher_taps.hidden[t].detach()
            h_s = self.projectors[f"s{s}_t{t}"](self._student_taps.hidden[s])
            terms.append(losses.normalized_mse(h_s, h_t, token_mask) if kind == "nmse"
                         else losses.hidden_loss(h_s, h_t, token_mask, kind=kind))
        return torch.stack(terms).mean()

    def _attn_term(self, token_mask: torch.Tensor) -> torch.Tensor:
        """Mean over layer pairs of the attention-map distance on sampled query rows."""
        hd_s, hd_t = _head_dim(self.student.config), _head_dim(self._teacher_module().config)
        terms = []
        for s, t in self.attn_pairs:
            q_s, k_s = self._student_taps.qk(s, hd_s)
            with torch.no_grad():
                q_t, k_t = self._teacher_taps.qk(t, hd_t)
            terms.append(losses.attention_map_loss(q_s, k_s, q_t, k_t, token_mask,
                                                   num_queries=self.loss_config.attn_num_queries))
        return torch.stack(terms).mean()

    def remove_hooks(self) -> None:
        for taps in (self._student_taps, getattr(self, "_teacher_taps", None)):
            if taps is not None:
                taps.remove()
