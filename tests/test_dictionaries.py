"""Sparse dictionaries: every kind recovers planted features; SAELens' on-disk schema both ways;
splicing with the error term changes nothing; the trainer's run folder, resume and NaN stop;
feature tables against brute force; the train-sae command; every bad input."""

import json
import math
import shutil
from pathlib import Path

import pandas as pd
import pytest
import torch
from factories import run_torchrun, tiny
from safetensors.torch import load_file, save_file

import workbench as wb
from workbench import analysis as an
from workbench import viz
from workbench.analysis.dictionaries import (
    DictionaryConfig,
    DictionaryError,
    load_dictionary,
    make_dictionary,
    save_dictionary,
    train_sae,
)
from workbench.analysis.dictionaries.registry import PER_LAYER
from workbench.analysis.dictionaries import select
from workbench.analysis.dictionaries.topk import chunked_topk
from workbench.analysis.store import ActivationStore, StoreError, TensorActivations
from workbench.data import get_task
from workbench.training import TrainingDiverged

ROOT = Path(__file__).resolve().parents[1]
TRANSCODERS = ("transcoder", "skip_transcoder")
SAE_HOOK = "blocks.0.hook_resid_post"
TC_IN, TC_OUT = "blocks.1.ln2.hook_normalized", "blocks.1.hook_mlp_out"


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return wb.HookedDecoder(tiny(d_vocab=40)).eval()


def random_dictionary(kind, d_in=32, d_sae=64, hook=SAE_HOOK, seed=0, k=None, **cfg):
    tc = kind in TRANSCODERS
    config = DictionaryConfig(kind=kind, d_in=d_in, d_sae=d_sae, k=(0 if tc else 4) if k is None else k, hook_name=TC_IN if tc else hook,
                              hook_name_out=TC_OUT if tc else "", **cfg)
    sae = make_dictionary(config)
    sae.init_weights(torch.Generator().manual_seed(seed))
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed + 1)
        sae.b_enc.copy_(torch.randn(d_sae, generator=g) * 0.1)
        sae.b_dec.copy_(torch.randn(sae.cfg.d_out, generator=g) * 0.1)
        if hasattr(sae, "threshold"):
            sae.threshold.copy_(torch.rand(d_sae, generator=g) * 0.3)
        if hasattr(sae, "W_skip"):
            sae.W_skip.copy_(torch.randn(sae.W_skip.shape, generator=g) * 0.1)
    return sae


# ---- planted features ------------------------------------------------------------------------
def planted(kind, n=8192):
    """Sparse data made of known directions. SAEs: 24 features in 16 dimensions (superposition).
    Transcoders: signed features in, |magnitude| out along other directions (no linear map fits it),
    plus a dense linear part for the skip path."""
    g = torch.Generator().manual_seed(0)
    tc = kind in TRANSCODERS
    n_feat, d = (16, 16) if tc else (24, 16)
    F = torch.randn(n_feat, d, generator=g)
    F = torch.linalg.qr(F.T).Q.T if tc else F / F.norm(dim=1, keepdim=True)
    mags = (0.5 + torch.rand(n, n_feat, generator=g)) * (torch.rand(n, n_feat, generator=g) < 2 / n_feat)
    if tc:
        mags = mags * (torch.randint(0, 2, mags.shape, generator=g) * 2 - 1)
    data = {"x": mags @ F + 0.2}
    G = None
    if tc:
        G = torch.randn(n_feat, 12, generator=g)
        G = G / G.norm(dim=1, keepdim=True)
        data["y"] = mags.abs() @ G + (data["x"] @ (torch.randn(d, 12, generator=g) / 4) if kind == "skip_transcoder" else 0)
    return data, F, G


def best_cosine(W, F):
    return (F @ (W / W.norm(dim=1, keepdim=True)).T).max(1).values


@pytest.mark.parametrize("kind", PER_LAYER)
def test_each_kind_recovers_planted_features(kind):
    data, F, G = planted(kind)
    tc = kind in TRANSCODERS
    # k= given to a transcoder kind makes it TopK: these stay ReLU + L1 (TopK ones: test_topk_transcoder_...)
    sae = train_sae(TensorActivations(data, rows_per_shard=4096), kind=kind, d_sae=48, k=None if tc else 2,
                    steps=600 if tc else 400, batch_size=256, lr=1e-2, warmup_steps=10, progress=False, threads=1,
                    **(dict(hook="x", hook_out="y") if tc else {}))
    decoder = best_cosine(sae.W_dec.detach(), G if tc else F)
    assert (decoder > 0.9).float().mean() >= 0.8, decoder
    if tc:
        encoder = best_cosine(sae.W_enc.detach().T, F)
        assert (encoder > 0.9).float().mean() >= 0.5, encoder
    m = sae.metrics
    assert m["explained_variance"] > 0.8 and 0 < m["l0"] < 12
    if kind in ("topk", "batchtopk"):
        assert m["l0"] == pytest.approx(2, abs=0.3)


@pytest.mark.parametrize("kind", ["topk", "batchtopk"])
def test_sparse_training_path_equals_the_dense_one(kind):
    """TopK-style training decodes only the kept entries (embedding_bag); same values and gradients."""
    x = torch.randn(16, 32)
    results = []
    for sparse in (False, True):
        sae = random_dictionary(kind)
        pre = sae.pre_acts(x)
        if sparse:
            acts = sae.train_encode(pre)
            torch.testing.assert_close(acts.dense(64), sae.train_activate(pre))
            out = sae.train_decode(acts, x)
        else:
            out = sae.decode(sae.train_activate(pre), x)
        (out.pow(2).sum() + out.sum()).backward()
        results.append((out.detach(), {n: p.grad.clone() for n, p in sae.named_parameters()}))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-5)
    for name, grad in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], grad, rtol=1e-4, atol=1e-5, msg=name)


# ---- SAELens format ----------------------------------------------------------------------------
# SAELens 6.x SAEConfig.to_dict(): the base fields, "metadata", "architecture", plus each architecture's own.
SAELENS_BASE_KEYS = {"d_in", "d_sae", "dtype", "device", "apply_b_dec_to_input", "normalize_activations",
                     "reshape_activations", "metadata", "architecture"}
SAELENS_EXTRA_KEYS = {"standard": set(), "jumprelu": set(), "topk": {"k", "rescale_acts_by_decoder_norm"},
                      "transcoder": {"d_out"}, "skip_transcoder": {"d_out"}}
SAELENS_WEIGHTS = {"standard": {"W_enc", "b_enc", "W_dec", "b_dec"}, "topk": {"W_enc", "b_enc", "W_dec", "b_dec"},
                   "jumprelu": {"W_enc", "b_enc", "W_dec", "b_dec", "threshold"},
                   "transcoder": {"W_enc", "b_enc", "W_dec", "b_dec"},
                   "skip_transcoder": {"W_enc", "b_enc", "W_dec", "b_dec", "W_skip"}}


def saelens_reference(folder: Path, x: torch.Tensor) -> torch.Tensor:
    """SAELens' inference forward, written from its source, reading only cfg.json and the weights."""
    cfg = json.loads((folder / "cfg.json").read_text())
    w = load_file(str(folder / "sae_weights.safetensors"))
    arch = cfg["architecture"]
    W_enc, b_enc, W_dec, b_dec = w["W_enc"], w["b_enc"], w["W_dec"], w["b_dec"]
    sae_in = x - b_dec * cfg.get("apply_b_dec_to_input", True) if arch not in ("transcoder", "skip_transcoder") else x
    pre = sae_in @ W_enc + b_enc
    if arch == "topk":
        if cfg.get("rescale_acts_by_decoder_norm"):
            pre = pre * W_dec.norm(dim=-1)
        k = cfg["k"] if "k" in cfg else cfg["activation_fn_kwargs"]["k"]  # pre-6.0 files keep k there
        values, indices = pre.topk(k, dim=-1)
        acts = torch.zeros_like(pre).scatter(-1, indices, values.relu())
        if cfg.get("rescale_acts_by_decoder_norm"):
            acts = acts / W_dec.norm(dim=-1)
    elif arch == "jumprelu":
        acts = pre.relu() * (pre > w["threshold"].relu())
    else:
        acts = pre.relu()
    out = acts @ W_dec + b_dec
    if arch == "skip_transcoder":
        out = out + x @ w["W_skip"].T
    return out


@pytest.mark.parametrize("kind", PER_LAYER)
def test_saelens_schema_and_round_trip(kind, tmp_path):
    sae = random_dictionary(kind, model_name="tiny")
    sae.metrics = {"l0": 3.5}
    save_dictionary(sae, tmp_path / "d")
    cfg = json.loads((tmp_path / "d" / "cfg.json").read_text())
    arch = sae.architecture
    assert set(cfg) == SAELENS_BASE_KEYS | SAELENS_EXTRA_KEYS[arch]
    assert cfg["metadata"]["hook_name"] == sae.cfg.hook_name and cfg["metadata"]["model_name"] == "tiny"
    assert cfg["metadata"]["sae_lens_version"].startswith("6.")  # SAELens reads the 6.x layout
    assert cfg["apply_b_dec_to_input"] == (kind not in TRANSCODERS)
    weights = load_file(str(tmp_path / "d" / "sae_weights.safetensors"))
    assert set(weights) == SAELENS_WEIGHTS[arch]
    assert weights["W_enc"].shape == (32, 64) and weights["W_dec"].shape == (64, sae.cfg.d_out)
    x = torch.randn(20, 32)
    torch.testing.assert_close(sae(x), saelens_reference(tmp_path / "d", x), rtol=1e-5, atol=1e-5)
    back = load_dictionary(tmp_path / "d")
    assert type(back) is type(sae) and back.cfg.hook_name == sae.cfg.hook_name and back.metrics == {"l0": 3.5}
    torch.testing.assert_close(back(x), sae(x), rtol=0, atol=0)


def test_files_saelens_wrote_load_here(tmp_path):
    """A pre-6.0 flat config (hook_point, activation_fn_kwargs) and a 6.x topk trained with
    rescale_acts_by_decoder_norm, as SAELens writes them; a BatchTopK without our sidecar is a JumpReLU."""
    g = torch.Generator().manual_seed(0)
    w = {"W_enc": torch.randn(16, 40, generator=g), "b_enc": torch.randn(40, generator=g) * 0.1,
         "W_dec": torch.randn(40, 16, generator=g), "b_dec": torch.randn(16, generator=g)}
    old = tmp_path / "old"
    old.mkdir()
    save_file(w, str(old / "sae_weights.safetensors"))
    (old / "cfg.json").write_text(json.dumps({"architecture": "topk", "d_in": 16, "d_sae": 40, "dtype": "float32",
                                              "hook_point": "blocks.0.hook_resid_pre", "activation_fn_str": "topk",
                                              "activation_fn_kwargs": {"k": 5}, "model_name": "gpt2"}))
    sae = load_dictionary(old)
    assert sae.kind == "topk" and sae.cfg.k == 5 and sae.cfg.hook_name == "blocks.0.hook_resid_pre"
    x = torch.randn(8, 16, generator=g)
    torch.testing.assert_close(sae(x), saelens_reference(old, x), rtol=1e-5, atol=1e-5)

    new = tmp_path / "new"
    new.mkdir()
    save_file(w, str(new / "sae_weights.safetensors"))
    (new / "cfg.json").write_text(json.dumps({
        "d_in": 16, "d_sae": 40, "dtype": "float32", "device": "cpu", "apply_b_dec_to_input": True,
        "normalize_activations": "none", "reshape_activations": "none", "architecture": "topk", "k": 5,
        "rescale_acts_by_decoder_norm": True,
        "metadata": {"sae_lens_version": "6.12.0", "hook_name": "blocks.0.hook_resid_pre", "model_name": "gpt2"}}))
    sae = load_dictionary(new)
    torch.testing.assert_close(sae(x), saelens_reference(new, x), rtol=1e-4, atol=1e-4)

    btk = random_dictionary("batchtopk")
    save_dictionary(btk, tmp_path / "btk")
    assert load_dictionary(tmp_path / "btk").kind == "batchtopk"
    (tmp_path / "btk" / "sae_meta.json").unlink()
    as_jumprelu = load_dictionary(tmp_path / "btk")
    assert as_jumprelu.kind == "jumprelu"
    x = torch.randn(8, 32)
    torch.testing.assert_close(as_jumprelu(x), btk(x))


def topk_transcoder(kind, k=5):
    sae = random_dictionary(kind, d_in=32, d_sae=40, k=k)
    assert sae.cfg.k == k
    return sae


@pytest.mark.parametrize("kind", TRANSCODERS)
def test_a_topk_transcoder_is_not_written_as_saelens_relu_transcoder(kind, tmp_path):
    """SAE Lens 6.x has no TopK transcoder: a cfg.json that said "transcoder" loaded there as ReLU. Ours
    names "topk_transcoder" / "topk_skip_transcoder" with k in cfg.json (what SAE Lens' topk does), warns,
    and loads as the same TopK from cfg.json alone; a file written before (k only in sae_meta.json) warns."""
    sae = topk_transcoder(kind)
    with pytest.warns(UserWarning, match="SAE Lens 6.x has no TopK transcoder class"):
        save_dictionary(sae, tmp_path / "d")
    cfg = json.loads((tmp_path / "d" / "cfg.json").read_text())
    assert cfg["architecture"] == f"topk_{kind}" and cfg["k"] == 5 and cfg["d_out"] == 32
    (tmp_path / "d" / "sae_meta.json").unlink()  # what SAE Lens sees: cfg.json and the weights
    back = load_dictionary(tmp_path / "d")
    x = torch.randn(20, 32)
    values, indices = sae.pre_acts(x).topk(5, dim=-1)
    assert type(back) is type(sae) and back.cfg.k == 5
    torch.testing.assert_close(back.encode(x), torch.zeros(20, 40).scatter(-1, indices, values.relu()))
    torch.testing.assert_close(back(x), sae(x), rtol=0, atol=0)

    shutil.copytree(tmp_path / "d", tmp_path / "old")  # as written before: "transcoder", k in sae_meta.json only
    del cfg["k"]
    cfg["architecture"] = kind
    (tmp_path / "old" / "cfg.json").write_text(json.dumps(cfg))
    (tmp_path / "old" / "sae_meta.json").write_text(json.dumps({"format": "workbench-dictionary", "version": 1,
                                                                 "config": sae.cfg.to_dict()}))
    with pytest.warns(UserWarning, match=f"says '{kind}' \\(k=5 from sae_meta.json"):
        old = load_dictionary(tmp_path / "old")
    torch.testing.assert_close(old(x), sae(x), rtol=0, atol=0)
    del cfg["architecture"]
    (tmp_path / "old" / "cfg.json").write_text(json.dumps({**cfg, "architecture": f"topk_{kind}"}))
    with pytest.raises(DictionaryError, match="has no integer 'k'"):
        load_dictionary(tmp_path / "old")


def register_saelens_topk_transcoders(sae_lens):
    """The classes docs/reference/dictionaries.md shows: SAE Lens' transcoders with its TopK activation."""
    from dataclasses import dataclass

    from sae_lens.registry import SAE_CLASS_REGISTRY
    from sae_lens.saes.topk_sae import TopK
    from sae_lens.saes.transcoder import SkipTranscoder, SkipTranscoderConfig, Transcoder, TranscoderConfig

    @dataclass
    class TopKTranscoderConfig(TranscoderConfig):
        k: int = 100

        @classmethod
        def architecture(cls) -> str:
            return "topk_transcoder"

    class TopKTranscoder(Transcoder):
        def get_activation_fn(self):
            return TopK(self.cfg.k)

    @dataclass
    class TopKSkipTranscoderConfig(SkipTranscoderConfig):
        k: int = 100

        @classmethod
        def architecture(cls) -> str:
            return "topk_skip_transcoder"

    class TopKSkipTranscoder(SkipTranscoder):
        def get_activation_fn(self):
            return TopK(self.cfg.k)

    for name, classes in {"topk_transcoder": (TopKTranscoder, TopKTranscoderConfig),
                          "topk_skip_transcoder": (TopKSkipTranscoder, TopKSkipTranscoderConfig)}.items():
        if name not in SAE_CLASS_REGISTRY:
            sae_lens.register_sae_class(name, *classes)


@pytest.mark.filterwarnings("ignore:saving a TopK transcoder")
def test_saelens_itself_refuses_our_topk_transcoders_and_loads_them_with_a_registered_class(tmp_path):
    """With SAE Lens importable: it refuses our TopK transcoder files (it read them as ReLU before, outputs
    off by more than 1), and loads them, equal to ours to 1e-6, once TopK transcoder classes are registered."""
    from workbench.analysis import synth_bench

    sae_lens, why = synth_bench.import_sae_lens()
    if sae_lens is None:
        pytest.skip(f"needs sae_lens importable (it cannot share this venv: it pins transformer-lens < 4): {why}")
    from sae_lens.registry import SAE_CLASS_REGISTRY

    saes = {kind: topk_transcoder(kind) for kind in TRANSCODERS}
    for kind, sae in saes.items():
        save_dictionary(sae, tmp_path / kind)
        if f"topk_{kind}" not in SAE_CLASS_REGISTRY:
            with pytest.raises(KeyError, match=f"topk_{kind}"):
                sae_lens.SAE.load_from_disk(str(tmp_path / kind))
    register_saelens_topk_transcoders(sae_lens)
    x = torch.randn(50, 32)
    for kind, sae in saes.items():
        theirs = sae_lens.SAE.load_from_disk(str(tmp_path / kind))
        assert type(theirs).__name__ == {"transcoder": "TopKTranscoder", "skip_transcoder": "TopKSkipTranscoder"}[kind]
        with torch.no_grad():
            torch.testing.assert_close(theirs.encode(x), sae.encode(x), rtol=0, atol=1e-6)
            torch.testing.assert_close(theirs(x), sae(x), rtol=0, atol=1e-6)
            assert ((theirs.encode(x) > 0).sum(-1) <= 5).all()


def test_unsupported_and_corrupt_dictionary_files(tmp_path):
    sae = random_dictionary("relu")
    save_dictionary(sae, tmp_path / "d")
    cfg_path = tmp_path / "d" / "cfg.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**cfg, "architecture": "gated"}))
    with pytest.raises(DictionaryError, match="'gated' is not supported"):
        load_dictionary(tmp_path / "d")
    cfg_path.write_text(json.dumps({**cfg, "normalize_activations": "expected_average_only_in"}))
    with pytest.raises(DictionaryError, match="normalize_activations"):
        load_dictionary(tmp_path / "d")
    cfg_path.write_text(json.dumps({**cfg, "d_sae": 65}))
    with pytest.raises(DictionaryError, match="W_enc has shape"):
        load_dictionary(tmp_path / "d")
    cfg_path.write_text(json.dumps(cfg))
    (tmp_path / "d" / "sae_weights.safetensors").write_bytes(b"garbage")
    with pytest.raises(DictionaryError, match="corrupt"):
        load_dictionary(tmp_path / "d")
    with pytest.raises(DictionaryError, match="not a dictionary folder"):
        load_dictionary(tmp_path)
    with pytest.raises(ValueError, match="unknown dictionary kind"):
        make_dictionary(DictionaryConfig(kind="gated", d_in=4, d_sae=8))
    with pytest.raises(ValueError, match="integer k"):
        make_dictionary(DictionaryConfig(kind="topk", d_in=4, d_sae=8, k=2.5))


# ---- splicing ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind,hook", [(k, SAE_HOOK) for k in PER_LAYER] + [("topk", "blocks.1.attn.hook_z")])
def test_splice_with_error_term_changes_nothing(model, kind, hook):
    tokens = torch.randint(0, 40, (3, 12))
    clean = model(tokens)
    sae = random_dictionary(kind, hook=hook)
    model.add_sae(sae, error_term=True)
    try:
        logits, cache = model.run_with_cache(tokens)
        assert (logits - clean).abs().max() <= 1e-5
        at = sae.cfg.hook_name_out or sae.cfg.hook_name
        for name in ("hook_sae_input", "hook_sae_acts_pre", "hook_sae_acts_post", "hook_sae_recons", "hook_sae_error"):
            assert f"{at}.{name}" in cache
        acts = cache[f"{at}.hook_sae_acts_post"]
        assert acts.shape == (3, 12, 64)
        raw = cache[f"{at}.hook_sae_input"]
        torch.testing.assert_close(acts, sae.encode(raw))
        # The spliced value is recons + error, and the hook itself still caches under its own name.
        torch.testing.assert_close(cache[at].flatten(2), cache[f"{at}.hook_sae_recons"] + cache[f"{at}.hook_sae_error"])
        without = model.remove_sae() or None
        assert without is None
        model.add_sae(sae, error_term=False)
        assert (model(tokens) - clean).abs().max() > 1e-3  # the reconstruction alone is not the model
    finally:
        model.remove_sae()
    assert not any("hook_sae" in name for name in model.hook_dict)
    torch.testing.assert_close(model(tokens), clean, rtol=0, atol=0)


@pytest.mark.parametrize("n,k", [(1024, 32), (64, 4), (100, 3), (24, 5), (16, 16)])
def test_chunked_topk_finds_what_torch_topk_finds(n, k):
    pre = torch.randn(7, 5, n, generator=torch.Generator().manual_seed(n + k))
    pre[0, 0] = pre[0, 0].abs().max() * 2 - torch.arange(n) / n  # the largest values in the first chunks
    pre[0, 1] = -pre[0, 1].abs() + 5 * (torch.arange(n) >= n - k)  # ... and all in the last one
    values, indices = chunked_topk(pre, k)
    want_values, want_indices = pre.topk(k, dim=-1, sorted=False)
    assert torch.equal(indices.sort(-1).values, want_indices.sort(-1).values)
    assert torch.equal(values.sort(-1).values, want_values.sort(-1).values)
    assert torch.equal(pre.gather(-1, indices), values)
    ties = torch.zeros(3, n)  # every value tied: any k of them, each once
    values, indices = chunked_topk(ties, k)
    assert torch.equal(values, torch.zeros(3, k)) and all(len(set(row.tolist())) == k for row in indices)


@pytest.mark.parametrize("n,k", [(1024, 32), (64, 4), (100, 3), (24, 5), (16, 16), (7, 1)])
@pytest.mark.parametrize("threads", [1, 2])  # 1: the C kernel; 2: torch ops (chunked_topk)
def test_row_topk_finds_what_torch_topk_finds(n, k, threads):
    if threads == 1 and (shutil.which("cc") or shutil.which("gcc")):
        assert select._load() is not None, "a C compiler is here, but the kernel did not build"
    pre = torch.randn(7, 5, n, generator=torch.Generator().manual_seed(n + k))
    pre[0, 0] = pre[0, 0].abs().max() * 2 - torch.arange(n) / n  # the largest values in the first chunk
    pre[0, 1] = -pre[0, 1].abs() + 5 * (torch.arange(n) >= n - k)  # ... and all in the last one
    pre[0, 2] = -torch.arange(n, dtype=torch.float32) - 100  # every value negative, sorted
    pre[0, 3, n // 2] = float("nan")  # NaN ranks above every number, as in torch.topk
    pre[0, 4, :2] = float("-inf")
    pre[1, 0, -1] = float("inf")
    was = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        values, indices = select.row_topk(pre, k)
        values_t, indices_t = select.row_topk(pre.transpose(0, 1), k)  # not contiguous
        ties = torch.zeros(3, n)  # every value tied: any k of them, each once
        tie_values, tie_indices = select.row_topk(ties, k)
    finally:
        torch.set_num_threads(was)
    want_values, want_indices = pre.topk(k, dim=-1, sorted=False)
    assert torch.equal(indices.sort(-1).values, want_indices.sort(-1).values)
    assert torch.equal(values.sort(-1).values, want_values.sort(-1).values, ) or bool(pre.isnan().any())
    assert torch.equal(pre.gather(-1, indices).nan_to_num(), values.nan_to_num())
    assert torch.equal(indices_t, indices.transpose(0, 1))
    assert torch.equal(tie_values, torch.zeros(3, k)) and all(len(set(row.tolist())) == k for row in tie_indices)
    # gradients flow to the selected entries, as through torch.topk
    x = torch.randn(4, n, requires_grad=True, generator=torch.Generator().manual_seed(1))
    select.row_topk(x, k)[0].sum().backward()
    assert torch.equal(x.grad, torch.zeros(4, n).scatter(-1, x.topk(k, dim=-1).indices, 1.0))


def test_row_topk_runs_inside_a_compiled_graph():
    import jaxtyping

    pre = torch.randn(6, 200, generator=torch.Generator().manual_seed(2))
    was = jaxtyping.config.jaxtyping_disable
    jaxtyping.config.update("jaxtyping_disable", True)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(lambda x: select.row_topk(x * 2.0, 8), backend="aot_eager", fullgraph=True)
        values, indices = compiled(pre)
    finally:
        torch._dynamo.reset()
        jaxtyping.config.update("jaxtyping_disable", was)
    assert torch.equal(indices.sort(-1).values, (pre * 2).topk(8, dim=-1).indices.sort(-1).values)
    assert torch.equal(values, (pre * 2).gather(-1, indices))


@pytest.mark.parametrize("kind", ["topk", *TRANSCODERS])
def test_unhooked_splice_decodes_topk_features_sparsely(model, kind):
    """Under no_grad with no hook on the splice, a TopK dictionary sums its k decoder rows: the same
    logits as the dense path (forced by an identity hook on the features) and as the dictionary's own
    forward put in by a plain hook on the unspliced model."""
    tc = kind in TRANSCODERS
    sae = make_dictionary(DictionaryConfig(kind=kind, d_in=32, d_sae=64, k=4, hook_name=TC_IN if tc else SAE_HOOK,
                                           hook_name_out=TC_OUT if tc else ""))
    sae.init_weights(torch.Generator().manual_seed(3))
    with torch.no_grad():
        g = torch.Generator().manual_seed(4)
        sae.b_enc.copy_(torch.randn(64, generator=g) * 0.1)
        sae.b_dec.copy_(torch.randn(32, generator=g) * 0.1)
        if hasattr(sae, "W_skip"):
            sae.W_skip.copy_(torch.randn(sae.W_skip.shape, generator=g) * 0.1)
    tokens = torch.randint(0, 40, (3, 12), generator=torch.Generator().manual_seed(5))
    out_hook = sae.cfg.hook_name_out or sae.cfg.hook_name
    calls = []
    sparse = sae.decode_sparse
    sae.decode_sparse = lambda *args: calls.append(1) or sparse(*args)
    with torch.no_grad():
        seen = model.run_with_cache(tokens, names_filter=sae.cfg.hook_name)[1][sae.cfg.hook_name]
        by_hand = model.run_with_hooks(tokens, fwd_hooks=[(out_hook, lambda act, hook: sae(seen).view(act.shape))])
        plain = model(tokens)
        for error_term in (False, True):
            encoded = []
            pre_acts = sae.pre_acts
            sae.pre_acts = lambda x: encoded.append(1) or pre_acts(x)
            with an.spliced(model, sae, error_term=error_term):
                fast = model(tokens)
                # with the error term and nothing reading the dictionary, recons + (x - recons) is x itself:
                # the dictionary does not run at all
                assert (len(calls), len(encoded)) == ((0, 0) if error_term else (1, 1))
                if error_term:  # (a transcoder's input tap makes its norm take the hooked path: rounding)
                    torch.testing.assert_close(fast, plain, rtol=0, atol=1e-6)
                dense = model.run_with_hooks(tokens, fwd_hooks=[(f"{out_hook}.hook_sae_acts_post", lambda a, hook: a)])
                assert len(calls) == (0 if error_term else 1)  # a hook on the features takes the dense path
                assert len(encoded) == 2  # and it runs (with the error term, twice: edited, and clean)
            del sae.pre_acts
            calls.clear()
            torch.testing.assert_close(fast, dense, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(fast, by_hand if not error_term else model(tokens), rtol=1e-5, atol=1e-5)
    values, indices = sae.sparse_activate(sae.pre_acts(seen))
    assert values.shape == indices.shape == (3, 12, 4)
    torch.testing.assert_close(sae.decode_sparse(values, indices, seen), sae(seen), rtol=1e-5, atol=1e-5)


def test_spliced_gradients_and_feature_edits(model):
    tokens = torch.randint(0, 40, (2, 10))
    sae = random_dictionary("topk")

    def param_grads():
        model.zero_grad()
        model(tokens, return_type="loss").backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    clean = param_grads()
    keys_before = set(model.state_dict())
    with an.spliced(model, sae, error_term=True):
        spliced = param_grads()
        assert set(model.state_dict()) == keys_before  # the dictionary is not part of the model
        # Zeroing feature f at every position moves the hook's value by exactly -act_f * W_dec[f].
        _, cache = model.run_with_cache(tokens)
        acts = cache[f"{SAE_HOOK}.hook_sae_acts_post"]
        f = int(acts.flatten(0, 1).sum(0).argmax())

        def ablate(value, hook):
            value = value.clone()
            value[..., f] = 0
            return value

        edited = {}

        def grab(value, hook):
            edited["value"] = value

        model.run_with_hooks(tokens, fwd_hooks=[(f"{SAE_HOOK}.hook_sae_acts_post", ablate), (SAE_HOOK, grab)])
        expected = cache[SAE_HOOK] - acts[..., f, None] * sae.W_dec[f]
        torch.testing.assert_close(edited["value"], expected, rtol=1e-5, atol=1e-5)
    for name, grad in clean.items():
        torch.testing.assert_close(spliced[name], grad, rtol=1e-4, atol=1e-5, msg=name)
    model.zero_grad()
    assert not model._sae_splices


def test_spliced_generation_with_kv_cache_matches_recompute(model):
    sae = random_dictionary("batchtopk")
    with an.spliced(model, sae, error_term=False):
        prompt = torch.randint(0, 40, (2, 5))
        fast = model.generate(prompt, max_new_tokens=6, use_kv_cache=True)
        slow = model.generate(prompt, max_new_tokens=6, use_kv_cache=False)
    torch.testing.assert_close(fast, slow)


def test_splice_bad_input(model):
    with pytest.raises(ValueError, match="d_in=16 does not match blocks.0.hook_resid_post"):
        model.add_sae(random_dictionary("topk", d_in=16))
    with pytest.raises(ValueError, match="did you mean 'blocks.0.hook_resid_post'"):
        model.add_sae(random_dictionary("topk", hook="blocks.0.hook_resid_postt"))
    sae = random_dictionary("relu")
    model.add_sae(sae)
    try:
        with pytest.raises(ValueError, match="already spliced"):
            model.add_sae(random_dictionary("relu"))
    finally:
        model.remove_sae()
    with pytest.raises(ValueError, match="no dictionary is spliced"):
        model.remove_sae(SAE_HOOK)
    with pytest.raises(RuntimeError):
        with an.spliced(model, sae):
            raise RuntimeError("boom")
    assert not an.spliced_saes(model)


# ---- the trainer ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def store(model, tmp_path_factory):
    out = tmp_path_factory.mktemp("acts") / "s"
    return ActivationStore.collect(model, get_task("induction", vocab=32), [SAE_HOOK, TC_IN, TC_OUT], 3000, out,
                                   batch_size=8, tokens_per_shard=1000, progress=False)


def test_a_run_folder_another_run_is_writing_is_refused_and_left_alone(store, tmp_path):
    from workbench.checkpoint import locked

    kw = dict(kind="topk", d_sae=16, k=2, hook=SAE_HOOK, batch_size=64, progress=False, eval_sequences=0)
    out = tmp_path / "run"
    train_sae(store, steps=4, out=out, save_every=2, **kw)  # a run to continue
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with locked(out, timeout=0.0):  # what a run writing into out holds (another process's alike)
        with pytest.raises(ValueError, match="in use"):
            train_sae(store, steps=8, out=out, resume=True, **kw)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # nothing written or deleted
    assert train_sae(store, steps=8, out=out, resume=True, **kw) is not None  # free again: it continues


def test_run_folder_resume_and_metrics(model, store, tmp_path):
    kw = dict(kind="topk", d_sae=64, k=4, hook=SAE_HOOK, batch_size=128, log_every=5, progress=False, lr=3e-3,
              warmup_steps=2, eval_sequences=8)
    full = train_sae(store, steps=20, out=tmp_path / "full", model=model, **kw)
    assert {p.name for p in (tmp_path / "full").iterdir()} == {
        "cfg.json", "sae_weights.safetensors", "sae_meta.json", "metrics.csv", "train_state.safetensors",
        "train_state.json"}
    history = pd.read_csv(tmp_path / "full" / "metrics.csv")
    assert list(history.columns) == ["step", "loss", "mse", "sparsity_loss", "aux_loss", "l0", "explained_variance",
                                     "dead_fraction", "lr", "tokens_per_s"]
    assert history["step"].tolist() == [5, 10, 15, 20] and (history["l0"] == 4).all()
    m = full.metrics
    for key in ("l0", "explained_variance", "dead_fraction", "dense_fraction", "ce_loss_clean", "ce_loss_spliced",
                "ce_loss_zero_ablated", "ce_loss_recovered"):
        assert key in m and math.isfinite(m[key]), key
    assert m["held_out"] == "last shard"
    assert len(json.loads((tmp_path / "full" / "sae_meta.json").read_text())["feature_density"]) == 64

    def stop_at_10(row):
        return row["step"] == 10

    train_sae(store, steps=20, out=tmp_path / "half", callback=stop_at_10, **kw)
    resumed = train_sae(store, steps=20, out=tmp_path / "half", resume=True, **kw)
    for name, p in full.named_parameters():
        torch.testing.assert_close(dict(resumed.named_parameters())[name], p, rtol=1e-5, atol=1e-6, msg=name)
    assert pd.read_csv(tmp_path / "half" / "metrics.csv")["step"].tolist() == [5, 10, 15, 20]
    # The saved dictionary takes raw activations: its metrics on the store match the returned one's.
    loaded = load_dictionary(tmp_path / "full")
    again, _ = an.dictionaries.reconstruction_metrics(loaded, store.subset([store.n_shards - 1]))
    assert again["explained_variance"] == pytest.approx(m["explained_variance"], rel=1e-5)


def test_transcoder_trains_on_a_store_and_splices(model, store):
    tc = train_sae(store, kind="skip_transcoder", d_sae=32, hook=TC_IN, hook_out=TC_OUT, steps=10, batch_size=128,
                   progress=False, model=model, eval_sequences=8)
    assert tc.cfg.d_out == 32 and math.isfinite(tc.metrics["ce_loss_recovered"])
    tokens = torch.randint(0, 40, (2, 8))
    clean = model(tokens)
    with an.spliced(model, tc, error_term=True):
        assert (model(tokens) - clean).abs().max() <= 1e-5


@pytest.mark.parametrize("kind", TRANSCODERS)
def test_topk_transcoder_trains_through_train_sae_saves_and_splices(model, store, tmp_path, kind):
    """k= given for a transcoder kind trains a TopK one: k features per token (torch.topk of the
    pre-activations as the reference), no L1, the same after saving, and the model with error terms."""
    k = 5
    tc = train_sae(store, kind=kind, d_sae=32, k=k, hook=TC_IN, hook_out=TC_OUT, steps=20, batch_size=128, lr=1e-2,
                   progress=False, eval_sequences=0, log_every=5, out=tmp_path / "tc")
    assert tc.cfg.k == k and (tc.history["sparsity_loss"] == 0).all()
    tokens = torch.randint(0, 40, (3, 8))
    _, cache = model.run_with_cache(tokens, names_filter=[TC_IN, TC_OUT])
    x = cache[TC_IN].detach()
    acts = tc.encode(x)
    assert ((acts > 0).sum(-1) == k).all()  # L0 == k per token
    values, indices = tc.pre_acts(x).topk(k, dim=-1)
    torch.testing.assert_close(acts, torch.zeros_like(acts).scatter(-1, indices, values.relu()))
    pre = tc.pre_acts(x.flatten(0, 1))  # training decodes the kept entries (and the skip path): the same map
    torch.testing.assert_close(tc.train_decode(tc.train_encode(pre), x.flatten(0, 1)), tc(x.flatten(0, 1)),
                               atol=1e-5, rtol=1e-5)
    m, _ = an.dictionaries.reconstruction_metrics(tc, store.subset([store.n_shards - 1]))
    assert m["l0"] == pytest.approx(k)
    loaded = load_dictionary(tmp_path / "tc")
    assert type(loaded) is type(tc) and loaded.cfg.k == k
    assert json.loads((tmp_path / "tc" / "cfg.json").read_text())["architecture"] == f"topk_{kind}"  # SAE Lens has no TopK transcoder
    torch.testing.assert_close(loaded.encode(x), acts)
    clean = model(tokens)
    with an.spliced(model, loaded, error_term=True):
        assert (model(tokens) - clean).abs().max() <= 1e-5
    with an.spliced(model, loaded):  # without: the transcoder's output replaces the MLP's
        spliced = model(tokens)
    mlp_in = model.run_with_cache(tokens, names_filter=[TC_IN])[1][TC_IN]
    assert (spliced - clean).abs().max() > 1e-4 and mlp_in.shape == x.shape
    with pytest.raises(ValueError, match="integer k in \\[1, d_sae=32\\]"):
        train_sae(store, kind=kind, d_sae=32, k=40, hook=TC_IN, hook_out=TC_OUT, steps=2, progress=False)


def test_trainer_bad_input(model, store, tmp_path):
    other = wb.HookedDecoder(tiny(d_vocab=40, seed=3))
    with pytest.raises(StoreError, match="not from this model"):
        train_sae(store, hook=SAE_HOOK, steps=2, model=other, progress=False)
    with pytest.raises(ValueError, match="say which"):
        train_sae(store, steps=2, progress=False)
    with pytest.raises(ValueError, match="no hook 'blocks.0.hook_resid_pots'"):
        train_sae(store, hook="blocks.0.hook_resid_pots", steps=2, progress=False)
    with pytest.raises(ValueError, match="needs hook= .* and hook_out="):
        train_sae(store, kind="transcoder", hook=TC_IN, steps=2, progress=False)
    with pytest.raises(ValueError, match="k=100 must lie in"):
        train_sae(store, hook=SAE_HOOK, d_sae=64, k=100, steps=2, progress=False)
    with pytest.raises(ValueError, match="unknown SAETrainConfig"):
        train_sae(store, hook=SAE_HOOK, stepz=2)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="not a dictionary run"):
        train_sae(store, hook=SAE_HOOK, steps=2, out=tmp_path / "mine", progress=False)
    with pytest.raises(ValueError, match="nothing to resume"):
        train_sae(store, hook=SAE_HOOK, steps=2, out=tmp_path / "new", resume=True, progress=False)


def test_divergence_stops_before_the_step_and_keeps_the_last_save(tmp_path):
    data = {"x": torch.randn(1024, 8)}
    with pytest.raises(TrainingDiverged, match="not finite.*last saved state"):
        train_sae(TensorActivations(data, rows_per_shard=512), d_sae=16, k=2, steps=50, batch_size=64, lr=1e12,
                  warmup_steps=0, out=tmp_path / "run", save_every=1, progress=False)
    saved = load_dictionary(tmp_path / "run")
    assert all(torch.isfinite(p).all() for p in saved.parameters())
    state = json.loads((tmp_path / "run" / "train_state.json").read_text())
    assert state["step"] >= 1


# ---- features ---------------------------------------------------------------------------------------
def test_feature_tables_match_brute_force(model):
    sae = random_dictionary("relu", d_sae=24)
    tokens = torch.randint(0, 40, (6, 12))
    with an.spliced(model, sae, error_term=True):
        _, cache = model.run_with_cache(tokens)
    acts = cache[f"{SAE_HOOK}.hook_sae_acts_post"]
    torch.testing.assert_close(an.feature_activations(model, sae, tokens), acts)
    kept = acts.clone()
    kept[:, 0] = 0
    f = int(kept.flatten(0, 1).max(0).values.argmax())
    contexts = an.max_activating_contexts(model, sae, tokens, f, k=3)
    values, index = kept[..., f].flatten().topk(3)
    assert contexts["activation"].tolist() == pytest.approx(values.tolist())
    assert [divmod(int(i), 12) for i in index] == list(zip(contexts["sequence"], contexts["position"]))
    table = an.feature_table(model, sae, tokens)
    assert len(table) == 24 and table.loc[f, "max_activation"] == pytest.approx(float(values[0]))
    assert table["density"].tolist() == pytest.approx((kept[:, 1:] > 0).float().mean((0, 1)).tolist())
    hist = an.feature_histogram(model, sae, tokens, f, bins=5)
    assert hist["count"].sum() == int((kept[:, 1:, f] > 0).sum())
    effects = an.feature_logit_effects(model, sae, f, k=3)
    assert model.cfg.norm == "layernorm"  # the final norm centres, then scales by its weight
    direction = (sae.W_dec[f] - sae.W_dec[f].mean()) * model.ln_final.w
    manual = direction @ model.W_U
    assert effects[effects.direction == "top"]["effect"].tolist() == pytest.approx(manual.topk(3).values.tolist(), abs=1e-5)
    for fig in (viz.feature_contexts_figure(contexts), viz.feature_histogram_figure(hist),
                viz.feature_logits_figure(effects), viz.feature_density_figure(table)):
        assert fig.data
    with pytest.raises(ValueError, match="feature=99 out of range"):
        an.feature_logit_effects(model, sae, 99)


def test_feature_dla_parts_sum_to_the_logit_difference():
    """With no final norm and the dictionary on the last residual stream, features + b_dec + error
    make the whole logit difference."""
    model = wb.HookedDecoder(tiny(d_vocab=40, norm="none")).eval()
    hook = "blocks.1.hook_resid_post"
    sae = random_dictionary("topk", hook=hook)
    tokens = torch.randint(0, 40, (4, 9))
    answer, wrong = torch.tensor([1, 2, 3, 4]), torch.tensor([5, 6, 7, 8])
    dla = an.feature_dla(model, sae, tokens, answer, wrong)
    logits = model(tokens)[:, -1]
    total = logits[torch.arange(4), answer] - logits[torch.arange(4), wrong]
    delta = (model.W_U[:, answer] - model.W_U[:, wrong]).T
    with an.spliced(model, sae, error_term=True):
        _, cache = model.run_with_cache(tokens)
    rest = ((cache[f"{hook}.hook_sae_error"][:, -1] + sae.b_dec) * delta).sum(-1) + model.b_U[answer] - model.b_U[wrong]
    by_batch = dla.groupby("batch")["dla"].sum().reindex(range(4), fill_value=0.0)
    torch.testing.assert_close(torch.tensor(by_batch.to_numpy(), dtype=torch.float32) + rest, total, rtol=1e-4, atol=1e-4)


# ---- the command line ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(model, tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    task = get_task("induction", vocab=32)
    wb.save_checkpoint(model, path, meta={"task": "induction", "task_options": task.options()})
    return path


def test_train_sae_command(checkpoint, tmp_path, capsys):
    from workbench.__main__ import main

    args = [str(checkpoint), "--hook", SAE_HOOK, "--d-sae", "32", "--k", "4", "--steps", "6", "--batch-size", "64",
            "--tokens", "600", "--store", str(tmp_path / "acts"), "--out", str(tmp_path / "sae"), "--no-progress",
            "--eval-sequences", "4", "--collect-batch-size", "8"]
    assert main(["train-sae", *args]) == 0
    out = capsys.readouterr().out
    assert "ce_loss_recovered" in out and (tmp_path / "sae" / "cfg.json").exists()
    assert load_dictionary(tmp_path / "sae").cfg.hook_name == SAE_HOOK
    assert main(["train-sae", str(checkpoint), "--hook", "blocks.0.hook_resid_pots", "--tokens", "10",
                 "--store", str(tmp_path / "b"), "--no-progress"]) == 2
    assert "did you mean 'blocks.0.hook_resid_post'" in capsys.readouterr().err


def test_ddp_two_processes_match_one_process(checkpoint, model, tmp_path):
    store = ActivationStore.collect(model, get_task("induction", vocab=32), SAE_HOOK, 1200, tmp_path / "acts",
                                    batch_size=8, tokens_per_shard=600, progress=False)
    args = ["train-sae", str(checkpoint), "--hook", SAE_HOOK, "--d-sae", "32", "--k", "4", "--steps", "4",
            "--batch-size", "64", "--lr", "3e-3", "--warmup-steps", "1", "--log-every", "1", "--threads", "1",
            "--store", str(tmp_path / "acts"), "--tokens", "1200", "--eval-sequences", "0", "--no-progress"]
    run_torchrun([*args, "--out", str(tmp_path / "ddp")])
    single = train_sae(store, hook=SAE_HOOK, d_sae=32, k=4, steps=4, batch_size=64, lr=3e-3, warmup_steps=1,
                       log_every=1, progress=False)
    ddp = load_dictionary(tmp_path / "ddp")
    for name, p in single.named_parameters():
        torch.testing.assert_close(dict(ddp.named_parameters())[name], p, rtol=1e-4, atol=1e-5, msg=name)


def test_a_cfg_json_width_the_weights_do_not_have_is_refused_before_anything_is_built(tmp_path):
    import json
    import shutil

    from workbench.analysis.dictionaries import DictionaryError, load_dictionary

    src = Path(__file__).resolve().parents[1] / "checkpoints" / "stories-2026" / "saes" / "resid-post-1"
    for width in (2**63, 7):  # once an overflow inside torch; a plain mismatch
        folder = tmp_path / f"w{width}"
        shutil.copytree(src, folder)
        cfg = json.loads((folder / "cfg.json").read_text())
        cfg["d_in"] = width
        (folder / "cfg.json").write_text(json.dumps(cfg))
        with pytest.raises(DictionaryError, match="W_enc has shape"):
            load_dictionary(folder)


def test_saelens_prepend_bos_is_the_models_own(tmp_path):
    """SAE Lens' ``metadata.prepend_bos`` says whether the training text began with a BOS. It was always
    True; it is now what the model's tokenizer does, compared with its own ``encode``: a tokenizer that
    declares a BOS but does not add it (SmolLM2's GGUF) gives False, one whose post-processor adds it
    (Llama's) True, activations handed in as tensors the workbench's default, False."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    from workbench.analysis.store import LiveActivations
    from workbench.interop.hf_tokenizer import HFTokenizer

    def model_with(adds_bos: bool):
        backend = Tokenizer(models.WordLevel({"<s>": 0, "a": 1, "b": 2, "<unk>": 3}, unk_token="<unk>"))
        backend.pre_tokenizer = pre_tokenizers.Whitespace()
        if adds_bos:
            backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
        tok = HFTokenizer(backend, {"bos_token": "<s>"})
        assert (tok.encode("a b")[0] == 0) == adds_bos  # the reference: the tokenizer's own encoding
        return wb.HookedDecoder(wb.ModelConfig(n_layers=1, d_model=8, n_heads=2, d_vocab=4, n_ctx=8, seed=0), tokenizer=tok)

    for adds_bos in (False, True):
        model = model_with(adds_bos)
        store = ActivationStore.collect(model, "a b a b b a a b " * 40, "blocks.0.hook_resid_post", 256,
                                        tmp_path / f"acts{adds_bos}", batch_size=8, seq_len=8, progress=False)
        assert LiveActivations(model, "a b", "blocks.0.hook_resid_post", seq_len=2).model_info["prepend_bos"] is adds_bos
        sae = train_sae(store, kind="relu", d_sae=8, steps=2, batch_size=8, progress=False, threads=1)
        cfg = json.loads((save_dictionary(sae, tmp_path / f"bos{adds_bos}") / "cfg.json").read_text())
        assert cfg["metadata"]["prepend_bos"] is adds_bos
    sae = train_sae(TensorActivations({"x": torch.randn(64, 8)}), kind="relu", d_sae=8, steps=2, batch_size=8,
                    progress=False, threads=1)
    assert json.loads((save_dictionary(sae, tmp_path / "tensors") / "cfg.json").read_text())["metadata"]["prepend_bos"] is False
