"""The shape every sparse dictionary shares: an encoder, an activation, a decoder with unit-norm rows.

    pre   = (x - b_dec) W_enc + b_enc          (SAEs subtract b_dec first; transcoders do not)
    acts  = activation(pre)                      ReLU / TopK / BatchTopK / JumpReLU: one file each
    recon = acts W_dec + b_dec (+ x W_skip^T)    W_enc [d_in, d_sae], W_dec [d_sae, d_out]

Parameter names and shapes are SAELens' (``W_enc b_enc W_dec b_dec``, ``threshold`` for
JumpReLU, ``W_skip`` [d_out, d_in] for skip-transcoders), so ``saelens.py`` writes and reads its
``cfg.json`` + ``sae_weights.safetensors`` without renaming anything.

Training keeps every decoder row at unit norm (the gradient's component along a row is
removed before the step and the row renormalised after it), so a feature's activation is its
size along a unit direction and an L1 penalty on activations is the decoder-norm-weighted one.
TopK-style dictionaries train on their kept entries only (``SparseActs``, decoded with
``embedding_bag``): k rows of ``W_dec`` per token instead of a dense ``[rows, d_sae] @ W_dec``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any, ClassVar, Optional, Union

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor, nn


@dataclass
class SparseActs:
    """Activations kept as bags: row ``r``'s features are ``indices[offsets[r]:offsets[r + 1]]``."""

    values: Tensor  # [n] activations (differentiable)
    indices: Tensor  # [n] feature ids
    offsets: Tensor  # [rows] where each row's bag starts
    rows: int

    def dense(self, d_sae: int) -> Tensor:
        counts = torch.diff(self.offsets, append=self.offsets.new_tensor([len(self.values)]))
        row_ids = torch.repeat_interleave(torch.arange(self.rows, device=self.values.device), counts)
        out = self.values.new_zeros(self.rows, d_sae)
        return out.index_put((row_ids, self.indices), self.values)

    def fired(self, d_sae: int) -> Tensor:
        """[d_sae] bool: which features fired in any row."""
        return torch.bincount(self.indices[self.values > 0], minlength=d_sae) > 0

    def active(self) -> Tensor:
        """How many (row, feature) activations are positive."""
        return (self.values > 0).sum()


@dataclass(frozen=True)
class DictionaryConfig:
    """What a dictionary is and where it reads: primitive fields only, so it survives JSON."""

    kind: str
    d_in: int
    d_sae: int
    d_out: int = 0  # 0: same as d_in (an SAE); a transcoder's output width otherwise
    k: Union[int, float] = 0  # TopK: features per token; BatchTopK: mean features per token over a batch
    hook_name: str = ""
    hook_name_out: str = ""  # transcoders: the hook whose value they predict
    hook_shape: tuple = ()  # the hook's trailing shape, flattened to d_in (e.g. [n_heads, d_head] for hook_z)
    model_name: str = ""
    model_fingerprint: str = ""
    apply_b_dec_to_input: bool = True  # SAEs subtract b_dec from the input; transcoders never do
    dtype: str = "float32"
    extra: dict = field(default_factory=dict)  # anything JSON the architecture wants to keep

    def __post_init__(self) -> None:
        for name in ("d_in", "d_sae"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"DictionaryConfig.{name} must be a positive integer, got {value!r}")
        if self.d_out == 0:
            object.__setattr__(self, "d_out", self.d_in)
        if not isinstance(self.d_out, int) or self.d_out < 1:
            raise ValueError(f"DictionaryConfig.d_out must be a positive integer, got {self.d_out!r}")
        object.__setattr__(self, "hook_shape", tuple(self.hook_shape) or (self.d_in,))

    def to_dict(self) -> dict:
        out = asdict(self)
        out["hook_shape"] = list(self.hook_shape)
        return out

    def replace(self, **changes: Any) -> "DictionaryConfig":
        return replace(self, **changes)


class Dictionary(nn.Module):
    """Base class: subclasses set ``kind``/``architecture`` and implement ``activate``."""

    kind: ClassVar[str] = ""
    architecture: ClassVar[str] = ""  # the SAELens name written to cfg.json
    is_transcoder: ClassVar[bool] = False

    def __init__(self, cfg: DictionaryConfig):
        super().__init__()
        self.cfg = cfg

        self.W_enc = nn.Parameter(torch.empty(cfg.d_in, cfg.d_sae))
        self.b_enc = nn.Parameter(torch.zeros(cfg.d_sae))
        self.W_dec = nn.Parameter(torch.empty(cfg.d_sae, cfg.d_out))
        self.b_dec = nn.Parameter(torch.zeros(cfg.d_out))
        self.metrics: dict[str, Any] = {}
        self.init_weights()

    def splice(self, model, error_term: bool = False, hook: Optional[str] = None):
        """Put this dictionary into ``model`` at its hook (what ``model.add_sae`` calls)."""
        from workbench.analysis.splice import add_sae

        return add_sae(model, self, error_term=error_term, hook=hook)

    def unsplice(self, model, which: Union[str, nn.Module, None] = None) -> None:
        """Take dictionaries out of ``model`` (what ``model.remove_sae`` calls)."""
        from workbench.analysis.splice import remove_sae

        remove_sae(model, which)

    # ---- construction -----------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self, generator: Optional[torch.Generator] = None) -> None:
        """Unit-norm random decoder rows; the encoder starts as the decoder's transpose (SAELens, sparsify)."""
        W = torch.randn(self.cfg.d_sae, self.cfg.d_out, generator=generator)
        self.W_dec.copy_(W / W.norm(dim=-1, keepdim=True))
        if self.cfg.d_out == self.cfg.d_in:
            self.W_enc.copy_(self.W_dec.T)
        else:
            V = torch.randn(self.cfg.d_in, self.cfg.d_sae, generator=generator)
            self.W_enc.copy_(V / V.norm(dim=0, keepdim=True))
        self.b_enc.zero_()
        self.b_dec.zero_()

    @property
    def device(self) -> torch.device:
        return self.W_enc.device

    @property
    def d_sae(self) -> int:
        return self.cfg.d_sae

    # ---- the map ------------------------------------------------------------------------------
    def pre_acts(self, x: Float[Tensor, "*rows d_in"]) -> Float[Tensor, "*rows d_sae"]:
        x = x.to(self.W_enc.dtype)
        if self.cfg.apply_b_dec_to_input:
            x = x - self.b_dec
        return x @ self.W_enc + self.b_enc

    def activate(self, pre: Tensor) -> Tensor:
        """Feature activations from pre-activations, the way inference (and SAELens) computes them."""
        raise NotImplementedError

    def train_activate(self, pre: Tensor) -> Tensor:
        """The activation used while training (BatchTopK and JumpReLU differ from inference)."""
        return self.activate(pre)

    def train_encode(self, pre: Tensor) -> Union[Tensor, SparseActs]:
        """What training decodes: dense activations, or (TopK-style) only the kept entries."""
        return self.train_activate(pre)

    def train_decode(self, acts: Union[Tensor, SparseActs], x: Tensor) -> Tensor:
        if isinstance(acts, SparseActs):
            return F.embedding_bag(acts.indices, self.W_dec, acts.offsets, mode="sum",
                                   per_sample_weights=acts.values) + self.b_dec
        return self.decode(acts, x)

    def encode(self, x: Float[Tensor, "*rows d_in"]) -> Float[Tensor, "*rows d_sae"]:
        return self.activate(self.pre_acts(x))

    def decode(self, acts: Float[Tensor, "*rows d_sae"], x: Optional[Tensor] = None) -> Float[Tensor, "*rows d_out"]:
        """``acts W_dec + b_dec``; skip-transcoders add ``x W_skip^T`` (so they need ``x``)."""
        return acts @ self.W_dec + self.b_dec

    def forward(self, x: Float[Tensor, "*rows d_in"]) -> Float[Tensor, "*rows d_out"]:
        return self.decode(self.encode(x), x)

    # ---- the sparse form (what a splice runs when nothing reads the dense activations) ------------
    def sparse_activate(self, pre: Tensor) -> Optional[tuple[Tensor, Tensor]]:
        """``(values, indices)``, each ``[*rows, k]``: the only features ``activate`` can make nonzero
        and their activations, for a per-row TopK; None for every other activation (dense)."""
        return None

    def decode_sparse(self, values: Tensor, indices: Tensor, x: Optional[Tensor] = None) -> Tensor:
        """``decode`` of the dense activations that are ``values`` at ``indices`` and 0 elsewhere: a
        sum of ``k`` decoder rows per row (``k * d_out`` multiply-adds instead of ``d_sae * d_out``);
        equal to ``decode`` up to float rounding (another summation order)."""
        k = values.shape[-1]
        out = F.embedding_bag(indices.reshape(-1, k), self.W_dec, mode="sum", per_sample_weights=values.reshape(-1, k))
        return out.view(*values.shape[:-1], out.shape[-1]) + self.b_dec

    # ---- training terms (the trainer adds the reconstruction error) -------------------------------
    def sparsity_loss(self, acts: Union[Tensor, SparseActs], pre: Tensor, coefficient: float) -> dict[str, Tensor]:
        """Architecture-specific sparsity penalties (none for TopK-style dictionaries)."""
        return {}

    @torch.no_grad()
    def after_batch(self, acts: Union[Tensor, SparseActs]) -> None:
        """Bookkeeping after a training forward (BatchTopK's running threshold)."""

    # ---- decoder norms --------------------------------------------------------------------------
    @torch.no_grad()
    def remove_parallel_grads(self) -> None:
        """Drop the part of each decoder row's gradient that would only change the row's norm."""
        if self.W_dec.grad is not None:
            W = self.W_dec
            self.W_dec.grad -= (self.W_dec.grad * W).sum(-1, keepdim=True) * W

    @torch.no_grad()
    def normalize_decoder(self) -> None:
        self.W_dec /= self.W_dec.norm(dim=-1, keepdim=True).clamp_min(1e-8)

    @torch.no_grad()
    def fold_scaling(self, scale_in: float, scale_out: float) -> None:
        """Turn a dictionary trained on ``x * scale_in -> y * scale_out`` into one on raw ``x -> y``.

        Activations are divided by ``scale_out`` and the decoder rows keep unit norm; the
        thresholds of JumpReLU/BatchTopK scale with the activations, so the same features fire.
        """
        self.W_enc.mul_(scale_in / scale_out)
        self.b_enc.div_(scale_out)
        self.b_dec.div_(scale_out)
        for name in ("threshold",):
            if hasattr(self, name):
                getattr(self, name).div_(scale_out)
        if hasattr(self, "W_skip"):
            self.W_skip.mul_(scale_in / scale_out)

    def extra_state_dict(self) -> dict[str, Tensor]:
        """Tensors SAELens' file holds beyond the parameters (none by default)."""
        return {}

    def __repr__(self) -> str:
        c = self.cfg
        k = f", k={c.k:g}" if c.k else ""
        return f"{type(self).__name__}(d_in={c.d_in}, d_sae={c.d_sae}{k}, hook={c.hook_name!r})"
