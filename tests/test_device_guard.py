"""Every main analysis, run under ``HostTensorGuard`` (tests/device_guard.py): no tensor the library
makes without ``device=`` meets the model's data. On a CPU that is the bug class the first CUDA run
found in the attribution graph (``torch.searchsorted`` and an index with a CPU-built tensor); this
file finds it anywhere without a GPU. Under ``--device cuda`` the same calls run on the GPU.
"""

from pathlib import Path

import pytest
import torch
from device_guard import DeviceMismatch, HostTensorGuard
from factories import tiny

import workbench as wb
from workbench import analysis as an

VOCAB = 40


def _model(**overrides):
    return wb.HookedDecoder(tiny(init_std=0.1, d_vocab=VOCAB, **overrides)).eval()


def _tokens(batch=2, pos=7, seed=0):
    return torch.randint(0, VOCAB, (batch, pos), generator=torch.Generator().manual_seed(seed))


def _transcoders(model, kind="skip_transcoder", d_sae=24):
    from workbench.analysis.dictionaries import DictionaryConfig
    from workbench.analysis.dictionaries.registry import make_dictionary

    g, d, out = torch.Generator().manual_seed(0), model.cfg.d_model, []
    for layer in range(model.cfg.n_layers):
        tc = make_dictionary(DictionaryConfig(kind=kind, d_in=d, d_sae=d_sae, d_out=d,
                                              hook_name=f"blocks.{layer}.ln2.hook_normalized",
                                              hook_name_out=f"blocks.{layer}.hook_mlp_out"))
        tc.init_weights(g)
        with torch.no_grad():
            tc.b_enc.copy_(-0.2 * torch.rand(d_sae, generator=g))
        out.append(tc.eval().to(model.device))
    return out


def _graph(model):
    return an.graphs.attribution_graph(model, _transcoders(model), _tokens(1), batch_size=16)


def _pair():
    return _tokens(4, 6, seed=1), _tokens(4, 6, seed=2)


METRIC = an.logit_diff_metric(3, 5)

CASES = {
    "attribution graph": lambda m: _graph(m),
    "attribution graph, rope gqa": lambda m: _graph(_placed(m, norm="rmsnorm", positional="rope", ffn="swiglu",
                                                            n_kv_heads=2)),
    "attribution graph, plain transcoders": lambda m: an.graphs.attribution_graph(
        m, _transcoders(m, kind="transcoder"), _tokens(1), batch_size=16, max_feature_nodes=20, update_interval=1),
    "graph prune, scores, frame": lambda m: (lambda g: (g.prune(0.8, 0.98).to_frame(), g.scores()))(_graph(m)),
    "graph intervention": lambda m: (lambda g: (g.intervene([int(g.nodes_of("feature")[0])], 0.0),
                                                g.intervene([int(g.nodes_of("feature")[0])], 1.0, direct_only=True)))(
        _graph(m)),
    "qk attribution": lambda m: an.qk_attribution(_graph(m), 1, 0, 5, 2),
    "eap": lambda m: an.edge_attribution(m, _pair(), METRIC, "eap"),
    "eap-ig": lambda m: an.edge_attribution(m, _pair(), METRIC, "eap-ig", steps=2),
    "edge patching": lambda m: an.edge_patching(m, _pair(), METRIC, edges=list(range(5))),
    "node attribution": lambda m: an.node_attribution(m, _pair(), METRIC, "attribution"),
    "circuit discovery and faithfulness": lambda m: an.faithfulness(
        m, an.discover_circuit(m, _pair(), METRIC, "eap", top_k=10), _pair(), METRIC),
    "ablation": lambda m: an.ablation_sweep(m, _tokens(), "head"),
    "ablate neurons, mean": lambda m: an.ablate(m, _tokens(), an.AblationSpec("neurons", 1, neurons=[0, 5],
                                                                              method="mean")),
    "ablate resid direction": lambda m: an.ablate(m, _tokens(), an.AblationSpec(
        "direction", 0, direction=torch.randn(32, generator=torch.Generator().manual_seed(3)), method="mean")),
    "activation patching": lambda m: an.activation_patching(m, *_pair(), METRIC, sites="head"),
    "attribution patching": lambda m: an.attribution_patching(m, *_pair(), METRIC),
    "logit lens": lambda m: an.logit_lens(m, _tokens(), k=3),
    "tuned lens": lambda m: an.tuned_lens(m, _tokens(), an.train_tuned_lens(m, _tokens(8, 7), steps=2,
                                                                           batch_size=4, progress=False)),
    "direct logit attribution": lambda m: an.direct_logit_attribution(m, _tokens(), 3, 5, pos=-1),
    "head scores": lambda m: an.head_scores(m, _tokens(2, 12)),
    "attention patterns": lambda m: an.attention_patterns(m, _tokens()),
    "token losses": lambda m: an.token_losses(m, _tokens()),
    "residual norms": lambda m: an.residual_norms(m, _tokens()),
    "steering vector": lambda m: an.steering_vector(m, _tokens(seed=4), _tokens(seed=5), "blocks.0.hook_resid_post"),
    "probe": lambda m: an.train_probe(m, _tokens(16, 6), torch.arange(16) % 2, hooks="blocks.1.hook_resid_post",
                                      n_boot=10),
    "generate": lambda m: m.generate(_tokens(2, 4), max_new_tokens=3),
    "generate, static cache, sampled": lambda m: _unchecked(lambda: m.generate(
        _tokens(2, 4), max_new_tokens=3, static_cache=True, temperature=1.0, seed=1)),
    "vocabulary table": lambda m: an.vocabulary_table(m),
    "train sae from tensors": lambda m: an.train_sae(
        an.TensorActivations({"blocks.0.hook_resid_post": torch.randn(64, 32, generator=torch.Generator())}),
        kind="batchtopk", d_sae=16, k=2, steps=3, batch_size=16, progress=False),
    "train skip transcoder from a store": lambda m: an.train_sae(_store(m), kind="skip_transcoder", d_sae=16, k=2,
                                                                 hook="blocks.0.ln2.hook_normalized",
                                                                 hook_out="blocks.0.hook_mlp_out", steps=3,
                                                                 batch_size=16, progress=False, model=m),
    "features": lambda m: (an.feature_activations(m, _sae(m), _tokens()), an.feature_logit_effects(m, _sae(m), 0),
                           an.feature_dla(m, _sae(m), _tokens(), 3, 5)),
    "spliced sae": lambda m: _spliced_forward(m),
    "feature tables over a dataset": lambda m: (an.max_activating_contexts(m, _sae(m), _tokens(4, 8), 0, k=3),
                                                an.feature_histogram(m, _sae(m), _tokens(4, 8), 0),
                                                an.features_on_token(m, _sae(m), _tokens(4, 8), m.to_str_tokens(3)[0]
                                                                     if m.tokenizer else "3")),
    "dictionary evaluation": lambda m: _evaluated(m),
    "steering": lambda m: (an.steered_generate(m, _tokens(1, 4), _direction(m), [0.0, 2.0], max_new_tokens=3),
                           an.steering_sweep(m, _tokens(2, 5), _direction(m), [0.0, 1.0])),
    "fourier": lambda m: _fourier(m),
    "training steps": lambda m: _trained(m),
    "attribution graph, padded batch": lambda m: an.graphs.attribution_graph(
        m, _transcoders(m), _padded(m, "left"), batch_size=16, max_feature_nodes=10),
    "attribution graph, cross-layer transcoder": lambda m: an.graphs.attribution_graph(
        _placed(m, n_layers=3), _clt(m), _tokens(1), batch_size=16, max_feature_nodes=10),
    "padded patching and lens": lambda m: (an.logit_lens(m, _padded(m, "left"), k=2),
                                           an.ablate(m, _padded(m, "right"), an.AblationSpec("head", 1, head=2,
                                                                                           method="mean"))),
    "path patching": lambda m: an.path_patching(m, _pair(), METRIC, sender=("head", 0, 0),
                                                receivers=[("head", 1, 0, "k")]),
}


def _padded(m, side):
    from workbench.padding import TokenBatch

    rows = [_tokens(1, n, seed=n)[0].tolist() for n in (7, 4, 6)]
    return TokenBatch.from_ids(rows, 0, side, m.device)


def _clt(m):
    from workbench.analysis.dictionaries.clt import CrossLayerTranscoder

    clt = CrossLayerTranscoder(n_layers=3, d_in=32, d_sae=24, activation="topk", k=4, skip=True)
    clt.init_weights(torch.Generator().manual_seed(0))
    return clt.eval().to(m.device)


def _unchecked(call):
    """``call`` without jaxtyping's test-only checks, which reject a static cache's step object (a
    ``StaticStep`` where the annotation says ``Padding``; tests/test_compiled_decode.py turns them off too)."""
    import jaxtyping

    was = jaxtyping.config.jaxtyping_disable
    jaxtyping.config.update("jaxtyping_disable", True)
    try:
        return call()
    finally:
        jaxtyping.config.update("jaxtyping_disable", was)


def _trained(m):
    from workbench.training import TrainConfig, train

    return train(TrainConfig(task="induction", steps=3, batch_size=4, device=str(m.device)), tiny(d_vocab=64),
                 progress=False)


def _direction(m):
    return an.Direction(torch.randn(32, generator=torch.Generator().manual_seed(6)), "blocks.0.hook_resid_post")


def _evaluated(m):
    from workbench.analysis.dictionaries.evaluate import ce_loss_recovered, reconstruction_metrics

    sae = _sae(m)
    rows = an.TensorActivations({"blocks.1.hook_resid_pre": torch.randn(64, 32, generator=torch.Generator())})
    return reconstruction_metrics(sae, rows, batch_size=16), ce_loss_recovered(m, sae, _tokens())


def _fourier(m):
    from workbench.analysis import fourier
    from workbench.data.modular import ModularTask

    task = ModularTask(seed=0, p=7, layout="paper")
    cfg = wb.ModelConfig.from_preset("grokking-1l", d_model=32, d_mlp=64, d_vocab=8, seed=0)
    model = wb.HookedDecoder(cfg).eval().to(m.device)
    return (fourier.embedding_norms(model, task), fourier.neuron_frequencies(model, task),
            fourier.logit_fourier_norms(model, task), fourier.progress_measures(model, task, [1, 2]))


def _store(m):
    import tempfile

    folder = tempfile.mkdtemp(prefix="guard-store-")
    return an.ActivationStore.collect(m, _task(), ["blocks.0.ln2.hook_normalized", "blocks.0.hook_mlp_out"], 96,
                                      Path(folder) / "s", batch_size=4, progress=False)


def _task():
    from workbench.data import get_task

    return get_task("induction", vocab=32)


def _sae(m):
    from workbench.analysis.dictionaries.registry import make_dictionary

    sae = make_dictionary(an.DictionaryConfig(kind="topk", d_in=32, d_sae=16, k=2, hook_name="blocks.1.hook_resid_pre"))
    sae.init_weights(torch.Generator().manual_seed(0))
    return sae.eval().to(m.device)


def _spliced_forward(m):
    with an.spliced(m, _sae(m), error_term=True):
        return m(_tokens())


def _placed(model, **overrides):
    return _model(**overrides).to(model.device)


@pytest.mark.parametrize("name", list(CASES))
def test_no_tensor_made_without_a_device_meets_the_data(name, device):
    model = _model().to(device)
    with HostTensorGuard():
        CASES[name](model)


def test_the_guard_catches_what_the_first_cuda_run_found():
    data = torch.randn(5)
    with HostTensorGuard(), pytest.raises(DeviceMismatch, match="searchsorted"):
        torch.searchsorted(torch.arange(5.0), data)
    with HostTensorGuard(), pytest.raises(DeviceMismatch, match="getitem"):
        torch.arange(5)[data.long().abs() % 5]
    with HostTensorGuard():  # what CUDA accepts: CPU indices into data, a CPU scalar, a tensor moved first
        data[torch.arange(2)], data * torch.tensor(2.0), data + torch.ones(5).to(data.device)


# ---- a model on one device and what it is given on another ----------------------------------------
# The meta device stands in for a GPU: a model moved there, transcoders or a lens left on the CPU.
# (Splicing moves a dictionary to the model's device instead, and the feature tables each activation.)
def _on_meta(model):
    return model.to("meta")


def test_transcoders_on_another_device_are_refused_naming_both():
    model = _model()
    tcs = _transcoders(model)
    with pytest.raises(ValueError, match=r"transcoders' weights are on cpu and the model on meta"):
        an.graphs.attribution_graph(_on_meta(model), tcs, _tokens(1))


def test_a_tuned_lens_on_another_device_is_refused_naming_both():
    model = _model()
    lens = an.TunedLens(model.cfg.n_layers, model.cfg.d_model)
    _on_meta(model)
    with pytest.raises(ValueError, match=r"tuned lens's weights are on cpu and the model on meta"):
        an.tuned_lens(model, _tokens(), lens)
