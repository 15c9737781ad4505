"""What the Steer and Features pages show, as library calls: clean and edited runs side by side
(``edit_comparison``, ``steering_comparison``), a feature's decoder row as a Direction, a feature
ablated or set (``feature_edit``), the features that fire on a token, a feature's activation per
position of a prompt, the ``TokenIn`` probe label, and the figures of these tables. Each checked
against a direct computation: ``model.generate`` under the hooks, the cache, hand-counted firings."""

import pytest
import torch
from factories import tiny

import workbench as wb
from workbench import analysis as an
from workbench import viz
from workbench.analysis.dictionaries import DictionaryConfig, make_dictionary

HOOK = "blocks.0.hook_resid_post"


@pytest.fixture(scope="module")
def model():
    return wb.HookedDecoder(tiny(d_vocab=40)).eval()


def dictionary(kind="relu", d_sae=64, hook=HOOK, seed=0):
    sae = make_dictionary(DictionaryConfig(kind=kind, d_in=32, d_sae=d_sae, k=4, hook_name=hook))
    sae.init_weights(torch.Generator().manual_seed(seed))
    with torch.no_grad():  # a positive encoder bias: most features fire somewhere
        sae.b_enc.copy_(torch.rand(d_sae, generator=torch.Generator().manual_seed(seed + 1)) * 0.2)
    return sae


def _salient(model, prompt):
    _, cache = model.run_with_cache(prompt)
    return an.Direction(cache[HOOK][0, -1], HOOK)


# ---- side by side ---------------------------------------------------------------------------------
@pytest.mark.parametrize("mode,scale", [("add", 3.0), ("ablate", 1.0), ("clamp", -2.0)])
def test_steering_comparison_equals_generate_with_and_without_steering(model, mode, scale):
    prompt = torch.randint(0, 40, (1, 6), generator=torch.Generator().manual_seed(2))
    direction = _salient(model, prompt)
    out = an.steering_comparison(model, prompt, direction, scale, mode, max_new_tokens=5)
    clean = model.generate(prompt, max_new_tokens=5)[0]
    with model.steer(direction, scale, mode):
        steered = model.generate(prompt, max_new_tokens=5)[0]
    frame = out["tokens"]
    assert frame[frame.run == "clean"].token_id.tolist() == clean.tolist()
    assert frame[frame.run == "steered"].token_id.tolist() == steered.tolist()
    assert frame.generated.tolist() == [p >= 6 for p in frame.pos]
    # The projection is what the unsteered model reads along the direction, for each text.
    for run, seq in (("clean", clean), ("steered", steered)):
        expected = an.project(model, seq[None], direction)["projection"].to_numpy()
        assert frame[frame.run == run].projection.to_numpy() == pytest.approx(expected, abs=1e-5)
    # The losses are the prompt's, clean and under the same steering.
    assert out["clean"].loss.to_numpy() == pytest.approx(an.token_losses(model, prompt).loss.to_numpy())
    with model.steer(direction, scale, mode):
        steered_losses = an.token_losses(model, prompt).loss.to_numpy()
    assert out["steered"].loss.to_numpy() == pytest.approx(steered_losses, abs=1e-6)


def test_steering_comparison_refuses_bad_input(model):
    prompt = torch.randint(0, 40, (1, 6))
    direction = _salient(model, prompt)
    other = wb.HookedDecoder(tiny(d_vocab=40, d_model=48)).eval()
    with pytest.raises(ValueError, match="48"):
        an.steering_comparison(other, prompt, direction, 1.0)
    with pytest.raises(ValueError, match="mode"):
        an.steering_comparison(model, prompt, direction, 1.0, mode="push")
    with pytest.raises(ValueError, match="scale"):
        an.steering_comparison(model, prompt, direction, float("nan"))
    with pytest.raises(ValueError, match="one prompt"):
        an.edit_comparison(model, torch.randint(0, 40, (2, 6)), lambda: model.steer(direction, 1.0))
    with pytest.raises(ValueError, match="n_ctx"):
        an.steering_comparison(model, prompt, direction, 1.0, max_new_tokens=40)


def test_edit_comparison_restores_the_model_after_the_edit(model):
    prompt = torch.randint(0, 40, (1, 6))
    direction = _salient(model, prompt)
    before = model(prompt)
    an.steering_comparison(model, prompt, direction, 5.0, max_new_tokens=4)
    assert torch.equal(model(prompt), before)


# ---- features ------------------------------------------------------------------------------------
def test_feature_direction_is_the_decoder_row_and_steers_by_it(model):
    sae = dictionary()
    d = an.feature_direction(model, sae, 7)
    assert d.hook == HOOK and torch.equal(d.vector, sae.W_dec[7].detach())
    assert d.provenance["kind"] == "sae_feature" and d.provenance["feature"] == 7
    tokens = torch.randint(0, 40, (2, 8))

    def add(act, hook):
        return act + 2.0 * sae.W_dec[7].detach()

    with model.steer(d, 2.0):
        steered = model(tokens)
    assert torch.allclose(steered, model.run_with_hooks(tokens, fwd_hooks=[(HOOK, add)]), atol=1e-5)
    with pytest.raises(ValueError, match="0..63"):
        an.feature_direction(model, sae, 64)
    per_head = make_dictionary(DictionaryConfig(kind="relu", d_in=32, d_sae=8, hook_name="blocks.0.attn.hook_z",
                                                hook_shape=(4, 8)))
    with pytest.raises(ValueError, match="not one vector per position"):
        an.feature_direction(model, per_head, 0)


@pytest.mark.parametrize("value,mode", [(0.0, "set"), (3.0, "set"), (0.5, "scale")])
def test_feature_edit_changes_the_hook_by_the_feature_alone(model, value, mode):
    """Reference: the hook's value plus (new - old) x the decoder row, written by hand from the
    dictionary's own encoding of the clean activation."""
    sae = dictionary()
    tokens = torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(3))
    _, cache = model.run_with_cache(tokens)
    old = sae.encode(cache[HOOK])[..., 5].detach()
    assert (old > 0).any(), "the test needs a feature that fires"
    new = torch.full_like(old, value) if mode == "set" else old * value

    def reference(act, hook):
        return act + (new - old)[..., None] * sae.W_dec[5].detach()

    expected = model.run_with_hooks(tokens, fwd_hooks=[(HOOK, reference)])
    with an.feature_edit(model, sae, 5, value, mode):
        edited = model(tokens)
    assert torch.allclose(edited, expected, atol=1e-4)
    assert an.spliced_saes(model) == {}, "the dictionary stays spliced after the block"
    assert torch.allclose(model(tokens), model.run_with_hooks(tokens, fwd_hooks=[]))
    with pytest.raises(ValueError, match="mode"):
        with an.feature_edit(model, sae, 5, 0.0, mode="zero"):
            pass
    with pytest.raises(ValueError, match="finite"):
        with an.feature_edit(model, sae, 5, float("inf")):
            pass


def test_features_on_token_counts_firings_where_the_token_stands(model):
    sae = dictionary()
    tokens = torch.randint(0, 40, (6, 10), generator=torch.Generator().manual_seed(4))
    token_id = int(tokens[2, 4])
    label = an.str_tokens(model, torch.tensor([token_id]))[0]
    frame = an.features_on_token(model, sae, tokens, label)
    acts = an.feature_activations(model, sae, tokens)
    where = tokens == token_id
    where[:, 0] = False  # position 0 is left out, as everywhere in features.py
    firing = acts[where] > 0
    assert frame.occurrences.iloc[0] == int(where.sum())
    expected = {f: int(n) for f, n in enumerate(firing.sum(0).tolist()) if n > 0}
    assert dict(zip(frame.feature, frame.fires)) == expected
    assert frame.fraction.is_monotonic_decreasing
    with pytest.raises(ValueError, match="does not occur"):
        an.features_on_token(model, sae, tokens, "no-such-token")


def test_prompt_feature_activations_read_the_spliced_cache(model):
    sae = dictionary()
    tokens = torch.randint(0, 40, (1, 9))
    frame = an.prompt_feature_activations(model, sae, tokens, 3)
    with an.spliced(model, sae, error_term=True):
        _, cache = model.run_with_cache(tokens)
    expected = cache[f"{HOOK}.hook_sae_acts_post"][0, :, 3]
    assert frame.activation.to_numpy() == pytest.approx(expected.numpy(), abs=1e-5)
    assert frame.token.tolist() == an.str_tokens(model, tokens[0])


def test_token_in_labels_tokens_and_names_itself(model):
    label = an.TokenIn(("Mary", " John "))
    assert label.words == ("Mary", "John") and label(" John") == 1 and label("Johnny") == 0
    assert label.__name__ == "token in {Mary, John}"
    assert hash(label) == hash(an.TokenIn(("Mary", "John")))
    with pytest.raises(ValueError, match="words is empty"):
        an.TokenIn(("", " "))


def test_token_in_trains_a_probe_on_token_identity(model):
    """A label that is a function of the token id is linearly readable from the embedding stream."""
    prompts = torch.randint(0, 40, (40, 8), generator=torch.Generator().manual_seed(5))
    words = tuple(an.str_tokens(model, torch.arange(0, 40, 3)))
    probe = an.train_probe(model, prompts, label=an.TokenIn(words), hooks=[HOOK], control=None, n_boot=20)
    assert probe.label == an.TokenIn(words).__name__
    assert probe.results.acc.iloc[0] > 0.9


# ---- figures ---------------------------------------------------------------------------------------
def test_token_values_and_feature_dla_figures(model):
    prompt = torch.randint(0, 40, (1, 6))
    out = an.steering_comparison(model, prompt, _salient(model, prompt), 2.0, max_new_tokens=4)
    fig = viz.token_values_figure(out["tokens"], "projection", group="run", boundary=6)
    assert [t.name for t in fig.data] == ["clean", "steered"]
    assert list(fig.data[1].y) == pytest.approx(out["tokens"].query("run == 'steered'").projection.tolist())
    assert fig.layout.shapes[0].x0 == 5.5
    with pytest.raises(ValueError, match="no column 'activation'"):
        viz.token_values_figure(out["tokens"], "activation")
    sae = dictionary()
    dla = an.feature_dla(model, sae, prompt, answer=3, wrong=4)
    chosen = int(dla.feature.iloc[-1])  # the smallest |DLA|: outside the top 3, so it is added
    fig = viz.feature_dla_figure(dla, feature=chosen, k=3)
    assert len(fig.data[0].y) == 4 and f"#{chosen}" in list(fig.data[0].y)
    assert list(fig.data[0].marker.color).count(viz.LAST_POSITION) == 1


def test_check_dictionary_refuses_another_width_and_warns_of_another_model(model):
    sae = dictionary()
    assert an.check_dictionary(model, sae) is None
    wide = make_dictionary(DictionaryConfig(kind="relu", d_in=48, d_sae=8, hook_name=HOOK))
    with pytest.raises(ValueError, match="48 wide at blocks.0.hook_resid_post, but this model's .* has 32"):
        an.check_dictionary(model, wide)
    missing = make_dictionary(DictionaryConfig(kind="relu", d_in=32, d_sae=8, hook_name="blocks.7.hook_resid_post"))
    with pytest.raises(ValueError, match="blocks.7.hook_resid_post"):
        an.check_dictionary(model, missing)
    named = make_dictionary(DictionaryConfig(kind="relu", d_in=32, d_sae=8, hook_name=HOOK, model_name="elsewhere"))
    assert an.check_dictionary(model, named) is None  # this model records no name to compare
    here = wb.HookedDecoder(tiny(d_vocab=40, name="here")).eval()
    assert "trained on 'elsewhere', not on 'here'" in an.check_dictionary(here, named)


def test_feature_ablation_comparison_matches_generation_under_the_edit(model):
    sae = dictionary()
    prompt = torch.randint(0, 40, (1, 7), generator=torch.Generator().manual_seed(6))
    out = an.feature_ablation_comparison(model, sae, prompt, 5, max_new_tokens=5)
    with an.feature_edit(model, sae, 5, 0.0):
        edited = model.generate(prompt, max_new_tokens=5)[0]
    assert out["tokens"].query("run == 'ablated'").token_id.tolist() == edited.tolist()
    assert out["tokens"].query("run == 'clean'").token_id.tolist() == model.generate(prompt, max_new_tokens=5)[0].tolist()
    assert "projection" not in out["tokens"]


@pytest.mark.parametrize("placement", ["sandwich", "reordered"])
def test_features_behind_an_output_norm_have_no_fixed_direction(placement):
    """Gemma's sandwich and OLMo 2's reordered blocks normalise a sublayer's output before the
    stream receives it: hook_z / mlp.hook_post features cannot be mapped through W_O / W_out."""
    from workbench.analysis.features import decoder_directions

    model = wb.HookedDecoder(tiny(d_vocab=40, norm="rmsnorm", norm_placement=placement)).eval()
    per_head = make_dictionary(DictionaryConfig(kind="relu", d_in=32, d_sae=8, hook_name="blocks.0.attn.hook_z",
                                                hook_shape=(4, 8)))
    with pytest.raises(ValueError, match="output norm"):
        decoder_directions(model, per_head)
    plain = wb.HookedDecoder(tiny(d_vocab=40)).eval()  # the pre-norm block: through W_O, head by head
    W = per_head.W_dec.detach().view(8, 4, 8)
    expected = torch.einsum("fhd,hdm->fm", W, plain.blocks[0].attn.W_O.detach())
    assert torch.allclose(decoder_directions(plain, per_head), expected, atol=1e-6)


def test_features_on_token_says_a_token_outside_the_vocabulary_is_not_in_it():
    from workbench.tokenizer import CharTokenizer, WordTokenizer

    words = WordTokenizer(["the", "cat", "sat", "on", "mat", "."])
    model = wb.HookedDecoder(tiny(d_vocab=words.vocab_size), tokenizer=words).eval()
    sae = dictionary()
    tokens = torch.tensor([words.encode("the cat sat on the mat .")] * 3)
    with pytest.raises(ValueError, match=r"'zzqqx' is not in this tokenizer's vocabulary \(7 tokens"):
        an.features_on_token(model, sae, tokens, "zzqqx")
    with pytest.raises(ValueError, match="does not occur in these 3 sequences"):  # in the vocabulary, not here
        an.features_on_token(model, sae, tokens[:, :3], "mat")
    chars = CharTokenizer("abc ")
    model = wb.HookedDecoder(tiny(d_vocab=chars.vocab_size), tokenizer=chars).eval()
    with pytest.raises(ValueError, match="'ab' is not one token of this tokenizer"):  # each character is known
        an.features_on_token(model, sae, torch.tensor([chars.encode("abc abc")]), "ab")
