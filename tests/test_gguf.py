"""GGUF import: small random models written here as GGUF files, opened, and checked against transformers.

Each file is written the way llama.cpp's convert_hf_to_gguf.py writes one: tensor names from the
``gguf`` package's own HF -> GGUF name map, Llama's Q and K rows permuted by llama.cpp's
``permute``, 1-D tensors (norms, biases) kept in F32, 2-D ones quantized. The reference is the
transformers model of the same config holding exactly the weights the file holds (each 2-D weight
quantized and dequantized by ``gguf``), so the comparison checks the names, the permutation, the
config and the dequantization path, not the quantization error. As a check on the writer itself,
transformers' own GGUF loader reads the F32 file of each architecture and must agree with it too.

Q4_K and Q6_K: ``gguf`` 0.19 cannot quantize them (``quants.quantize`` raises NotImplementedError),
so their files hold random blocks with sane scales, and the reference weights are ``gguf``'s
dequantization of those blocks.
"""

import hashlib
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (requirements.txt lists it)")
import transformers as T  # noqa: E402
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

import workbench as wb  # noqa: E402
from workbench.interop.gguf import HASHES_FILE, GGUFImportError, cache_dir_for, open_gguf  # noqa: E402

TOL = 1e-4  # fp32, relative to the largest logit
# d_model and d_mlp multiples of 256: K-quant blocks are 256 values long
SMALL = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             intermediate_size=512, vocab_size=260, max_position_embeddings=64, rms_norm_eps=1e-5,
             bos_token_id=256, eos_token_id=257, pad_token_id=None, tie_word_embeddings=False)
ARCHES = {  # GGUF architecture -> (HF config class, its extra fields)
    "llama": (T.LlamaConfig, dict(rope_theta=10000.0)),
    "qwen2": (T.Qwen2Config, dict(rope_theta=1000000.0)),
    "qwen3": (T.Qwen3Config, dict(rope_theta=1000000.0)),
    "olmo2": (T.Olmo2Config, dict(rope_theta=500000.0)),
    "phi3": (T.Phi3Config, dict(rope_theta=10000.0)),
    "gpt2": (T.GPT2Config, dict(n_embd=256, n_layer=2, n_head=4, n_inner=512, vocab_size=260, n_positions=64,
                                bos_token_id=256, eos_token_id=257, tie_word_embeddings=True)),
}
GPT2_TRANSPOSED = (".c_attn.weight", ".c_proj.weight", ".c_fc.weight")  # llama.cpp's GPT2Model transposes Conv1D
QUANTS = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")  # what the issue names


def _hf_model(arch: str, seed: int = 0, **overrides) -> torch.nn.Module:
    if arch == "gpt2" and "tie_word_embeddings" not in overrides:
        overrides["tie_word_embeddings"] = False
    cls, extra = ARCHES[arch]
    if arch == "gpt2":
        cfg = cls(**{**extra, **overrides})
    else:
        cfg = cls(**{**SMALL, **extra, **overrides})
        cfg.rope_parameters = {"rope_type": "default", "rope_theta": extra["rope_theta"]}
    torch.manual_seed(seed)
    model = T.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:  # norms and biases away from their trivial init
                p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.05)
    return model


# K-quant blocks (256 values): their size and where their f16 super-block scales lie, per ggml's structs
_K_BLOCKS = {Q.Q2_K: (84, 80), Q.Q3_K: (110, 108), Q.Q4_K: (144, 0), Q.Q5_K: (176, 0), Q.Q6_K: (210, 208)}


def _random_k_blocks(rows: int, cols: int, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks whose f16 scales are small and finite (random bytes could be NaN)."""
    block_bytes, at = _K_BLOCKS[qtype]
    data = rng.integers(0, 256, size=(rows, cols // 256, block_bytes), dtype=np.uint8)
    n_scales = 2 if qtype in (Q.Q2_K, Q.Q4_K, Q.Q5_K) else 1  # d and dmin, or d alone
    scales = rng.uniform(0.0005, 0.002, size=(rows, cols // 256, n_scales)).astype(np.float16).view(np.uint8)
    data[..., at:at + 2 * n_scales] = scales
    return data.reshape(rows, -1)


def _llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (n_head already the KV head count for K)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _bpe_vocab() -> tuple[list[str], list[str]]:
    """A byte-level vocabulary: the 256 byte symbols, <s>, </s>, and two merged tokens."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    symbols = list(bytes_to_unicode().values())
    space = bytes_to_unicode()[ord(" ")]
    return symbols + ["<s>", "</s>", f"{space}t", f"{space}th"], [f"{space} t", f"{space}t h"]


def write_gguf(path: Path, model: torch.nn.Module, arch: str, qtype: str, *, seed: int = 0,
               add_bos: bool = False, tensor_type_override: dict | None = None, edit=None) -> torch.nn.Module:
    """Write ``model`` as a GGUF of ``arch`` with 2-D weights in ``qtype``; load into ``model`` the weights
    the file holds (dequantized), so it is the reference. Returns ``model``."""
    cfg = model.config
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.n_inner if arch == "gpt2" else cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    if arch == "gpt2":
        writer.add_layer_norm_eps(cfg.layer_norm_epsilon)
    else:
        writer.add_head_count_kv(cfg.num_key_value_heads)
        writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
        writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
        writer.add_rope_dimension_count(cfg.head_dim)
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    tokens, merges = _bpe_vocab()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 256 + [3, 3] + [1, 1])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(256)
    writer.add_eos_token_id(257)
    writer.add_add_bos_token(add_bos)
    writer.add_pad_token_id(257)  # else transformers' Phi-3 reader assumes Phi-3's 32000, past this vocabulary
    if edit is not None:
        edit(writer)
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.upper()), cfg.num_hidden_layers)
    state = model.state_dict()
    held = {}
    for hf_name, tensor in state.items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if hf_name.endswith((".attn.bias", ".attn.masked_bias")):  # GPT-2's causal-mask buffers
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        w = tensor.float().numpy()
        transposed = arch == "gpt2" and hf_name.endswith(GPT2_TRANSPOSED)
        if transposed:
            w = np.ascontiguousarray(w.T)
        if arch == "llama" and name.endswith("attn_q.weight"):
            w = _llama_permute(w, cfg.num_attention_heads)
        elif arch == "llama" and name.endswith("attn_k.weight"):
            w = _llama_permute(w, cfg.num_key_value_heads)
        kind = Q[(tensor_type_override or {}).get(name, qtype if w.ndim == 2 else "F32")]
        if kind in _K_BLOCKS:
            data = _random_k_blocks(*w.shape, kind, rng)
        else:
            data = quantize(w, kind)
        # llama.cpp's GPT2Model writes the (tied) embedding a second time as the output matrix
        for written in (name, "output.weight") if (arch == "gpt2" and name == "token_embd.weight"
                                                   and cfg.tie_word_embeddings) else (name,):
            if kind in (Q.F32, Q.F16):
                writer.add_tensor(written, data)
            else:
                writer.add_tensor(written, data, raw_shape=data.shape, raw_dtype=kind)
        try:
            stored = dequantize(data, kind).reshape(w.shape).astype(np.float32)
        except NotImplementedError:
            stored = w
        if arch == "llama" and (name.endswith("attn_q.weight") or name.endswith("attn_k.weight")):
            n = cfg.num_attention_heads if name.endswith("attn_q.weight") else cfg.num_key_value_heads
            stored = stored.reshape(n, stored.shape[0] // n // 2, 2, -1).swapaxes(1, 2).reshape(stored.shape)
        held[hf_name] = torch.from_numpy((stored.T if transposed else stored).copy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    model.load_state_dict(held, strict=False)
    return model


def _check_logits(ours: torch.nn.Module, hf: torch.nn.Module, tokens: torch.Tensor, tol: float = TOL) -> float:
    with torch.no_grad():
        expected = hf(tokens).logits
        got = ours(tokens)
    got = getattr(got, "logits", got)
    err = float((got - expected).abs().max() / expected.abs().max())
    assert err <= tol, f"max logit difference {err:.2e} relative to the largest logit (tolerance {tol})"
    return err


TOKENS = torch.tensor([[256, 5, 77, 200, 3, 259, 120, 44, 9, 255, 1, 60]])


@pytest.mark.parametrize("arch", list(ARCHES))
@pytest.mark.parametrize("qtype", QUANTS)
def test_gguf_matches_transformers(tmp_path, arch, qtype):
    _check_gguf(tmp_path, arch, qtype)


@pytest.mark.parametrize("qtype", ["Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q5_K"])
def test_other_quantizations_read(tmp_path, qtype):
    """The rest of what the workbench accepts, on one architecture."""
    _check_gguf(tmp_path, "llama", qtype)


def _check_gguf(tmp_path, arch, qtype):
    hf = _hf_model(arch, tie_word_embeddings=(qtype == "Q8_0"))  # one quantization covers tied embeddings
    path = tmp_path / f"tiny-{arch}.{qtype}.gguf"
    write_gguf(path, hf, arch, qtype)
    model = open_gguf(path, cache=tmp_path / "cache")
    assert model.cfg.d_model == 256 and model.cfg.n_kv_heads == (4 if arch == "gpt2" else 2)
    assert model.cfg.tie_embeddings == (qtype == "Q8_0")
    err = _check_logits(model, hf, TOKENS)
    print(f"{arch} {qtype}: {err:.1e}")


# transformers 5 has no GGUF loader for OLMo 2; its files follow llama.cpp's Olmo2Model (a plain
# TextModel: gguf's name map, no permutation), which the writer mirrors
@pytest.mark.parametrize("arch", [a for a in ARCHES if a != "olmo2"])
def test_writer_agrees_with_transformers_gguf_loader(tmp_path, arch):
    """The files above are read by transformers' own GGUF loader as the reference model: the writer
    follows llama.cpp's conventions (names, Llama's permutation), so the test above tests something."""
    # transformers' reader ignores a Qwen3 file's attention.key_length and takes Qwen3Config's default
    # head_dim, 128: give it a model with that head size. Its GPT-2 reader likewise takes GPT2Config's
    # defaults for n_inner (4 * n_embd) and n_positions (1024)
    heads = {"qwen3": dict(num_attention_heads=2, num_key_value_heads=1, head_dim=128),
             "gpt2": dict(n_inner=1024, n_positions=1024)}.get(arch, {})
    hf = write_gguf(tmp_path / "m.gguf", _hf_model(arch, **heads), arch, "F32")
    theirs = T.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf", dtype=torch.float32).eval()
    _check_logits(theirs, hf, TOKENS, tol=1e-5)
    _check_logits(open_gguf(tmp_path / "m.gguf", cache=False), theirs, TOKENS, tol=1e-5)


@pytest.mark.parametrize("add_bos", [False, True])
def test_tokenizer_and_bos_follow_the_file(tmp_path, add_bos):
    write_gguf(tmp_path / "m.gguf", _hf_model("llama"), "llama", "F32", add_bos=add_bos)
    model = open_gguf(tmp_path / "m.gguf", cache=tmp_path / "cache")
    theirs = T.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="m.gguf")
    for text in ("the cat", " th th", "héllo\nworld"):
        assert model.to_tokens(text)[0].tolist() == theirs(text)["input_ids"]
    assert (model.to_tokens("the")[0, 0].item() == 256) == add_bos
    assert model.to_str_tokens(" th")[-1] == " th"
    again = open_gguf(tmp_path / "m.gguf", cache=tmp_path / "cache")  # from the cache: the same tokenizer
    assert again.to_tokens(" th th")[0].tolist() == theirs(" th th")["input_ids"]


def test_cache_is_written_once_and_reused(tmp_path):
    hf = write_gguf(tmp_path / "m.gguf", _hf_model("qwen2"), "qwen2", "Q8_0")
    first = open_gguf(tmp_path / "m.gguf", cache=tmp_path / "cache")
    target = cache_dir_for(tmp_path / "m.gguf", tmp_path / "cache")
    assert (target / "meta.json").is_file()
    stamp = (target / "model.safetensors").stat().st_mtime_ns
    second = open_gguf(tmp_path / "m.gguf", cache=tmp_path / "cache", dtype="bfloat16")
    assert (target / "model.safetensors").stat().st_mtime_ns == stamp  # read, not converted again
    assert second.embed.W_E.dtype == torch.bfloat16
    assert torch.equal(second.embed.W_E, first.embed.W_E.to(torch.bfloat16))
    _check_logits(first, hf, TOKENS)


def test_an_unwritable_cache_warns_and_opens_the_file_anyway(tmp_path):
    hf = write_gguf(tmp_path / "m.gguf", _hf_model("qwen3"), "qwen3", "Q4_0")
    (tmp_path / "file").write_text("a file where the cache folder would go")
    with pytest.warns(UserWarning, match="cannot be written"):
        model = open_gguf(tmp_path / "m.gguf", cache=tmp_path / "file" / "cache")
    _check_logits(model, hf, TOKENS)


# ---- bad input ----------------------------------------------------------------------------------

def _cache_entries(cache: Path) -> list[str]:
    """Folders and files in the cache other than lock files (released locks are removed anyway) and
    the record of the files' hashes (written when a file is first named, before it is read)."""
    return sorted(p.name for p in cache.iterdir()
                  if not p.name.endswith(".lock") and p.name != HASHES_FILE) if cache.exists() else []


def test_unsupported_architecture_is_named(tmp_path):
    path = tmp_path / "g.gguf"
    writer = gguf.GGUFWriter(str(path), "gptneox")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFImportError, match=r"architecture 'gptneox' is not supported.*'llama'"):
        open_gguf(path, cache=tmp_path / "cache")
    assert _cache_entries(tmp_path / "cache") == []
    path = tmp_path / "l.gguf"  # a supported architecture whose hyperparameters are missing
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFImportError, match=r"metadata key llama\.embedding_length is missing"):
        open_gguf(path, cache=tmp_path / "cache")


def test_unsupported_quantization_is_named(tmp_path):
    hf = _hf_model("llama")
    path = tmp_path / "m.gguf"
    # IQ4_NL: 32 values in 18 bytes; gguf writes it, the workbench refuses it by name
    original = quantize
    try:
        globals()["quantize"] = lambda w, kind: (np.zeros((w.shape[0], w.shape[1] // 32 * 18), dtype=np.uint8)
                                                  if kind == Q.IQ4_NL else original(w, kind))
        write_gguf(path, hf, "llama", "F32", tensor_type_override={"blk.1.ffn_up.weight": "IQ4_NL"})
    finally:
        globals()["quantize"] = original
    with pytest.raises(GGUFImportError, match=r"quantization IQ4_NL \(e\.g\. tensor 'blk\.1\.ffn_up\.weight'\)"):
        open_gguf(path, cache=tmp_path / "cache")
    assert _cache_entries(tmp_path / "cache") == []


@pytest.mark.parametrize("edit, match", [
    (lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR), r"RoPE scaling \(rope\.scaling\.type='linear'\)"),
    (lambda w: w.add_expert_count(4), r"mixture-of-experts GGUF \(llama\.expert_count=4\)"),
    (lambda w: w.add_tensor("rope_freqs.weight", np.ones(32, dtype=np.float32)), "rope_freqs tensor"),
])
def test_unsupported_settings_are_named(tmp_path, edit, match):
    write_gguf(tmp_path / "m.gguf", _hf_model("llama"), "llama", "F32", edit=edit)
    with pytest.raises(GGUFImportError, match=match):
        open_gguf(tmp_path / "m.gguf", cache=tmp_path / "cache")
    assert _cache_entries(tmp_path / "cache") == []


@pytest.mark.parametrize("keep", [0.5, 0.999, 0.01])
def test_truncated_file_fails_clearly_and_leaves_no_cache(tmp_path, keep):
    path = tmp_path / "m.gguf"
    write_gguf(path, _hf_model("llama"), "llama", "Q4_0")
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(GGUFImportError, match="truncated or corrupt"):
        open_gguf(path, cache=tmp_path / "cache")
    assert _cache_entries(tmp_path / "cache") == []


def test_not_a_gguf_and_corrupt_values(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(GGUFImportError, match="is not a GGUF file"):
        open_gguf(tmp_path / "x.gguf", cache=tmp_path / "cache")
    with pytest.raises(GGUFImportError, match="no GGUF file"):
        open_gguf(tmp_path / "missing.gguf", cache=tmp_path / "cache")
    path = tmp_path / "m.gguf"
    write_gguf(path, _hf_model("llama"), "llama", "F32")
    data = bytearray(path.read_bytes())
    data[-64:] = np.full(16, np.nan, dtype=np.float32).tobytes()  # the last tensor's last values
    path.write_bytes(bytes(data))
    with pytest.raises(GGUFImportError, match="non-finite"):
        open_gguf(path, cache=tmp_path / "cache")
    assert _cache_entries(tmp_path / "cache") == []


def test_two_processes_converting_at_once_give_one_cache(tmp_path):
    hf = write_gguf(tmp_path / "m.gguf", _hf_model("llama"), "llama", "Q4_1")
    script = (
        "import sys, torch, workbench as wb\n"
        "m = wb.open_gguf(sys.argv[1], cache=sys.argv[2])\n"
        "print(repr(m(torch.tensor([[5, 77, 200, 3]]))[0, -1, :4].tolist()))\n"
    )
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    procs = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "m.gguf"), str(tmp_path / "cache")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
    assert outs[0][0] == outs[1][0]
    target = cache_dir_for(tmp_path / "m.gguf", tmp_path / "cache")
    assert _cache_entries(tmp_path / "cache") == [target.name]  # one entry, no temporary folder left
    _check_logits(open_gguf(tmp_path / "m.gguf", cache=tmp_path / "cache"), hf, TOKENS)


def test_cli_open_gguf(tmp_path, capsys):
    from workbench.__main__ import main

    write_gguf(tmp_path / "m.gguf", _hf_model("llama"), "llama", "Q8_0")
    assert main(["open-gguf", str(tmp_path / "m.gguf"), "--prompt", " th", "--top", "3",
                 "--cache", str(tmp_path / "cache")]) == 0
    out = capsys.readouterr().out
    assert "converted into the cache" in out and out.count(" p=") == 3
    assert main(["open-gguf", str(tmp_path / "m.gguf"), "--cache", str(tmp_path / "cache")]) == 0
    assert "from the cache" in capsys.readouterr().out
    assert main(["open-gguf", str(tmp_path / "nope.gguf")]) == 2


def test_top_level_names():
    assert wb.open_gguf is open_gguf and issubclass(wb.GGUFImportError, ValueError)


def test_the_content_hash_is_kept_per_file_version_and_a_changed_file_is_hashed_again(tmp_path, monkeypatch):
    """``cache_dir_for`` hashed the whole file on every call (0.4 s for SmolLM2's 98 MB, on every
    ``open_pretrained``); it now keeps the hash by (resolved path, size, mtime_ns), in this process and
    in the cache's hash record, and a rewritten file gets a new hash."""
    from workbench.interop import gguf as g

    path, cache = tmp_path / "m.gguf", tmp_path / "cache"
    path.write_bytes(b"GGUF one version")
    hashed = []
    real = g._sha256
    monkeypatch.setattr(g, "_sha256", lambda p: hashed.append(p) or real(p))
    monkeypatch.setattr(g, "_HASHES", {})
    first = cache_dir_for(path, cache)
    assert first.name == f"m-{hashlib.sha256(b'GGUF one version').hexdigest()[:16]}-v{g.CONVERTER_VERSION}"
    assert cache_dir_for(tmp_path / "." / "m.gguf", cache) == first and len(hashed) == 1  # this process
    monkeypatch.setattr(g, "_HASHES", {})  # as a new process: the record in the cache answers
    assert cache_dir_for(path, cache) == first and len(hashed) == 1
    record = json.loads((cache / HASHES_FILE).read_text())
    assert record[str(path.resolve())]["sha256"] == hashlib.sha256(b"GGUF one version").hexdigest()
    stat = path.stat()
    path.write_bytes(b"GGUF two version")  # the same size: the new modification time tells
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    second = cache_dir_for(path, cache)
    assert len(hashed) == 2 and second.name.split("-")[1] == hashlib.sha256(b"GGUF two version").hexdigest()[:16]
    path.write_bytes(b"GGUF three, longer")  # a new size
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))  # even with the last mtime
    assert cache_dir_for(path, cache) not in (first, second) and len(hashed) == 3
    (cache / HASHES_FILE).write_text("not json")  # a damaged record is hashed over, not trusted
    monkeypatch.setattr(g, "_HASHES", {})
    assert cache_dir_for(path, cache).name.split("-")[1] == hashlib.sha256(b"GGUF three, longer").hexdigest()[:16]
    assert len(hashed) == 4
