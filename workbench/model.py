"""HookedDecoder: the decoder-only skeleton on TransformerLens' HookedRootModule.

    tokens -> embed (+ positions) -> L x Block -> final norm -> unembed -> logits

Every residual-stream write, attention pattern and norm scale is a HookPoint under
TransformerLens' name, so ``run_with_cache`` returns a real ``ActivationCache`` whose
methods (``accumulated_resid``, ``decompose_resid``, ``stack_head_results``, ...) work.

Prompts of different lengths: ``forward``, ``run_with_cache``, ``run_with_hooks`` and
``generate`` take a ``TokenBatch`` or ``attention_mask=`` [batch, pos] (1 = real, 0 = pad);
each row then computes what its prompt computes alone (``workbench.padding`` says how).
"""

from __future__ import annotations

import contextlib
import math
import logging
from typing import Any, Iterable, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor, nn
from tqdm.auto import tqdm
from transformer_lens import FactoredMatrix, HookedRootModule
from transformer_lens.hook_points import HookPoint, LensHandle

from workbench.cache import WorkbenchCache
from workbench.components.mla import CACHE_ENTRIES
from workbench.components.block import Block
from workbench.components.norm import NORMS
from workbench.components.positional import POS_EMBEDDINGS
from workbench.components.registry import add_bias, bias_term, pick
from workbench.config import ModelConfig
from workbench.utils import check_float, check_int, check_seed, check_token_ids, eval_mode
from workbench.padding import (
    PAD_STR, Padding, TokenBatch, check_attention_mask, cut_after_stop, forward_padding, left_padded_mask, loss_targets,
    positions_from_mask, unpack,
)



class Embed(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.W_E = nn.Parameter(torch.empty(cfg.d_vocab, cfg.d_model))
        # Gemma: the embedding times sqrt(d_model), the factor rounded to the weights' dtype first
        # (in bf16 sqrt(3072) = 55.43 becomes 55.5), as HF's Gemma does.
        self.scale = math.sqrt(cfg.d_model) if cfg.scale_embeddings else None

    def forward(self, tokens: Int[Tensor, "batch pos"]) -> Float[Tensor, "batch pos d_model"]:
        if self.scale is None:
            return self.W_E[tokens]
        return self.W_E[tokens] * torch.tensor(self.scale, dtype=self.W_E.dtype)


class Unembed(nn.Module):
    """The head; when tied, ``W_U`` is ``W_E`` transposed and nothing is stored here."""

    def __init__(self, cfg: ModelConfig, embed: Embed):
        super().__init__()
        if cfg.tie_embeddings:
            self._embed = [embed]  # a list, so the tied weight is not registered twice
        else:
            self.W_U_param = nn.Parameter(torch.empty(cfg.d_model, cfg.d_vocab))
        # A learned bias only once a LayerNorm is folded in (b_U += ln_final.b @ W_U); else fixed zeros.
        add_bias(self, "b_U", (cfg.d_vocab,), cfg.folded_ln and cfg.norm == "layernorm")
        self.tied = cfg.tie_embeddings
        self.softcap = cfg.final_logit_softcap  # Gemma 2: logits = cap * tanh(logits / cap)

    @property
    def W_U(self) -> Float[Tensor, "d_model d_vocab"]:
        return self._embed[0].W_E.T if self.tied else self.W_U_param

    def forward(self, x: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_vocab"]:
        logits = x @ self.W_U
        bias = bias_term(self, "b_U")
        logits = logits if bias is None else logits + bias
        return logits if self.softcap is None else torch.tanh(logits / self.softcap) * self.softcap


class KVCache:
    """Per-layer keys and values for incremental decoding; ``length`` positions so far.

    ``attention_mask`` [batch, length] (bool) is kept once a padded batch was fed, so later
    steps continue each row's positions and keep its pads out of sight; None: nothing padded.
    A sliding-window layer's entry holds only the latest positions (``KVCacheEntry``); setting
    the mask tells it how many a later query of some row can still see.
    ``step``: None here; a ``StaticKVCache`` (``workbench.static_cache``) decodes in fixed-shape steps.
    """

    step = None

    def __init__(
        self, cfg: ModelConfig, batch: int, device: torch.device, dtype: torch.dtype, max_len: Optional[int] = None
    ):
        max_len = cfg.n_ctx if max_len is None else min(max_len, cfg.n_ctx)
        entry = pick(CACHE_ENTRIES, cfg.attention, "attention")  # MLA keeps its latent, not keys and values
        # the window goes only to a sliding layer's entry (MLA has none: the config refuses it)
        self.entries = [
            entry(cfg, batch, device, dtype, max_len, **({"window": cfg.sliding_window} if cfg.layer_is_local(i) else {}))
            for i in range(cfg.n_layers)
        ]
        self.window = cfg.sliding_window
        self._attention_mask: Optional[Tensor] = None

    @property
    def length(self) -> int:
        return self.entries[0].length

    @property
    def attention_mask(self) -> Optional[Tensor]:
        return self._attention_mask

    @attention_mask.setter
    def attention_mask(self, mask: Optional[Tensor]) -> None:
        self._attention_mask = mask
        if self.window is None:
            return
        hold = self.window - 1 if mask is None else self._window_hold(mask, self.window)
        for entry in self.entries:
            if getattr(entry, "window", None) is not None:
                entry.hold = hold

    @staticmethod
    def _window_hold(mask: Tensor, window: int) -> int:
        """Columns (the latest) a later query can still see in a sliding layer: each row's last
        window - 1 real keys. Left padding: the last window - 1 columns; a row with pads after real
        tokens reaches further back."""
        real = mask.sum(dim=1, keepdim=True)
        needed = mask & (real - positions_from_mask(mask) < window)  # a later query sits at position >= real
        cols = needed.any(dim=0).nonzero()
        return 0 if len(cols) == 0 else mask.shape[1] - int(cols[0])

    def __getitem__(self, layer: int):
        return self.entries[layer]


class HookedDecoder(HookedRootModule):
    # True while ``model.compile()``'s compiled call runs (workbench.compiled): dynamo then guards on
    # every hook point's hooks. Under any other torch.compile a hooked model refuses to run.
    _hooks_guarded = False
    # Set with it: whether this call's attention mask holds a pad, checked before the graph (None: no mask).
    _padded_call: Optional[bool] = None

    def __init__(self, cfg: ModelConfig, tokenizer: Any = None):
        super().__init__()
        if not isinstance(cfg, ModelConfig):
            raise TypeError(f"HookedDecoder needs a ModelConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.embed = Embed(cfg)
        self.hook_embed = HookPoint()  # [batch, pos, d_model]
        self.pos_embed = pick(POS_EMBEDDINGS, cfg.positional, "positional")(cfg)
        if self.pos_embed.adds_to_residual:
            self.hook_pos_embed = HookPoint()  # [batch, pos, d_model]
        self.blocks = nn.ModuleList([Block(cfg, layer) for layer in range(cfg.n_layers)])
        self.ln_final = pick(NORMS, cfg.norm, "norm")(cfg)
        self.unembed = Unembed(cfg, self.embed)
        # The absolute position of the current input's first token (a KV cache's length, else 0):
        # a hook that acts on chosen positions sees [batch, 1, ...] in a decode step and reads it.
        self.pos_offset = 0
        # In a padded batch, each token's position within its own prompt [batch, pos] (None when
        # nothing is padded): a hook acting on chosen positions reads it, so a left-padded row is
        # steered at its prompt's positions, not at the padded slots.
        self.row_positions: Optional[Tensor] = None
        self.init_weights()
        self.setup()

    # ---- construction -----------------------------------------------------------
    @torch.no_grad()
    def init_weights(self, seed: Optional[int] = None) -> None:
        """GPT-2 style: N(0, init_std); output projections scaled by 1/sqrt(2 * n_layers)."""
        if any(p.is_meta for p in self.parameters()):
            return
        seed = self.cfg.seed if seed is None else seed
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        std, out_std = self.cfg.init_std, self.cfg.init_std / math.sqrt(2 * self.cfg.n_layers)
        for name, p in self.named_parameters():
            if p.ndim < 2:
                p.fill_(1.0 if name.endswith(".w") else 0.0)
            else:
                scale = out_std if name.endswith(("W_O", "W_out")) else std
                # drawn on the CPU: the seed's generator lives there, and a seed gives one model on any device
                p.copy_(torch.randn(p.shape, generator=gen, device="cpu") * scale)

    @property
    def device(self) -> torch.device:
        return self.embed.W_E.device

    def make_kv_cache(self, batch: int, max_len: Optional[int] = None, static: bool = False) -> KVCache:
        """An empty KV cache for ``batch`` sequences of up to ``max_len`` (default n_ctx) positions;
        ``static``: a ``StaticKVCache``, whose decode steps all have one shape (``workbench.static_cache``)."""
        if not static:
            return KVCache(self.cfg, batch, self.device, self.embed.W_E.dtype, max_len)
        from workbench.static_cache import StaticKVCache

        return StaticKVCache(self.cfg, batch, self.device, self.embed.W_E.dtype, max_len)

    # ---- forward ----------------------------------------------------------------
    def forward(
        self,
        input: Union[str, Sequence[str], Tensor, TokenBatch],
        return_type: Optional[str] = "logits",
        loss_per_token: bool = False,
        *,
        tokens: Optional[Union[Tensor, TokenBatch]] = None,
        start_at_layer: Optional[int] = None,
        stop_at_layer: Optional[int] = None,
        kv_cache: Optional[KVCache] = None,
        attention_mask: Optional[Tensor] = None,
    ):
        """Run the model.

        ``input`` is tokens [batch, pos] (or a string when a tokenizer is attached), or, with
        ``start_at_layer``, the residual stream [batch, pos, d_model] entering that block;
        ``tokens`` then supplies the targets for the loss. With ``stop_at_layer`` the residual
        stream entering that block is returned instead of logits.

        A padded batch: a ``TokenBatch`` as ``input``, or ``attention_mask`` [batch, pos] (1 real,
        0 pad). Real positions then equal each prompt run alone; pad positions hold finite values
        that mean nothing; the loss counts only real targets predicted from real tokens.
        """
        if return_type not in ("logits", "loss", "both", None):
            raise ValueError(f"return_type must be 'logits', 'loss', 'both' or None, got {return_type!r}")
        if torch.compiler.is_compiling() and not self._hooks_guarded:
            _refuse_unguarded_hooks(self)
        n = self.cfg.n_layers  # as TransformerLens: a negative layer counts from the end
        if start_at_layer is not None:
            start_at_layer = check_int("start_at_layer", start_at_layer, -n, n)
            start_at_layer += n if start_at_layer < 0 else 0
        if stop_at_layer is not None:
            stop_at_layer = check_int("stop_at_layer", stop_at_layer, -n, n)
        step = kv_cache.step if kv_cache is not None else None  # a static cache's fixed-shape decode step
        if step is not None and attention_mask is not None:
            raise ValueError("a static KV cache's decode step takes no attention_mask: it keeps the prompt's")
        if step is not None and step.full:  # here: past the buffer, index_copy_ is an IndexError (a kernel assert on a GPU)
            raise ValueError(f"KV cache full: its {kv_cache.length} positions are all written; make it with a "
                             "larger max_len")
        offset = kv_cache.length if kv_cache is not None and step is None else 0
        self.pos_offset = offset if step is None else step.column  # a tensor in a static step: no constant
        input, attention_mask = unpack(input, attention_mask)
        tokens, attention_mask = unpack(tokens, attention_mask) if tokens is not None else (tokens, attention_mask)
        if start_at_layer is None:
            if not isinstance(input, Tensor):  # text; several of different lengths come back padded
                input, attention_mask = unpack(self.to_tokens(input), attention_mask)
            tokens = self._check_tokens(input, offset)
            padding, real = self._padding(attention_mask, tokens.shape, kv_cache) if step is None else (step, None)
            if padding is not None and kv_cache is None and stop_at_layer is None and not self._hooks_attached() \
                    and not torch.compiler.is_compiling():  # packing gathers the real tokens: a data-dependent shape
                padding.packed = True  # nobody looks: pads are dropped from every per-token step
            ids = padding.pack(tokens) if padding is not None and padding.packed else tokens
            resid = self.hook_embed(self.embed(ids))
            if self.pos_embed.adds_to_residual:
                positions = padding.positions if padding is not None else None
                resid = resid + self.hook_pos_embed(self.pos_embed(ids, offset, positions))
            start_at_layer = 0
        else:
            resid = input.to(self.device)
            padding, real = self._padding(attention_mask, resid.shape[:2], kv_cache) if step is None else (step, None)
            if tokens is not None:
                tokens = self._check_tokens(tokens, offset)
        self.row_positions = None if padding is None else padding.row_positions
        for block in self.blocks[start_at_layer:stop_at_layer]:
            resid = block(resid, kv_cache[block.layer] if kv_cache is not None else None, padding)
        if stop_at_layer is not None:
            self.row_positions = None
            return resid
        logits = self.unembed(self.ln_final(resid))  # computed even for None, so final hooks fire
        self.row_positions = None  # this run's: never read by a later partial run (run_from_site sets its own)
        if padding is not None and padding.packed:
            logits = padding.unpack(logits)
        elif padding is not None and step is None:  # 0 at the pads however the forward ran (hooked, compiled)
            logits = logits.masked_fill(~padding.query_mask[..., None], 0.0)
        if return_type in ("logits", None):
            return logits if return_type else None
        if tokens is None:
            raise ValueError("the loss needs tokens: pass tokens=... when starting from a residual stream")
        loss = self.loss_fn(logits, tokens, per_token=loss_per_token, attention_mask=real,
                            check_values=not self._guarded_compiling())
        if return_type == "loss":
            return loss
        return logits, loss

    def _padding(
        self, attention_mask: Optional[Tensor], shape: Sequence[int], kv_cache: Optional[KVCache]
    ) -> tuple[Optional[Padding], Optional[Tensor]]:
        """This forward's ``Padding`` (None: nothing padded) and its own mask; ``kv_cache`` keeps the whole mask."""
        past = kv_cache.attention_mask if kv_cache is not None else None
        offset = kv_cache.length if kv_cache is not None else 0
        padded = self._padded_call if self._guarded_compiling() else None  # model.compile() checked the mask
        padding, mask, full = forward_padding(attention_mask, shape, past, offset, self.device, padded)
        if kv_cache is not None:
            kv_cache.attention_mask = full
        return padding, mask

    def _guarded_compiling(self) -> bool:
        """Inside ``model.compile()``'s graph, whose call checked the tokens and the mask beforehand."""
        return torch.compiler.is_compiling() and self._hooks_guarded

    def _hooks_attached(self) -> bool:
        return any(hp._forward_hooks or hp._forward_pre_hooks or hp._backward_hooks for hp in self.hook_dict.values())

    @staticmethod
    def loss_fn(
        logits: Float[Tensor, "batch pos d_vocab"],
        tokens: Int[Tensor, "batch pos"],
        per_token: bool = False,
        attention_mask: Optional[Tensor] = None,
        check_values: bool = True,
    ) -> Tensor:
        """Next-token cross-entropy, every position supervised at once; [batch, pos-1] if per_token.

        With ``attention_mask`` a target counts only when it and the token before it are real
        (a row's first real token has nothing real to be predicted from, as when run alone): the
        mean is over those targets, and the per-token losses are 0 everywhere else.
        ``check_values=False``: the mask's values were checked already (a compiled forward's call).
        """
        if tokens.shape[1] < 2:
            raise ValueError("the next-token loss needs at least 2 tokens per sequence")
        losses = F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1), reduction="none"
        ).view(tokens.shape[0], -1)
        if attention_mask is None:
            return losses if per_token else losses.mean()
        mask = check_attention_mask(attention_mask, tokens.shape, require_real=False, check_values=check_values)
        mask = mask.to(losses.device)
        counted = loss_targets(mask, check=check_values and not per_token)  # per-token losses need no target
        losses = losses.masked_fill(~counted, 0.0)
        if per_token:
            return losses
        return losses.sum() / counted.sum()

    def _check_tokens(self, tokens: Tensor, offset: int = 0) -> Int[Tensor, "batch pos"]:
        """``tokens`` as long ids [batch, pos] on the model's device, or ValueError saying what is wrong.

        Any integer dtype is accepted (uint8 and int32 ids are common from numpy and datasets);
        indexing needs long, since torch reads a uint8 tensor as a boolean mask.
        """
        if not isinstance(tokens, Tensor):
            raise ValueError(f"tokens must be an integer tensor [batch, pos], got {type(tokens).__name__}")
        if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise ValueError(f"tokens must be an integer tensor, got dtype {tokens.dtype}")
        if tokens.ndim == 1:
            tokens = tokens[None]
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [batch, pos], got shape {tuple(tokens.shape)}")
        if tokens.shape[1] == 0:
            raise ValueError("empty input: need at least one token")
        if offset + tokens.shape[1] > self.cfg.n_ctx:
            raise ValueError(
                f"sequence of {offset + tokens.shape[1]} tokens is longer than the context "
                f"n_ctx={self.cfg.n_ctx}; shorten the prompt or use a model with a larger n_ctx"
            )
        tokens = tokens.long()
        if not self._guarded_compiling():  # model.compile() checks before its graph
            self._check_token_range(tokens)
        return tokens.to(self.device)

    def _check_token_range(self, tokens: Tensor) -> None:
        # One read of one value: on a GPU every read of a value waits for the queued kernels (a host sync),
        # so a valid batch costs one sync, not two (min and max); the range is read only to refuse.
        if tokens.numel() and bool(((tokens < 0) | (tokens >= self.cfg.d_vocab)).any()):
            raise ValueError(
                f"token ids must lie in [0, {self.cfg.d_vocab}); got range "
                f"[{int(tokens.min())}, {int(tokens.max())}]"
            )

    def compile(self, recompile_limit: Optional[int] = None, **options: Any) -> "HookedDecoder":
        """``torch.compile`` this model in place, every hook honoured (``workbench.compiled``);
        ``options`` go to torch.compile. ``workbench.compiled.uncompile(model)`` undoes it."""
        from workbench.compiled import compile_model

        return compile_model(self, recompile_limit, **options)

    def run_with_hooks(self, *model_args: Any, fwd_hooks: Sequence = (), bwd_hooks: Sequence = (),
                       reset_hooks_end: bool = True, clear_contexts: bool = False, **model_kwargs: Any):
        """HookedRootModule's, but the forward is a call of the model (``model(...)``), not of its
        ``forward``: a model compiled by ``model.compile()`` then runs its hooks compiled (its guarded
        call is the module's call; ``.forward`` is the eager code), and every analysis that takes a
        compiled model (ablations, patching, sweeps) runs on the compiled path."""
        if len(bwd_hooks) > 0 and reset_hooks_end:
            logging.warning("WARNING: Hooks will be reset at the end of run_with_hooks. This removes the backward "
                            "hooks before a backward pass can occur.")
        with self.hooks(fwd_hooks, bwd_hooks, reset_hooks_end, clear_contexts) as hooked_model:
            return hooked_model(*model_args, **model_kwargs)

    def run_with_cache(self, *args: Any, remove_batch_dim: bool = False, **kwargs: Any):
        """Like HookedRootModule's, but the cache is a TransformerLens ``ActivationCache``: a
        ``WorkbenchCache``, whose ``apply_ln_to_stack`` (and so ``logit_attrs``, ``decompose_resid``,
        ... with ``apply_ln=True``) includes the norms' weights when they are not folded."""
        if "names_filter" not in kwargs and not self.use_attn_result:
            from workbench.habits import default_names_filter

            kwargs["names_filter"] = default_names_filter(self)
        fast = not remove_batch_dim and not set(kwargs) & _TL_CACHE_OPTIONS
        if fast:  # the common call: torch's own forward hooks, one small closure per hook point
            out, cache_dict = self._run_with_plain_cache(args, kwargs.pop("names_filter", None), kwargs)
        else:
            out, cache_dict = super().run_with_cache(*args, remove_batch_dim=remove_batch_dim, **kwargs)
        cache = WorkbenchCache(cache_dict, self, has_batch_dim=not remove_batch_dim)
        cache.attention_mask = self._mask_of(args, kwargs)  # bool [batch, pos], True = real; None: unpadded
        return out, cache

    def hook_names_of(self, names_filter: Any) -> list[str]:
        """The hook points a ``run_with_cache`` ``names_filter`` selects, in the model's order: None (all), one
        name, a collection of names (names that are not hook points select nothing) or a predicate."""
        if names_filter is None:
            return list(self.hook_dict)
        if isinstance(names_filter, str):
            return [names_filter] if names_filter in self.hook_dict else []
        if isinstance(names_filter, (list, tuple, set, frozenset)):
            return [n for n in self.hook_dict if n in names_filter]
        if callable(names_filter):
            return [n for n in self.hook_dict if names_filter(n)]
        raise ValueError("names_filter must be a string, list of strings, or function")

    def _run_with_plain_cache(self, args: tuple, names_filter: Any, kwargs: dict) -> tuple[Any, dict]:
        """``run_with_cache`` without a device move, position slice, batch-dim removal or backward pass:
        what TransformerLens' caching hooks store (each activation, detached), from a plain
        ``register_forward_hook`` per hook point, added after any hook already there and removed at
        the end. TL's ``add_hook`` wraps each hook in a closure of its own, files a handle and, at the
        end, walks every hook point; with every hook point cached that bookkeeping cost more than a
        tenth of a small model's forward."""
        names = self.hook_names_of(names_filter)
        cache: dict = {}
        added = []
        try:
            for name in names:
                point, save = self.hook_dict[name], _saver(cache, name)
                # filed where TL's has_hooks() looks: components compute scores, pattern, per-head results
                # only when a hook listens
                lens = LensHandle(point.register_forward_hook(save), False, None, user_hook=save)
                point.fwd_hooks.append(lens)
                added.append((point, lens))
            return self(*args, **kwargs), cache
        finally:
            for point, lens in added:
                lens.hook.remove()
                point.fwd_hooks.remove(lens)

    def _mask_of(self, args: tuple, kwargs: dict) -> Optional[Tensor]:
        """The attention mask a forward with these arguments used (None when there was none)."""
        input = args[0] if args else kwargs.get("input")
        mask = kwargs.get("attention_mask")
        if isinstance(input, TokenBatch):
            mask = input.attention_mask
        elif mask is None and isinstance(input, (list, tuple)) and self.tokenizer is not None:
            tokens = self.to_tokens(input)  # texts of different lengths came back padded
            mask = tokens.attention_mask if isinstance(tokens, TokenBatch) else None
        return None if mask is None else torch.as_tensor(mask, device=self.device).bool()

    def process_weights(
        self,
        fold_ln: bool = True,
        center_writing_weights: Optional[bool] = None,
        center_unembed: bool = True,
        fold_value_biases: bool = True,
    ) -> "HookedDecoder":
        """TransformerLens' weight processing, in place; the predictions are unchanged.

        ``fold_ln`` moves every norm's weight (and LayerNorm's bias) into the weights that read it
        (``cfg.folded_ln``; TL's LNPre/RMSPre); ``center_writing_weights`` (default: where valid,
        i.e. pre-norm LayerNorm) removes the d_model mean of everything written to the residual
        stream; ``center_unembed`` removes W_U's mean over the vocabulary (logits shift by a
        constant per position); ``fold_value_biases`` moves b_V into b_O. A tied model is untied.
        Equations and what is refused: ``workbench.processing``. Hooks attached before are removed.
        """
        from workbench.processing import process_weights

        return process_weights(self, fold_ln, center_writing_weights, center_unembed, fold_value_biases)

    # ---- generation -------------------------------------------------------------
    @torch.no_grad()
    def generate(
        self,
        input: Union[str, Sequence[str], Tensor, TokenBatch],
        max_new_tokens: int = 32,
        use_kv_cache: bool = True,
        temperature: float = 0.0,
        top_k: Optional[int] = None,
        top_p: Optional[float] = None,
        seed: Optional[Union[int, Sequence[int]]] = None,
        stop_tokens: Optional[Iterable[int]] = None,
        verbose: bool = False,
        attention_mask: Optional[Tensor] = None,
        static_cache: bool = False,
    ) -> Union[Tensor, str, list[str], TokenBatch]:
        """Continue ``input`` by up to ``max_new_tokens`` tokens (greedy when temperature=0).

        A row that emits one of ``stop_tokens`` is finished: it is padded with that stop token
        while other rows go on; generation ends when every row has finished. A string input
        returns a string (the prompt and its continuation); tokens return [batch, pos + new].

        Prompts of different lengths: a list of strings (returns a list of strings, each cut
        after its first stop token), a left-padded ``TokenBatch`` (returns one, its mask
        extended), or tokens with ``attention_mask``. Every row continues as its prompt alone
        would: exactly so when greedy. ``seed`` as one int per row gives each row its own
        generator, so a sampled row equals its prompt sampled alone with that seed; one int
        seeds one generator for the whole batch (reproducible, but a row's draws then depend
        on the rows before it).

        ``static_cache``: decode with a ``StaticKVCache`` (``workbench.static_cache``), every step of
        one shape, so a compiled model (``model.compile()``; on a GPU ``mode="reduce-overhead"``
        for CUDA graphs) runs one graph for every token. The same tokens as the dynamic cache.
        """
        as_string = isinstance(input, str)
        as_strings = isinstance(input, (list, tuple)) and bool(input) and all(isinstance(t, str) for t in input)
        as_batch = isinstance(input, TokenBatch)
        if as_strings:
            input = self.to_tokens(list(input), padding_side="left")
        input, attention_mask = unpack(input, attention_mask)
        tokens = self._check_tokens(self.to_tokens(input) if as_string else input)
        max_new_tokens = check_int("max_new_tokens", max_new_tokens, 0)
        mask = left_padded_mask(attention_mask, tokens.shape, self.device)
        if tokens.shape[1] + max_new_tokens > self.cfg.n_ctx:
            raise ValueError(
                f"prompt ({tokens.shape[1]}) + max_new_tokens ({max_new_tokens}) exceeds n_ctx={self.cfg.n_ctx}"
            )
        temperature = check_float("temperature", temperature, 0)
        top_k = None if top_k is None else check_int("top_k", top_k, 1)
        top_p = None if top_p is None else check_float("top_p", top_p, 0, 1, lo_open=True)
        stop_ids = sorted({int(check_token_ids("stop_tokens", t, self.cfg.d_vocab)) for t in (stop_tokens or [])})
        if static_cache and not use_kv_cache:
            raise ValueError("static_cache=True is a KV cache: it needs use_kv_cache=True")
        with eval_mode(self):
            gen = _generators(seed, tokens.shape[0], self.device)
            stops = torch.tensor(stop_ids, device=self.device, dtype=torch.long)
            finished = torch.zeros(tokens.shape[0], dtype=torch.bool, device=self.device)
            pad = torch.full_like(finished, stop_ids[0] if stop_ids else 0, dtype=torch.long)
            # Sized to this call, not n_ctx: an imported 128k-context model must not allocate 128k positions.
            # A static cache rounds up to 64 positions, so generations of similar lengths share its graph.
            room = tokens.shape[1] + max_new_tokens
            room = min(-(-room // 64) * 64, self.cfg.n_ctx) if static_cache else room
            cache = self.make_kv_cache(tokens.shape[0], room, static_cache) if use_kv_cache else None
            logits = self(tokens, kv_cache=cache, attention_mask=mask)[:, -1]
            if static_cache and max_new_tokens > 1:
                cache.start_decoding()
            width = tokens.shape[1]
            for _ in tqdm(range(max_new_tokens), disable=not verbose, desc="generating"):
                next_token = _sample(logits, temperature, top_k, top_p, gen)
                next_token = torch.where(finished, pad, next_token)
                tokens = torch.cat([tokens, next_token[:, None]], dim=1)
                mask = F.pad(mask, (0, 1), value=True) if mask is not None else None
                if stop_ids:  # one host sync per token, only when something can stop
                    finished |= torch.isin(next_token, stops)
                    if bool(finished.all()):
                        break
                if tokens.shape[1] == width + max_new_tokens or tokens.shape[1] == self.cfg.n_ctx:
                    break
                step_input = next_token[:, None] if use_kv_cache else tokens
                # The KV cache remembers the prompt's mask; a recompute passes the whole mask again.
                logits = self(step_input, kv_cache=cache, attention_mask=None if use_kv_cache else mask)[:, -1]
                if static_cache:
                    cache.advance()
        self.pos_offset = 0
        if as_string:
            return self.to_string(tokens[0])
        full_mask = mask if mask is not None else torch.ones_like(tokens, dtype=torch.bool)
        if as_strings:
            return [self.to_string(cut_after_stop(row, m, width, stops)) for row, m in zip(tokens, full_mask)]
        if as_batch:
            return TokenBatch(tokens, full_mask.long(), "left")
        return tokens

    @contextlib.contextmanager
    def steer(self, direction: Any, scale: Any = 1.0, mode: str = "add", positions: Any = "all"):
        """Every forward and ``generate`` inside the block is steered along ``direction`` (a
        ``workbench.analysis.Direction``): ``add`` scale x vector, ``ablate`` (project out) or
        ``clamp``, at absolute ``positions`` (the same with or without the KV cache). A list of
        scales steers row blocks of a scale-major batch. See ``workbench.analysis.directions``."""
        # Duck-typed (anything with Direction's ``hooks``): the model layer never imports analysis.
        if not callable(getattr(direction, "hooks", None)):
            raise ValueError(f"direction must be a workbench.analysis.Direction, got {type(direction).__name__}")
        with self.hooks(fwd_hooks=direction.hooks(scale, mode, positions, model=self)):
            yield self

    # ---- tokenizer helpers --------------------------------------------------------
    def _need_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer attached: pass token ids, or set model.tokenizer")
        return self.tokenizer

    def to_tokens(
        self, text: Union[str, Sequence[str]], padding_side: Optional[str] = None, strict: bool = False,
        prepend_bos: Optional[bool] = None,
    ) -> Union[Int[Tensor, "batch pos"], TokenBatch]:
        """Token ids [batch, pos] of one text, or of several that tokenize to one length.

        Texts of different lengths, or any ``padding_side`` ("right" by default, "left" for
        ``generate``), give a ``TokenBatch``: ids padded with the tokenizer's ``pad_id`` plus
        the attention mask, which every forward and ``generate`` accept as they are.
        Words outside the vocabulary warn, naming them (``UnknownTokenWarning``: they encode
        as ``unk``); ``strict=True`` raises instead, as the app does. ``prepend_bos`` (TL's):
        None keeps the tokenizer's own choice, True puts its BOS first, False takes it off.
        """
        from workbench.habits import apply_prepend_bos
        from workbench.tokenizer import encode_checked

        tok = self._need_tokenizer()
        texts = [text] if isinstance(text, str) else list(text)
        ids = []
        for t in texts:  # a loop, not a comprehension: the warning then points at the caller's line
            ids.append(apply_prepend_bos(tok, encode_checked(tok, t, strict=strict), prepend_bos))
        if padding_side is None and len({len(i) for i in ids}) == 1:
            return torch.tensor(ids, dtype=torch.long, device=self.device)
        return TokenBatch.from_ids(ids, getattr(tok, "pad_id", 0), padding_side or "right", self.device)

    def to_string(self, tokens: Union[Tensor, Sequence[int]]) -> str:
        ids = tokens.tolist() if isinstance(tokens, Tensor) else list(tokens)
        return self._need_tokenizer().decode(ids)

    def to_str_tokens(
        self, input: Union[str, Sequence[str], Tensor, Sequence[int], TokenBatch],
        attention_mask: Optional[Union[Tensor, bool]] = None,  # a bool only to refuse it, naming prepend_bos
        prepend_bos: Optional[bool] = None,
    ) -> Union[list[str], list[list[str]]]:
        """Readable tokens. With a mask (or a ``TokenBatch``) pads show as "<pad>", and a batch
        of several rows gives one list per row; a list of texts gives one list per text.

        ``prepend_bos`` (TL's) applies to text as in ``to_tokens``: None keeps the tokenizer's own
        choice, True puts its BOS first, False takes it off; token ids are shown as they are
        (TransformerLens ignores it for tokens too)."""
        from workbench.habits import apply_prepend_bos

        tok = self._need_tokenizer()
        if isinstance(attention_mask, bool):  # TL's second positional argument is prepend_bos, ours the mask
            raise ValueError(f"to_str_tokens' second argument is attention_mask (a tensor), got {attention_mask!r}: "
                             f"pass TransformerLens' prepend_bos by name, to_str_tokens(text, prepend_bos={attention_mask!r})")
        if isinstance(input, (list, tuple)) and input and all(isinstance(t, str) for t in input):
            return [self.to_str_tokens(t, prepend_bos=prepend_bos) for t in input]  # TL's: one list per text
        input, attention_mask = unpack(input, attention_mask)
        ids = apply_prepend_bos(tok, tok.encode(input), prepend_bos) if isinstance(input, str) else input
        if attention_mask is None:
            ids = ids.flatten().tolist() if isinstance(ids, Tensor) else list(ids)
            return [tok.token_str(i) for i in ids]
        ids = torch.as_tensor(ids).reshape(-1, torch.as_tensor(ids).shape[-1])
        mask = check_attention_mask(attention_mask, ids.shape, require_real=False)
        rows = [[tok.token_str(i) if m else PAD_STR for i, m in zip(r.tolist(), mr.tolist())] for r, mr in zip(ids, mask)]
        return rows[0] if len(rows) == 1 else rows

    def to_single_token(self, text: str) -> int:
        """The id of ``text`` when the tokenizer spells it as exactly one known token (a leading
        space and all); ValueError saying what it is instead otherwise."""
        from workbench.tokenizer import unknown_pieces

        tok = self._need_tokenizer()
        if not text:
            raise ValueError("the text is empty: type a single token")
        if unknown_pieces(tok, text):
            raise ValueError(f"{text!r} is not in the tokenizer's vocabulary")
        ids = tok.encode(text)
        if len(ids) != 1:
            pieces = [tok.token_str(i) for i in ids]
            raise ValueError(f"{text!r} is {len(ids)} tokens ({pieces}), not one: type a single token")
        return ids[0]

    # ---- TransformerLens habits (workbench.habits says what each does here) ---------------
    use_attn_result = True  # set_use_attn_result(False): a default run_with_cache leaves hook_result out

    def to_single_str_token(self, token: Union[int, Tensor]) -> str:
        """TL's: the readable string of one token id."""
        from workbench.habits import to_single_str_token

        return to_single_str_token(self, token)

    def set_use_attn_result(self, use_attn_result: Any) -> None:  # Any: refused below with our message
        """TL's switch. ``hook_result`` is computed whenever something hooks it, so True changes
        nothing; False leaves it out of a ``run_with_cache`` given no ``names_filter``."""
        from workbench.habits import set_use_attn_result

        set_use_attn_result(self, use_attn_result)

    @classmethod
    def from_pretrained(cls, name: Any, **kwargs: Any) -> "HookedDecoder":
        """TL's habit: a shipped checkpoint by name, a checkpoint folder, or a Hugging Face model
        folder or hub id (``workbench.habits.from_pretrained``)."""
        from workbench.habits import from_pretrained

        return from_pretrained(cls, name, **kwargs)

    # ---- weights under TransformerLens' names ---------------------------------------
    @property
    def W_E(self) -> Float[Tensor, "d_vocab d_model"]:
        return self.embed.W_E

    @property
    def W_pos(self) -> Tensor:
        if not self.pos_embed.adds_to_residual:
            raise AttributeError(f"positional={self.cfg.positional!r} adds no position embedding (no W_pos)")
        return self.pos_embed.W_pos

    @property
    def W_U(self) -> Float[Tensor, "d_model d_vocab"]:
        return self.unembed.W_U

    @property
    def b_U(self) -> Float[Tensor, " d_vocab"]:
        return self.unembed.b_U

    def _stack(self, get) -> Tensor:
        return torch.stack([get(block) for block in self.blocks], dim=0)

    W_Q = property(lambda self: self._stack(lambda b: b.attn.W_Q if hasattr(b.attn, "W_Q") else self._no_mla("W_Q")))
    W_K = property(lambda self: self._stack(lambda b: b.attn.W_K if hasattr(b.attn, "W_K") else self._no_mla("W_K")))

    @property
    def W_V(self) -> Float[Tensor, "n_layers head_index d_model d_head"]:
        """Per-head value weights. MLA: W_DKV diag(kv_norm.w) W_UV, acting on the ln1-normed stream,
        exact up to the KV latent's per-token 1/rms (``MLA.effective_W_V``)."""
        return self._stack(lambda b: b.attn.effective_W_V() if hasattr(b.attn, "effective_W_V") else b.attn.W_V)
    W_O = property(lambda self: self._stack(lambda b: b.attn.W_O))
    b_Q = property(lambda self: self._stack(lambda b: b.attn.b_Q))
    b_K = property(lambda self: self._stack(lambda b: b.attn.b_K))
    b_V = property(lambda self: self._stack(lambda b: b.attn.b_V))
    b_O = property(lambda self: self._stack(lambda b: b.attn.b_O))
    W_in = property(lambda self: self._stack(lambda b: b.mlp.W_in))
    W_out = property(lambda self: self._stack(lambda b: b.mlp.W_out))
    W_gate = property(lambda self: self._stack(lambda b: b.mlp.W_gate))
    b_in = property(lambda self: self._stack(lambda b: b.mlp.b_in))
    b_out = property(lambda self: self._stack(lambda b: b.mlp.b_out))

    @property
    def QK(self) -> FactoredMatrix:
        """W_Q W_K^T per head (before any rotation, as TransformerLens'). With QK-norm the query and
        key norms' gains are included: the scores are then exactly q_hat QK k_hat^T scaled by each
        query's and key's 1/rms, a positive number per token that no matrix can hold."""
        if self.cfg.attention == "mla":
            self._no_mla("QK")
        if self.cfg.qk_norm == "none":
            return FactoredMatrix(self.W_Q, self.W_K.transpose(-2, -1))

        def gains(block, kind: str) -> Tensor:  # [head_index, d_head]
            attn = block.attn
            w = (attn.q_norm if kind == "q" else attn.k_norm).w
            heads = self.cfg.n_heads if kind == "q" else self.cfg.n_kv_heads
            w = w.expand(heads, -1) if self.cfg.qk_norm == "head" else w.view(heads, -1)
            return w if kind == "q" else w.repeat_interleave(attn.group, dim=0)

        q_gain, k_gain = self._stack(lambda b: gains(b, "q")), self._stack(lambda b: gains(b, "k"))
        return FactoredMatrix(self.W_Q * q_gain[:, :, None], (self.W_K * k_gain[:, :, None]).transpose(-2, -1))

    @property
    def OV(self) -> FactoredMatrix:
        """W_V W_O per head; for MLA through ``W_V``'s effective product (up to the latent's 1/rms)."""
        return FactoredMatrix(self.W_V, self.W_O)

    # MLA (attention="mla"): the content (no-RoPE) part of the QK circuit, which has fixed weights.
    @property
    def W_Q_nope(self) -> Float[Tensor, "n_layers head_index d_model qk_nope"]:
        return self._stack(lambda b: self._mla(b).effective_W_Q_nope())

    @property
    def W_K_nope(self) -> Float[Tensor, "n_layers head_index d_model qk_nope"]:
        return self._stack(lambda b: self._mla(b).effective_W_K_nope())

    @property
    def QK_nope(self) -> FactoredMatrix:
        """MLA's content scores q_nope . k_nope per head, W_Q_nope W_K_nope^T (up to the latents' 1/rms)."""
        return FactoredMatrix(self.W_Q_nope, self.W_K_nope.transpose(-2, -1))

    def _mla(self, block):
        if self.cfg.attention != "mla":
            raise NotImplementedError("W_Q_nope, W_K_nope and QK_nope are multi-head latent attention's (attention='mla'); "
                                 f"this model has attention={self.cfg.attention!r}: use W_Q, W_K and QK")
        return block.attn

    def _no_mla(self, name: str):
        # Not AttributeError: raised in a property, nn.Module's __getattr__ would replace its message
        raise NotImplementedError(
            f"{name} does not exist for multi-head latent attention (attention='mla'): a key is [k_nope, k_rope], "
            "where k_rope = RoPE(x W_KR) is rotated by its position (no fixed matrix gives it) and k_nope is read from "
            "the RMS-normed KV latent"
            + ("" if name != "W_Q" else ", and with query compression the query is read from a normed latent too")
            + ": use W_K_nope / W_Q_nope / QK_nope for the content (no-RoPE) part, or the raw W_DKV, kv_norm.w, W_UK, "
            "W_KR of blocks[l].attn")

    def tokens_to_residual_directions(self, tokens: Union[str, int, Tensor]) -> Tensor:
        """The unembedding direction(s) of tokens: [d_model], or [..., d_model] for a tensor."""
        if isinstance(tokens, str):
            tokens = self.to_single_token(tokens)
        if isinstance(tokens, int):
            return self.W_U[:, tokens]
        return self.W_U[:, tokens.to(self.device)].movedim(0, -1)

    def accumulated_bias(self, layer: int, mlp_input: bool = False, include_mlp_biases: bool = True) -> Tensor:
        """Sum of the output biases written to the residual stream before ``layer``."""
        total = torch.zeros(self.cfg.d_model, device=self.device)
        for i in range(layer):
            total = total + self.blocks[i].attn.b_O
            if include_mlp_biases and not self.cfg.attn_only and hasattr(self.blocks[i].mlp, "b_out"):
                total = total + self.blocks[i].mlp.b_out
        if mlp_input:
            if layer >= self.cfg.n_layers:
                raise ValueError(f"mlp_input=True needs layer < n_layers={self.cfg.n_layers}")
            total = total + self.blocks[layer].attn.b_O
        return total

    # ---- sparse dictionaries (workbench/analysis/splice.py) ---------------------------------
    # The dictionary does the splicing (``Dictionary.splice``): the model layer never imports analysis.
    def add_sae(self, sae: nn.Module, error_term: bool = False, hook: Optional[str] = None):
        """Splice a dictionary in at its hook; its features appear as ``{hook}.hook_sae_acts_post``."""
        if not callable(getattr(sae, "splice", None)):
            raise ValueError(f"add_sae needs a workbench dictionary (workbench.analysis.Dictionary), "
                             f"got {type(sae).__name__}")
        return sae.splice(self, error_term=error_term, hook=hook)

    def remove_sae(self, which: Union[str, nn.Module, None] = None) -> None:
        """Take a spliced dictionary out (by hook name or object; all of them when None)."""
        entries = list(getattr(self, "_sae_splices", {}).values())
        if entries:
            entries[0]["point"].sae.unsplice(self, which)
        elif which is not None:
            raise ValueError(f"no dictionary is spliced in at {which!r}; spliced: none")


# run_with_cache options that TransformerLens' own caching path handles (ours covers the rest)
_TL_CACHE_OPTIONS = {"device", "incl_bwd", "pos_slice", "reset_hooks_end", "clear_contexts"}


def _saver(cache: dict, name: str):
    def save(module: nn.Module, inputs: Any, output: Tensor) -> None:
        cache[name] = output.detach()
    return save


def _refuse_unguarded_hooks(model: HookedDecoder) -> None:
    """Run eagerly (outside any graph) on each call of a model under plain torch.compile."""
    from workbench.compiled import refuse_unguarded_hooks

    torch._dynamo.disable(refuse_unguarded_hooks)(model)


def _generators(
    seed: Optional[Union[int, Sequence[int]]], batch: int, device: torch.device
) -> Union[None, torch.Generator, list[torch.Generator]]:
    """One generator for the batch (an int seed), one per row (a sequence of seeds), or None."""
    if seed is None:
        return None
    if not isinstance(seed, (list, tuple, Tensor)):
        return torch.Generator(device=device).manual_seed(check_seed("seed", seed))
    seeds = [check_seed("seed", s) for s in (seed.tolist() if isinstance(seed, Tensor) else seed)]
    if len(seeds) != batch:
        raise ValueError(f"seed: one int, or one per row ({batch} rows), got {len(seeds)} seeds")
    return [torch.Generator(device=device).manual_seed(s) for s in seeds]


def _sample(
    logits: Float[Tensor, "batch d_vocab"],
    temperature: float,
    top_k: Optional[int],
    top_p: Optional[float],
    gen: Union[None, torch.Generator, list[torch.Generator]],
) -> Int[Tensor, " batch"]:
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= top_p  # keep the smallest prefix reaching top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    probs = logits.softmax(-1)
    if isinstance(gen, list):  # one generator per row: a row's draws do not depend on the others
        return torch.cat([torch.multinomial(probs[i : i + 1], 1, generator=g)[:, 0] for i, g in enumerate(gen)])
    return torch.multinomial(probs, 1, generator=gen)[:, 0]
