"""Cross-layer transcoders: the map against a hand computation (JumpReLU, TopK, skip), the trainer's
concatenated view against the per-layer one, scaling folded exactly, save/load bit-exact, bad input."""

import pytest
import torch

from workbench.analysis.dictionaries import (
    CrossLayerTranscoder,
    DictionaryError,
    load_dictionary,
    make_dictionary,
    save_dictionary,
)
from workbench.analysis.dictionaries.clt import clt_config


def hand_clt(activation="jumprelu", skip=False):
    """Two layers, two features per layer, 2-d in and out, with weights small enough to compute by hand."""
    clt = CrossLayerTranscoder(n_layers=2, d_in=2, d_sae=2, d_out=2, activation=activation, k=1, skip=skip)
    with torch.no_grad():
        clt.W_enc.copy_(torch.tensor([[[1.0, 0.0], [0.0, 1.0]], [[1.0, 1.0], [0.0, 1.0]]]))
        clt.b_enc.zero_()
        clt.W_dec[0].copy_(torch.tensor([[[1.0, 0.0], [0.0, 1.0]], [[5.0, 5.0], [7.0, 7.0]]]))  # [feature, target, d_out]
        clt.W_dec[1].copy_(torch.tensor([[[1.0, 2.0]], [[-1.0, 0.0]]]))
        clt.b_dec.copy_(torch.tensor([[0.5, 0.0], [0.0, -1.0]]))
        if activation == "jumprelu":
            clt.threshold.copy_(torch.tensor([[0.5, 0.5], [0.5, 2.0]]))
        if skip:
            clt.W_skip.zero_()
            clt.W_skip[1, 0, 0] = 1.0  # target 1's output gains its input's first coordinate
    return clt


X0, X1 = torch.tensor([1.0, 0.25]), torch.tensor([2.0, 1.0])


def test_hand_computation_jumprelu_topk_and_skip():
    clt = hand_clt()
    # pre_0 = x_0 = [1, 0.25]: only feature 0 passes the 0.5 threshold. pre_1 = [2, 2 + 1] = [2, 3]: both pass.
    assert clt.encode(0, X0).tolist() == [1.0, 0.0]
    assert clt.encode(1, X1).tolist() == [2.0, 3.0]
    acts = [clt.encode(0, X0), clt.encode(1, X1)]
    # y_0 = 1 * [1, 0] + [0.5, 0];  y_1 = 1 * [0, 1] + 2 * [1, 2] + 3 * [-1, 0] + [0, -1]
    assert clt.decode(0, acts).tolist() == [1.5, 0.0]
    assert clt.decode(1, acts).tolist() == [-1.0, 4.0]
    assert clt.decoder(0, 1).tolist() == [[0.0, 1.0], [7.0, 7.0]]
    assert [y.tolist() for y in clt([X0, X1])] == [[1.5, 0.0], [-1.0, 4.0]]

    top = hand_clt("topk")  # k = 1: layer 1 keeps only feature 1 (3 > 2)
    assert top.encode(1, X1).tolist() == [0.0, 3.0]
    assert top.decode(1, [top.encode(0, X0), top.encode(1, X1)]).tolist() == [-3.0, 0.0]

    skip = hand_clt(skip=True)  # adds x_1[0] = 2 to the first coordinate of y_1
    assert skip.decode(1, acts, X1).tolist() == [1.0, 4.0]
    with pytest.raises(ValueError, match="x_target"):
        skip.decode(1, acts)


def test_concatenated_view_matches_per_layer_and_batches():
    torch.manual_seed(0)
    for activation, skip in (("jumprelu", True), ("topk", False)):
        clt = CrossLayerTranscoder(n_layers=3, d_in=6, d_sae=10, d_out=5, activation=activation, k=3, skip=skip)
        with torch.no_grad():
            for p in clt.parameters():
                p.copy_(torch.randn_like(p) * 0.5)
        xs = [torch.randn(4, 7, 6) for _ in range(3)]
        per_layer = clt(xs)
        flat = clt.decode_all(clt.activate(clt.pre_acts(torch.cat(xs, -1))), torch.cat(xs, -1))
        torch.testing.assert_close(flat, torch.cat(per_layer, -1), rtol=1e-5, atol=1e-5)
        # a dense reference: every (source, target) pair as an explicit sum over features
        acts = [clt.encode(s, x) for s, x in enumerate(xs)]
        for t in range(3):
            ref = clt.b_dec[t] + sum(torch.einsum("bpf,fo->bpo", acts[s], clt.W_dec[s][:, t - s]) for s in range(t + 1))
            if skip:
                ref = ref + torch.einsum("bpi,oi->bpo", xs[t], clt.W_skip[t])
            torch.testing.assert_close(per_layer[t], ref, rtol=1e-5, atol=1e-5)


def test_fold_scaling_gives_the_raw_map():
    torch.manual_seed(1)
    clt = CrossLayerTranscoder(n_layers=3, d_in=4, d_sae=8, d_out=4, skip=True)
    with torch.no_grad():
        for p in clt.parameters():
            p.copy_(torch.randn_like(p))
        clt.threshold.abs_()
    s_in, s_out = [2.0, 0.5, 3.0], [4.0, 0.25, 1.5]
    xs = [torch.randn(5, 4) for _ in range(3)]
    scaled = clt([x * a for x, a in zip(xs, s_in)])
    clt.fold_scaling(s_in, s_out)
    for y, y_scaled, c in zip(clt(xs), scaled, s_out):
        torch.testing.assert_close(y, y_scaled / c, rtol=1e-5, atol=1e-5)


def test_decoder_norms_and_parallel_gradients():
    clt = CrossLayerTranscoder(n_layers=3, d_in=4, d_sae=8, d_out=4)
    for W in clt.W_dec:  # a feature's decoders over all its targets form one unit vector
        torch.testing.assert_close(W.norm(dim=(1, 2)), torch.ones(8))
    loss = sum((W * torch.randn_like(W)).sum() for W in clt.W_dec)
    loss.backward()
    clt.remove_parallel_grads()
    for W in clt.W_dec:
        assert float((W.grad * W.detach()).sum((1, 2)).abs().max()) < 1e-6


def test_registry_and_save_load_round_trip(tmp_path):
    clt = make_dictionary(clt_config(n_layers=2, d_in=2, d_sae=2, d_out=2, skip=True))
    assert isinstance(clt, CrossLayerTranscoder)
    assert (clt.hook_in(1), clt.hook_out(0)) == ("blocks.1.ln2.hook_normalized", "blocks.0.hook_mlp_out")
    src = hand_clt(skip=True)
    src.metrics = {"explained_variance": 0.5}
    save_dictionary(src, tmp_path / "clt")
    back = load_dictionary(tmp_path / "clt")
    assert isinstance(back, CrossLayerTranscoder) and back.metrics == {"explained_variance": 0.5}
    for (name, a), (_, b) in zip(src.named_parameters(), back.named_parameters()):
        assert torch.equal(a, b), name
    (tmp_path / "clt" / "clt.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(DictionaryError, match="corrupt"):
        load_dictionary(tmp_path / "clt")


def test_bad_input():
    clt = hand_clt()
    with pytest.raises(ValueError, match="write only into layers 1..1"):
        clt.decoder(1, 0)
    with pytest.raises(ValueError, match="layers 0..1"):
        clt.decode(1, [clt.encode(0, X0)])
    with pytest.raises(ValueError, match="layer must be an integer"):
        clt.encode(2, X0)
    with pytest.raises(ValueError, match="integer k"):
        CrossLayerTranscoder(n_layers=2, d_in=2, d_sae=2, activation="topk", k=5)
    with pytest.raises(ValueError, match="activation must be one of"):
        CrossLayerTranscoder(n_layers=2, d_in=2, d_sae=2, activation="relu6")


# ---- splicing into a model ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    import workbench as wb
    from factories import tiny

    torch.manual_seed(0)
    return wb.HookedDecoder(tiny(d_vocab=40, n_layers=3, norm="rmsnorm", ffn="swiglu", positional="rope")).eval()


def random_clt(model, activation="jumprelu", skip=True, seed=0):
    torch.manual_seed(seed)
    clt = CrossLayerTranscoder(n_layers=model.cfg.n_layers, d_in=model.cfg.d_model, d_sae=24,
                               d_out=model.cfg.d_model, activation=activation, k=4, skip=skip)
    with torch.no_grad():
        for p in clt.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        if activation == "jumprelu":
            clt.threshold.uniform_(0.0, 0.5)
    return clt


def test_spliced_with_error_terms_equals_the_model(model):
    from workbench.analysis import spliced

    tokens = torch.randint(0, 40, (3, 12))
    plain = model(tokens)
    clean, cache = model.run_with_cache(tokens)
    clt = random_clt(model)
    with spliced(model, clt, error_term=True):
        logits, spliced_cache = model.run_with_cache(tokens)
        assert set(model._sae_splices) == {f"blocks.{layer}.hook_mlp_out" for layer in range(3)}
    torch.testing.assert_close(logits, clean, rtol=0, atol=1e-5)
    # the features are the CLT's encoding of each layer's MLP input, and the reconstruction its decode
    xs = [cache[clt.hook_in(layer)] for layer in range(3)]
    acts = [clt.encode(layer, x) for layer, x in enumerate(xs)]
    for layer in range(3):
        torch.testing.assert_close(spliced_cache[f"blocks.{layer}.hook_mlp_out.hook_sae_acts_post"], acts[layer],
                                   rtol=1e-4, atol=1e-4)  # the error term returns x to float rounding
        torch.testing.assert_close(spliced_cache[f"blocks.{layer}.hook_mlp_out.hook_sae_recons"],
                                   clt.decode(layer, acts, xs[layer]), rtol=1e-4, atol=1e-4)
    assert not hasattr(model.blocks[0], "_sae_splices") and not model._sae_splices  # all out again
    assert torch.equal(model(tokens), plain)


def test_spliced_without_error_and_feature_edits_reach_later_layers(model):
    from workbench.analysis import spliced

    tokens = torch.randint(0, 40, (2, 10))
    clt = random_clt(model, skip=False)
    # without the error term every MLP output is the reconstruction: check against a manual forward
    with spliced(model, clt, error_term=False):
        logits = model(tokens)
    recons: dict = {}

    def replace(layer):
        def hook(value, hook):
            return recons[layer]
        return hook

    def tap(layer):
        def hook(value, hook):
            acts_so_far.append(clt.encode(layer, value))
            recons[layer] = clt.decode(layer, acts_so_far)
        return hook

    acts_so_far: list = []
    fwd = [(clt.hook_in(layer), tap(layer)) for layer in range(3)] + [(clt.hook_out(layer), replace(layer)) for layer in range(3)]
    torch.testing.assert_close(logits, model.run_with_hooks(tokens, fwd_hooks=fwd), rtol=1e-5, atol=1e-5)

    # zeroing every layer-0 feature (error term kept) moves the later layers by exactly their decoders' share
    def zero(value, hook):
        return torch.zeros_like(value)

    with spliced(model, clt, error_term=True):
        _, base = model.run_with_cache(tokens)
        with model.hooks(fwd_hooks=[("blocks.0.hook_mlp_out.hook_sae_acts_post", zero)]):
            edited_logits, edited = model.run_with_cache(tokens)
    a0 = base["blocks.0.hook_mlp_out.hook_sae_acts_post"]
    assert float(a0.abs().sum()) > 0
    expected_shift = -(a0 @ clt.decoder(0, 0))
    torch.testing.assert_close(edited["blocks.0.hook_mlp_out"] - base["blocks.0.hook_mlp_out"], expected_shift,
                               rtol=1e-4, atol=1e-4)
    assert not torch.allclose(edited_logits, logits)


def test_splice_bad_input(model):
    from workbench.analysis import add_sae, remove_sae, spliced

    with pytest.raises(ValueError, match="covers 2 layers"):
        add_sae(model, CrossLayerTranscoder(n_layers=2, d_in=32, d_sae=4))
    with pytest.raises(ValueError, match="d_in=16 does not match"):
        add_sae(model, CrossLayerTranscoder(n_layers=3, d_in=16, d_sae=4, d_out=32))
    clt = random_clt(model)
    with spliced(model, clt):
        with pytest.raises(ValueError, match="already spliced"):
            add_sae(model, random_clt(model, seed=1))
    add_sae(model, clt)
    remove_sae(model, "blocks.1.hook_mlp_out")  # one layer's name takes the whole CLT out
    assert not model._sae_splices


# ---- training ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def store(model, tmp_path_factory):
    from workbench.analysis.dictionaries.trainer import clt_hooks
    from workbench.analysis.store import ActivationStore
    from workbench.data import get_task

    return ActivationStore.collect(model, get_task("induction", vocab=32), clt_hooks(3), 3000,
                                   tmp_path_factory.mktemp("acts") / "s", batch_size=8, tokens_per_shard=1000,
                                   progress=False)


def test_train_sae_clt_run_folder_resume_metrics(model, store, tmp_path):
    import pandas as pd

    from workbench.analysis.dictionaries import reconstruction_metrics, train_sae

    kw = dict(kind="clt", d_sae=48, batch_size=128, log_every=5, progress=False, lr=3e-3, warmup_steps=2,
              eval_sequences=8, skip=True)
    full = train_sae(store, steps=30, out=tmp_path / "full", model=model, **kw)
    assert isinstance(full, CrossLayerTranscoder) and full.skip and full.n_layers == 3
    assert {p.name for p in (tmp_path / "full").iterdir()} == {
        "clt.json", "clt.safetensors", "metrics.csv", "train_state.safetensors", "train_state.json"}
    m = full.metrics
    for key in ["l0", "explained_variance", "ce_loss_recovered", "ce_loss_zero_ablated"] + \
            [f"{name}_layer{layer}" for name in ("explained_variance", "l0") for layer in range(3)]:
        assert key in m and m[key] == m[key], key
    assert sum(m[f"l0_layer{layer}"] for layer in range(3)) == pytest.approx(m["l0"])
    assert m["explained_variance"] > 0.5 and m["ce_loss_recovered"] > 0.2, m  # 30 steps: well above zeroing the MLPs
    assert pd.read_csv(tmp_path / "full" / "metrics.csv")["step"].tolist() == list(range(5, 31, 5))

    # per-layer explained variance recomputed by hand from the store's held-out shard
    held = store.subset([store.n_shards - 1]).load_shard(0)
    xs = [held[full.hook_in(layer)] for layer in range(3)]
    for layer, y_hat in enumerate(full(xs)):
        y = held[full.hook_out(layer)]
        ev = 1 - (y_hat - y).pow(2).sum() / (y - y.mean(0)).pow(2).sum()
        assert float(ev) == pytest.approx(m[f"explained_variance_layer{layer}"], abs=1e-4)

    # resume continues exactly; the saved CLT takes raw activations
    short = {**kw, "eval_sequences": 0, "log_every": 2}
    straight = train_sae(store, steps=8, out=tmp_path / "straight", **short)
    train_sae(store, steps=8, out=tmp_path / "half", callback=lambda row: row["step"] == 4, **short)
    resumed = train_sae(store, steps=8, out=tmp_path / "half", resume=True, **short)
    for (name, p), (_, q) in zip(straight.named_parameters(), resumed.named_parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=name)
    loaded = load_dictionary(tmp_path / "full")
    again, _ = reconstruction_metrics(loaded, store.subset([store.n_shards - 1]))
    assert again["explained_variance"] == pytest.approx(m["explained_variance"], rel=1e-5)


def test_train_sae_clt_topk_and_bad_input(model, store):
    from workbench.analysis.dictionaries import train_sae
    from workbench.analysis.store import ActivationStore

    top = train_sae(store, kind="clt", activation="topk", k=3, d_sae=32, steps=10, batch_size=128, progress=False,
                    eval_sequences=0)
    assert top.activation == "topk" and top.metrics["l0"] <= 9 + 1e-6
    with pytest.raises(ValueError, match="leave hook= and hook_out= empty"):
        train_sae(store, kind="clt", hook="blocks.0.ln2.hook_normalized", steps=1, progress=False)
    with pytest.raises(ValueError, match="integer k"):
        train_sae(store, kind="clt", activation="topk", k=2.5, steps=1, progress=False)
    partial = ActivationStore(store.path)
    partial.manifest = {**partial.manifest, "hooks": {h: v for h, v in partial.manifest["hooks"].items()
                                                      if not h.startswith("blocks.1.")}}
    with pytest.raises(ValueError, match="every layer's MLP input and output"):
        train_sae(partial, kind="clt", d_sae=8, batch_size=64, steps=1, progress=False)


# ---- circuit-tracer's files -------------------------------------------------------------------------
def test_circuit_tracer_files_both_ways(model, tmp_path):
    from safetensors.torch import load_file

    from workbench.analysis.dictionaries import DictionaryConfig
    from workbench.analysis.dictionaries.circuit_tracer import load_circuit_tracer, save_circuit_tracer

    import copy

    model = copy.deepcopy(model)
    with torch.no_grad():  # norm weights that are not ones, so folding them in and out is tested
        for block in model.blocks:
            block.ln2.w.copy_(torch.rand_like(block.ln2.w) + 0.5)
    tokens = torch.randint(0, 40, (2, 9))
    _, cache = model.run_with_cache(tokens)
    torch.manual_seed(3)
    tcs = []
    for layer in range(3):
        tc = make_dictionary(DictionaryConfig(kind="skip_transcoder", d_in=32, d_sae=40, d_out=32, k=5,
                                              hook_name=f"blocks.{layer}.ln2.hook_normalized",
                                              hook_name_out=f"blocks.{layer}.hook_mlp_out"))
        with torch.no_grad():
            for p in tc.parameters():
                p.copy_(torch.randn_like(p) * 0.3)
        tcs.append(tc)
    save_circuit_tracer(tcs, tmp_path / "set", model=model)
    state = load_file(str(tmp_path / "set" / "layer_1.safetensors"))
    assert {k: tuple(v.shape) for k, v in state.items()} == {
        "W_enc": (40, 32), "W_dec": (40, 32), "b_enc": (40,), "b_dec": (32,), "W_skip": (32, 32)}
    # circuit-tracer's map on its hook (the MLP input after the norm weight) equals ours on ours
    mlp_in = cache["blocks.1.ln2.hook_normalized"] * model.blocks[1].ln2.w
    pre = torch.nn.functional.linear(mlp_in, state["W_enc"], state["b_enc"])
    torch.testing.assert_close(pre, tcs[1].pre_acts(cache["blocks.1.ln2.hook_normalized"]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mlp_in @ state["W_skip"].T,
                               cache["blocks.1.ln2.hook_normalized"] @ tcs[1].W_skip.T, rtol=1e-5, atol=1e-5)
    back = load_circuit_tracer(tmp_path / "set", model=model)
    assert [type(t).__name__ for t in back] == ["SkipTranscoder"] * 3 and back[2].cfg.k == 5
    for a, b in zip(tcs, back):
        x = cache[a.cfg.hook_name]
        torch.testing.assert_close(b(x), a(x), rtol=1e-5, atol=1e-5)

    clt = random_clt(model, skip=False)
    save_circuit_tracer(clt, tmp_path / "clt", model=model)
    enc = load_file(str(tmp_path / "clt" / "W_enc_2.safetensors"))
    assert {k: tuple(v.shape) for k, v in enc.items()} == {
        "W_enc_2": (24, 32), "b_enc_2": (24,), "b_dec_2": (32,), "threshold_2": (24,)}
    assert tuple(load_file(str(tmp_path / "clt" / "W_dec_1.safetensors"))["W_dec_1"].shape) == (24, 2, 32)
    again = load_circuit_tracer(tmp_path / "clt", model=model)
    xs = [cache[clt.hook_in(layer)] for layer in range(3)]
    for y, z in zip(clt(xs), again(xs)):
        torch.testing.assert_close(z, y, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="no skip connection"):
        save_circuit_tracer(random_clt(model, skip=True), tmp_path / "bad")
    with pytest.raises(ValueError, match="layer 0 needs"):
        save_circuit_tracer(tcs[1:], tmp_path / "bad")


@pytest.mark.slow
def test_clt_command_under_torchrun_matches_one_process(model, tmp_path):
    import workbench as wb
    from factories import run_torchrun

    from workbench.analysis.dictionaries import train_sae
    from workbench.analysis.dictionaries.trainer import clt_hooks
    from workbench.analysis.store import ActivationStore
    from workbench.data import get_task

    task = get_task("induction", vocab=32)
    wb.save_checkpoint(model, tmp_path / "ckpt", meta={"task": "induction", "task_options": task.options()})
    store = ActivationStore.collect(model, task, clt_hooks(3), 1200, tmp_path / "acts", batch_size=8,
                                    tokens_per_shard=600, progress=False)
    flags = ["--kind", "clt", "--d-sae", "16", "--steps", "3", "--batch-size", "64", "--lr", "3e-3",
             "--warmup-steps", "1", "--threads", "1", "--eval-sequences", "0", "--no-progress"]
    run_torchrun(["train-sae", str(tmp_path / "ckpt"), *flags, "--store", str(tmp_path / "acts"), "--tokens", "1200",
                  "--out", str(tmp_path / "ddp")])
    single = train_sae(store, kind="clt", d_sae=16, steps=3, batch_size=64, lr=3e-3, warmup_steps=1,
                       eval_sequences=0, progress=False)
    ddp = load_dictionary(tmp_path / "ddp")
    for (name, p), (_, q) in zip(single.named_parameters(), ddp.named_parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5, msg=name)


def test_a_clt_saved_inside_a_checkpoint_goes_when_new_weights_replace_it(model, tmp_path):
    import workbench as wb
    from factories import tiny
    import dataclasses

    from workbench.checkpoint import model_fingerprint

    ckpt = wb.save_checkpoint(model, tmp_path / "ckpt")
    clt = random_clt(model)
    clt.cfg = dataclasses.replace(clt.cfg, model_fingerprint=model_fingerprint(model))  # as train_sae records it
    save_dictionary(clt, ckpt / "saes" / "clt")
    wb.save_checkpoint(model, ckpt)  # the same weights again: the CLT still belongs to them
    assert (ckpt / "saes" / "clt" / "clt.json").is_file()
    torch.manual_seed(1)
    other = wb.HookedDecoder(tiny(d_vocab=40, n_layers=3, norm="rmsnorm", ffn="swiglu", positional="rope"))
    wb.save_checkpoint(other, ckpt)  # new weights: a CLT fitted to the old ones must not stay beside them
    assert not (ckpt / "saes").exists()
