"""The transformer block: pre-norm, post-norm, parallel (GPT-J) and attention-only layouts.

    pre             x = x + Attn(ln1(x));      x = x + FFN(ln2(x))
    post            x = ln1(x + Attn(x));      x = ln2(x + FFN(x))
    sandwich        x = x + ln1_post(Attn(ln1(x)));   x = x + ln2_post(FFN(ln2(x)))   (Gemma 2/3)
    reordered       x = x + ln1_post(Attn(x));        x = x + ln2_post(FFN(x))        (OLMo 2)
    parallel        x = x + Attn(ln1(x)) + FFN(ln2(x))
    attn_only_pre   x = x + Attn(ln1(x))
    attn_only_post  x = ln1(x + Attn(x))
    attn_only_sandwich, attn_only_reordered: the first half of sandwich / reordered

The output norms ``ln1_post``/``ln2_post`` (TransformerLens' names for Gemma 2 and OLMo 2) sit
inside the sublayer's write: ``hook_attn_out``/``hook_mlp_out`` are their outputs, what the
residual stream receives, so ``resid_mid = resid_pre + attn_out`` holds in every layout but post.

The layout is picked once in ``__init__``; every residual-stream write has its
TransformerLens hook (``hook_resid_pre/mid/post``, ``hook_attn_out``, ``hook_mlp_out``).

Each layout is one method, and it is the only place that layout is written: ``forward``
runs it from the block's input, and ``resume`` runs the same method from a mid-block
activation (one replaced by an ablation or a patch), taking the activations it is given
as they are and computing the rest. ``LAYOUTS`` names every layout with the config that
picks it, so the tests run every invariant on every layout; a new layout is a method
plus an entry there.

A padded batch's ``Padding`` (``workbench.padding``) goes to the attention and, as the mask
of real tokens, to the FFN (MoE routes only real tokens).
"""

from dataclasses import dataclass
from typing import Optional

from jaxtyping import Float
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from workbench.components.attention import KVCacheEntry
from workbench.components.mla import ATTENTIONS
from workbench.components.mlp import make_ffn
from workbench.components.norm import NORMS, OUTPUT_NORMS
from workbench.components.registry import pick
from workbench.config import ModelConfig
from workbench.padding import Padding


@dataclass(frozen=True)
class Layout:
    """One arrangement of norms, attention and MLP around the residual stream.

    ``method``: the Block method that runs it. ``config``: the ModelConfig fields that
    pick it. ``sites``: its mid-block activations (each a ``hook_<site>`` of the block) in
    the order forward computes them. ``reads``: for each site, the earlier sites it is
    computed from, directly or not (a site not listed reads only the block's input).
    """

    method: str
    config: tuple[tuple[str, object], ...]
    sites: tuple[str, ...]
    reads: tuple[tuple[str, tuple[str, ...]], ...] = ()


_SEQUENTIAL = dict(sites=("attn_out", "resid_mid", "mlp_out"),
                   reads=(("resid_mid", ("attn_out",)), ("mlp_out", ("attn_out", "resid_mid"))))
LAYOUTS = {
    "pre": Layout("_pre", (("attn_only", False), ("parallel_residual", False), ("norm_placement", "pre")),
                  **_SEQUENTIAL),
    "post": Layout("_post", (("attn_only", False), ("parallel_residual", False), ("norm_placement", "post")),
                   **_SEQUENTIAL),
    # Attention and MLP both read the block's input: neither output feeds the other.
    "parallel": Layout("_parallel", (("attn_only", False), ("parallel_residual", True)), ("attn_out", "mlp_out")),
    "attn_only_pre": Layout("_attn_only_pre", (("attn_only", True), ("norm_placement", "pre")), ("attn_out",)),
    "attn_only_post": Layout("_attn_only_post", (("attn_only", True), ("norm_placement", "post")), ("attn_out",)),
    "sandwich": Layout("_sandwich", (("attn_only", False), ("parallel_residual", False),
                                     ("norm_placement", "sandwich")), **_SEQUENTIAL),
    "reordered": Layout("_reordered", (("attn_only", False), ("parallel_residual", False),
                                       ("norm_placement", "reordered")), **_SEQUENTIAL),
    "attn_only_sandwich": Layout("_attn_only_sandwich", (("attn_only", True), ("norm_placement", "sandwich")),
                                 ("attn_out",)),
    "attn_only_reordered": Layout("_attn_only_reordered", (("attn_only", True), ("norm_placement", "reordered")),
                                  ("attn_out",)),
}


def layout_of(cfg: ModelConfig) -> str:
    """The name of the layout ``cfg`` picks (the one entry of ``LAYOUTS`` whose fields it matches)."""
    found = [name for name, layout in LAYOUTS.items() if all(getattr(cfg, k) == v for k, v in layout.config)]
    if len(found) != 1:
        raise ValueError(f"the config matches {len(found)} block layouts ({found}); known: {list(LAYOUTS)}")
    return found[0]


class Block(nn.Module):
    # TransformerLens' logit-lens tools check this to read resid_post as the block output.
    hook_out_is_single_residual_stream = True

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.layout = layout_of(cfg)
        spec = LAYOUTS[self.layout]
        self.sites = spec.sites
        self._reads = dict(spec.reads)
        self._layout = getattr(self, spec.method)
        norm = pick(NORMS, cfg.norm, "norm")
        before = cfg.norm_placement != "reordered"  # a norm in front of each sublayer (or, post, after the add)
        after = pick(OUTPUT_NORMS, cfg.norm, "norm") if cfg.norm_placement in ("sandwich", "reordered") else None
        if before:
            self.ln1 = norm(cfg)
        if after is not None:
            self.ln1_post = after(cfg)
        self.attn = pick(ATTENTIONS, cfg.attention, "attention")(cfg, layer)
        if "mlp_out" in self.sites:
            if before:
                self.ln2 = norm(cfg)
            if after is not None:
                self.ln2_post = after(cfg)
            self.mlp = make_ffn(cfg, layer)
        self.hook_resid_pre = HookPoint()  # [batch, pos, d_model]
        for site in self.sites:  # hook_attn_out, hook_resid_mid, hook_mlp_out: [batch, pos, d_model]
            setattr(self, f"hook_{site}", HookPoint())
        self.hook_resid_post = HookPoint()  # [batch, pos, d_model]

    def forward(
        self,
        resid_pre: Float[Tensor, "batch pos d_model"],
        kv_cache: Optional[KVCacheEntry] = None,
        padding: Optional[Padding] = None,
    ) -> Float[Tensor, "batch pos d_model"]:
        return self.hook_resid_post(self._layout(self.hook_resid_pre(resid_pre), kv_cache, padding))

    def resume(
        self,
        resid_pre: Float[Tensor, "batch pos d_model"],
        *,
        attn_out: Optional[Float[Tensor, "batch pos d_model"]] = None,
        resid_mid: Optional[Float[Tensor, "batch pos d_model"]] = None,
        mlp_out: Optional[Float[Tensor, "batch pos d_model"]] = None,
        padding: Optional[Padding] = None,
    ) -> Float[Tensor, "batch pos d_model"]:
        """The block's output (after ``hook_resid_post``) from a mid-block site on (``padding``:
        the padded batch's, so the FFN skips pads as in ``forward``).

        Activations given are used as they are (their hooks do not run again); the others
        are computed from them by the layout method ``forward`` runs, so with the clean
        values this equals ``forward`` to the last bit. To replace one activation, give it
        and the clean values of ``unaffected_by(site)``.
        """
        given = {"attn_out": attn_out, "resid_mid": resid_mid, "mlp_out": mlp_out}
        extra = [site for site, value in given.items() if value is not None and site not in self.sites]
        if extra:
            raise ValueError(f"the {self.layout} layout has no {extra[0]}; its sites are {list(self.sites)}")
        return self.hook_resid_post(self._layout(resid_pre, None, padding, **given))

    def unaffected_by(self, site: str) -> tuple[str, ...]:
        """The other mid-block sites whose values do not change when ``site`` is replaced."""
        if site not in self.sites:
            raise ValueError(f"site={site!r} is not in the {self.layout} layout; its sites are {list(self.sites)}")
        return tuple(s for s in self.sites if s != site and site not in self._reads.get(s, ()))

    # ---- the layouts: x is the block's input; a site passed in is not computed again --------
    def _pre(self, x: Tensor, kv_cache: Optional[KVCacheEntry], pad: Optional[Padding], attn_out=None, resid_mid=None, mlp_out=None) -> Tensor:
        if resid_mid is None:
            resid_mid = self.hook_resid_mid(x + self._attn_out(x, kv_cache, pad, attn_out, self.ln1))
        return resid_mid + self._mlp_out(resid_mid, pad, mlp_out, self.ln2)

    def _post(self, x: Tensor, kv_cache: Optional[KVCacheEntry], pad: Optional[Padding], attn_out=None, resid_mid=None, mlp_out=None) -> Tensor:
        if resid_mid is None:
            resid_mid = self.hook_resid_mid(self.ln1(x + self._attn_out(x, kv_cache, pad, attn_out)))
        return self.ln2(resid_mid + self._mlp_out(resid_mid, pad, mlp_out))

    def _parallel(self, x: Tensor, kv_cache: Optional[KVCacheEntry], pad: Optional[Padding], attn_out=None, resid_mid=None,
                  mlp_out=None) -> Tensor:
        return x + self._attn_out(x, kv_cache, pad, attn_out, self.ln1) + self._mlp_out(x, pad, mlp_out, self.ln2)

    def _attn_only_pre(self, x: Tensor, kv_cache: Optional[KVCacheEntry], pad: Optional[Padding], attn_out=None, resid_mid=None,
                       mlp_out=None) -> Tensor:
        return x + self._attn_out(x, kv_cache, pad, attn_out, self.ln1)

    def _attn_only_post(self, x: Tensor, kv_cache: Optional[KVCacheEntry], pad: Optional[Padding], attn_out=None, resid_mid=None,
                        mlp_out=None) -> Tensor:
        return self.ln1(x + self._attn_out(x, kv_cache, pad, attn_out))

    def _sandwich(self, x: Tensor, kv_cache: Optional[KVCacheEntry], pad: Optional[Padding], attn_out=None, resid_mid=None,
                  mlp_out=None) -> Tensor:
        if resid_mid is None:
            resid_mid = self.hook_resid_mid(x + self._attn_out(x, kv_cache, pad, attn_out, self.ln1, self.ln1_post))
        return resid_mid + self._mlp_out(resid_mid, pad, mlp_out, self.ln2, self.ln2_post)

    def _reordered(self, x: Tensor, kv_cache: Optional[KVCacheEntry], pad: Optional[Padding], attn_out=None, resid_mid=None,
                   mlp_out=None) -> Tensor:
        if resid_mid is None:
            resid_mid = self.hook_resid_mid(x + self._attn_out(x, kv_cache, pad, attn_out, None, self.ln1_post))
        return resid_mid + self._mlp_out(resid_mid, pad, mlp_out, None, self.ln2_post)

    def _attn_only_sandwich(self, x: Tensor, kv_cache: Optional[KVCacheEntry], pad: Optional[Padding], attn_out=None,
                            resid_mid=None, mlp_out=None) -> Tensor:
        return x + self._attn_out(x, kv_cache, pad, attn_out, self.ln1, self.ln1_post)

    def _attn_only_reordered(self, x: Tensor, kv_cache: Optional[KVCacheEntry], pad: Optional[Padding], attn_out=None,
                             resid_mid=None, mlp_out=None) -> Tensor:
        return x + self._attn_out(x, kv_cache, pad, attn_out, None, self.ln1_post)

    # ---- the two sublayers, each skipped when its output is given ------------------------------
    def _attn_out(self, x: Tensor, kv_cache: Optional[KVCacheEntry], pad: Optional[Padding], given: Optional[Tensor],
                  norm=None, post=None) -> Tensor:
        if given is not None:
            return given
        out = self.attn(x if norm is None else norm(x), kv_cache, pad)
        return self.hook_attn_out(out if post is None else post(out))

    def _mlp_out(self, x: Tensor, pad: Optional[Padding], given: Optional[Tensor], norm=None, post=None) -> Tensor:
        if given is not None:
            return given
        out = self.mlp(x if norm is None else norm(x), _real(pad))
        return self.hook_mlp_out(out if post is None else post(out))


def _real(padding: Optional[Padding]) -> Optional[Tensor]:
    """The FFN's token mask: None when nothing is padded, or when only real tokens are left (packed)."""
    return padding.query_mask if padding is not None and not padding.packed else None
