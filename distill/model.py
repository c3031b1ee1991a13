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

import dataclasses
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from distill import losses
from distill.config import ConfigError
from distill.layers import parse_layer_pairs
from distill.student import kept_channels, kept_layers

SUPPORTED = ("llama", "mistral", "qwen2")
KD_KINDS = ("forward_kl", "reverse_kl", "jsd", "tvd")
# nmse: per-token MSE divided by the teacher state's mean square. Residual streams of real LMs carry a few
# huge "massive activation" features (hundreds in SmolLM2), so raw MSE is in the thousands and
# swamps every other term; the normalized form is scale-free and comparable to KD.
HIDDEN_KINDS = ("nmse", "mse", "cosine")


class DistillSetupError(ConfigError):
    """A teacher/student pairing that cannot work; the message names the fix."""


@dataclass
class LossConfig:
    """Weights and settings of every term; a weight of 0 switches a term off (ablations)."""

    kd_weight: float = 1.0
    kd_kind: str = "forward_kl"
    temperature: float = 2.0
    beta: float = 0.5
    kd_chunk_size: int | None = 1024  # None: full logits through kd_loss (reference path)
    ce_weight: float = 0.0
    focal_weight: float = 0.0
    focal_alpha: float = 0.25
    focal_gamma: float = 2.0
    hidden_weight: float = 0.0
    hidden_layers: list[str] = field(default_factory=lambda: ["relative"])
    hidden_kind: str = "nmse"
    attn_weight: float = 0.0
    attn_layers: list[str] = field(default_factory=list)
    attn_num_queries: int = 64

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
            f"{type(model).__name__} is not supported; use a decoder-only model of type {', '.join(SUPPORTED)}"
        )
    return base


def check_pair(student: PreTrainedModel, teacher: PreTrainedModel, tokenizer_size: int | None = None) -> int:
    """Validate the pairing; returns the vocabulary size the logits term compares over."""
    for role, m in (("student", student), ("teacher", teacher)):
        if m.config.model_type not in SUPPORTED:
            raise DistillSetupError(
                f"{role} architecture '{m.config.model_type}' is unsupported; use one of {', '.join(SUPPORTED)}"
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


class DistillModel(nn.Module):
    """A trainable student, its projectors, and a frozen teacher hidden from the module tree.

    Args:
        student: the model being trained.
        teacher: the frozen reference; put in eval mode with ``requires_grad_(False)``. May be
            ``None`` when no term needs it (CE/focal only) or when logits come from a cache.
        losses: the term weights and settings.
        tokenizer_size: the tokenizer's length, to allow vocabularies that differ only in padding.
        cached_teacher: the logits term comes from cached top-k teacher log-probs passed to
            ``forward(teacher_topk=...)`` (``recipes/cache_teacher.py``); no live teacher.
    """

    def __init__(self, student: PreTrainedModel, teacher: PreTrainedModel | None, loss_config: LossConfig,
                 tokenizer_size: int | None = None, cached_teacher: bool = False):
        super().__init__()
        self.student = student
        self.loss_config = loss_config
        object.__setattr__(self, "_teacher", None)
        self.projectors = nn.ModuleDict()
        self.hidden_pairs: list[tuple[int, int]] = []
        self.attn_pairs: list[tuple[int, int]] = []
        self.vocab = student.config.vocab_size
        self.cached_teacher = cached_teacher
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
        for s, t in self.hidden_pairs:
            # Equal widths compare directly: an identity start keeps the derived student's own features.
            self.projectors[f"s{s}_t{t}"] = nn.Identity() if d_s == d_t else nn.Linear(d_s, d_t, bias=False)
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
                teacher_topk: tuple[torch.Tensor, torch.Tensor] | None = None) -> DistillOutput:
        """One teacher–student step.

        Args:
            input_ids: ``[batch, seq]``.
            attention_mask: ``[batch, seq]``, 1 = real token; padding never counts in any term.
            labels: ``[batch, seq]`` next-token targets aligned with ``input_ids`` (the usual HF
                convention: position t predicts ``labels[t+1]``); ``-100`` is ignored. Defaults to
                ``input_ids`` with padding ignored.
            teacher_topk: cached teacher ``([batch, seq, k] token ids, [batch, seq, k] log-probs)``
                at each position, for ``cached_teacher`` models.
        """
        cfg = self.loss_config
        if labels is None:
            labels = input_ids if attention_mask is None else input_ids.masked_fill(attention_mask == 0, -100)
        # Position t predicts token t+1: the last position has no target.
        target = labels[:, 1:]
        valid = target != -100
        if attention_mask is not None:
            valid = valid & attention_mask[:, :-1].bool()
        zero = next(self.student.parameters()).new_zeros(())
        kd = ce = focal = hidden = attn = zero

        if self._student_taps is not None:
            self._student_taps.clear()
        h_s = self.student.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        head_s = self.student.get_output_embeddings()

        if self.cached_teacher and cfg.kd_weight > 0:
            from distill.teacher_cache import topk_kd_loss

            if teacher_topk is None:
                raise DistillSetupError("this model distills from a teacher cache: pass teacher_topk=")
            idx, logp = teacher_topk
            kd = topk_kd_loss(head_s(h_s[:, :-1])[..., : self.vocab], idx[:, :-1], logp[:, :-1], valid,
                              temperature=cfg.temperature)

        # CE rides along in the chunked KD pass when it can: one head pass instead of two.
        fuse_ce = (cfg.ce_weight > 0 and cfg.kd_weight > 0 and cfg.kd_chunk_size is not None
                   and not self.cached_teacher and self._teacher is not None)
        fused = None
        if (cfg.ce_weight > 0 and not fuse_ce) or cfg.focal_weight > 0:
            logits = head_s(h_s[:, :-1])
            if cfg.ce_weight > 0 and not fuse_ce:
                ce = losses.ce_loss(logits, target.masked_fill(~valid, -100))
            if cfg.focal_weight > 0:
                focal = losses.focal_loss(logits, target.masked_fill(~valid, -100),
                                          alpha=cfg.focal_alpha, gamma=cfg.focal_gamma)
            del logits

        if cfg.needs_teacher and not self.cached_teacher:
            # A DeepSpeed inference engine wraps the model; its submodules keep the ZeRO-3 hooks.
            teacher = getattr(self._teacher, "module", self._teacher)
            self._teacher_taps.clear()
            with torch.no_grad():
                h_t = teacher.model(input_ids=input_ids, attention_mask=attention_mask,
                                    use_cache=False).last_hidden_state
            if cfg.kd_weight > 0:
                if cfg.kd_chunk_size is None:
                    # Reference path; also the ZeRO-3 path, where head weights exist only inside the
                    # head's own forward, so logits must come from calling the modules.
                    lg_s = head_s(h_s[:, :-1])[..., : self.vocab]
                    with torch.no_grad():
                        lg_t = teacher.get_output_embeddings()(h_t[:, :-1])[..., : self.vocab]
                    kd = losses.kd_loss(lg_s, lg_t, valid, kind=cfg.kd_kind, temperature=cfg.temperature,
                                        beta=cfg.beta)
                    del lg_s, lg_t
                elif fuse_ce:
                    w_t = teacher.get_output_embeddings().weight[: self.vocab]
                    w_s = head_s.weight[: self.vocab]
                    fused, kd, ce = losses.chunked_kd_ce_loss(
                        h_s[:, :-1], w_s, h_t[:, :-1].detach(), w_t.detach(), target.clamp(min=0), valid,
                        ce_weight=cfg.ce_weight / cfg.kd_weight, kind=cfg.kd_kind, temperature=cfg.temperature,
                        beta=cfg.beta, chunk_size=cfg.kd_chunk_size)
                else:
                    w_t = teacher.get_output_embeddings().weight[: self.vocab]
                    w_s = head_s.weight[: self.vocab]
                    kd = losses.chunked_kd_loss(h_s[:, :-1], w_s, h_t[:, :-1].detach(), w_t.detach(), valid,
                                                kind=cfg.kd_kind, temperature=cfg.temperature, beta=cfg.beta,
                                                chunk_size=cfg.kd_chunk_size)
            token_mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None \
                else attention_mask.bool()
            if self.hidden_pairs:
                terms = []
                for s, t in self.hidden_pairs:
                    h_t = self._teacher_taps.hidden[t].detach()
                    h_s = self.projectors[f"s{s}_t{t}"](self._student_taps.hidden[s])
                    if cfg.hidden_kind == "nmse":
                        terms.append(normalized_mse(h_s, h_t, token_mask))
                    else:
                        terms.append(losses.hidden_loss(h_s, h_t, token_mask, kind=cfg.hidden_kind))
                hidden = torch.stack(terms).mean()
            if self.attn_pairs:
                hd_s, hd_t = _head_dim(self.student.config), _head_dim(teacher.config)
                terms = []
                for s, t in self.attn_pairs:
                    q_s, k_s = self._student_taps.qk(s, hd_s)
                    with torch.no_grad():
                        q_t, k_t = self._teacher_taps.qk(t, hd_t)
                    terms.append(losses.attention_map_loss(q_s, k_s, q_t, k_t, token_mask,
                                                           num_queries=cfg.attn_num_queries))
                attn = torch.stack(terms).mean()
            self._teacher_taps.clear()
        if self._student_taps is not None:
            self._student_taps.clear()

        if fused is not None:  # kd_weight * (kd + ce_weight / kd_weight * ce), with one graph
            total = cfg.kd_weight * fused
        else:
            total = cfg.kd_weight * kd + cfg.ce_weight * ce
        total = total + cfg.focal_weight * focal + cfg.hidden_weight * hidden + cfg.attn_weight * attn
        return DistillOutput(loss=total, kd=kd, ce=ce, focal=focal, hidden=hidden, attn=attn,
                             tokens=int(valid.sum()))

    def remove_hooks(self) -> None:
        for taps in (self._student_taps, getattr(self, "_teacher_taps", None)):
            if taps is not None:
                taps.remove()


def normalized_mse(student_h: torch.Tensor, teacher_h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over counted tokens of ``mean((s - t)²) / mean(t²)`` per token, in fp32.

    Normalizing each token by its own teacher state keeps the term a plain token mean, so gradient
    accumulation stays exact (a batch-level normalizer would not). Shapes: ``[batch, seq, d]`` and
    ``mask`` ``[batch, seq]``; no counted token gives 0 with a graph.
    """
    t = teacher_h.float()
    per_token = (student_h.float() - t).pow(2).mean(-1) / t.pow(2).mean(-1).clamp(min=1e-12)
    m = mask.bool()
    return (per_token * m).sum() / m.sum().clamp(min=1)


def loss_config_from(obj) -> LossConfig:
    """Pick :class:`LossConfig` fields out of a recipe config with the same names."""
    names = {f.name for f in dataclasses.fields(LossConfig)}
    return LossConfig(**{n: getattr(obj, n) for n in names if hasattr(obj, n)})
