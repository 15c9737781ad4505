"""Hugging Face interop at real-model terms: hub ids through huggingface_hub's cache, streamed
(sharded) safetensors in and out, bf16/fp16 against transformers in the same dtype, and one
clear error for each kind of broken input.

Nothing touches the network: hub ids resolve from a hub-style cache built in a temp dir
(``$HF_HOME/hub/models--org--name/snapshots/<rev>/`` with ``refs/main`` naming ``<rev>``) with
``HF_HUB_OFFLINE=1``, and a fixture makes any socket connection fail. The Hub's refusals
(gated, not found) are simulated with huggingface_hub's own error classes.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import hashlib
import json
import math
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers as T
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from factories import python_env
from test_interop import HF_CASES, VOCAB, build_hf, max_diff

import workbench as wb
from workbench.interop import HFImportError, UnsupportedHFConfig
from workbench.interop.streaming import check_placement, float32_weights

REPO = Path(__file__).resolve().parents[1]
TOL = 1e-4


@pytest.fixture(autouse=True)
def _no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise RuntimeError("network access attempted during an interop test")

    monkeypatch.setattr(socket.socket, "connect", refuse)


def keys_of(path: Path) -> dict:
    with safe_open(str(path), framework="pt") as f:
        return {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}


def save(hf, directory: Path, **kwargs) -> Path:
    hf.save_pretrained(directory, **kwargs)
    return directory


def logits_diff(hf, ours, tokens) -> float:
    with torch.no_grad():
        return max_diff(hf(tokens).logits, ours(tokens))


@pytest.fixture(scope="module")
def models():
    return {name: build_hf(*HF_CASES[name][:1], **HF_CASES[name][1]) for name in ("gpt2", "llama", "mixtral", "gpt_neox")}


# ---- what is on disk, and that the stream reads it -------------------------------------------
def test_on_disk_layouts_are_read_as_saved(models, tmp_path):
    """Mixtral's per-expert tensors, GPT-2's Conv1D [in, out], NeoX's fused qkv and embed_out, a
    tied head that is not in the file: the files hold these, and the import reproduces HF."""
    tokens = torch.randint(0, VOCAB, (2, 12))
    files = {name: keys_of(save(hf, tmp_path / name) / "model.safetensors") for name, hf in models.items()}
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in files["mixtral"]
    assert not any("gate_up_proj" in k for k in files["mixtral"])
    assert files["gpt2"]["transformer.h.0.attn.c_attn.weight"][0] == (32, 96)  # Conv1D: [in, 3 * out]
    assert "lm_head.weight" not in files["gpt2"]  # tied: the head is W_E
    assert files["gpt_neox"]["gpt_neox.layers.0.attention.query_key_value.weight"][0] == (96, 32)
    assert "embed_out.weight" in files["gpt_neox"]
    for name, hf in models.items():
        assert logits_diff(hf, wb.from_hf(tmp_path / name), tokens) <= TOL, name


def test_sharded_index_import_equals_single_file(models, tmp_path):
    hf = models["llama"]
    save(hf, tmp_path / "one")
    save(hf, tmp_path / "sharded", max_shard_size="20KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 3
    one, sharded = wb.from_hf(tmp_path / "one"), wb.from_hf(tmp_path / "sharded")
    for key, value in one.state_dict().items():
        assert torch.equal(sharded.state_dict()[key], value), key
    assert logits_diff(hf, sharded, torch.randint(0, VOCAB, (2, 12))) <= TOL


def test_directory_import_never_builds_a_transformers_model_or_unpickles(models, tmp_path, monkeypatch):
    directory = save(models["mixtral"], tmp_path / "m")
    expected = wb.from_hf(directory).state_dict()

    def forbidden(*args, **kwargs):
        raise AssertionError("a directory import must not build a transformers model or call torch.load")

    monkeypatch.setattr(T.PreTrainedModel, "__init__", forbidden)
    monkeypatch.setattr(torch, "load", forbidden)
    got = wb.from_hf(directory).state_dict()
    assert all(torch.equal(got[k], v) for k, v in expected.items())


def test_other_spellings_of_the_same_checkpoint(models, tmp_path):
    """A GPT-2 saved from GPT2Model (no ``transformer.`` prefix, as the hub's gpt2 is) with the old
    causal-mask buffers, and a NeoX head spelled ``lm_head``: the same weights, the same model."""
    hf = models["gpt2"]
    state = load_file(str(save(hf, tmp_path / "base") / "model.safetensors"))
    renamed = {k.removeprefix("transformer."): v for k, v in state.items()}
    renamed["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 24, 24))
    renamed["h.1.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(renamed, str(tmp_path / "base" / "model.safetensors"), metadata={"format": "pt"})
    assert logits_diff(hf, wb.from_hf(tmp_path / "base"), torch.randint(0, VOCAB, (2, 12))) <= TOL
    neox = models["gpt_neox"]
    state = load_file(str(save(neox, tmp_path / "neox") / "model.safetensors"))
    state["lm_head.weight"] = state.pop("embed_out.weight")
    save_file(state, str(tmp_path / "neox" / "model.safetensors"), metadata={"format": "pt"})
    assert logits_diff(neox, wb.from_hf(tmp_path / "neox"), torch.randint(0, VOCAB, (2, 12))) <= TOL


def test_weights_keep_hf_layout_and_same_dtype_cpu_imports_map_the_file(models, tmp_path):
    """Our weights are views in HF's memory layout (no transposing copy on import); in the file's
    dtype on the CPU they are the file's own pages; converted, they are fresh tensors."""
    directory = save(models["llama"], tmp_path)
    mapped = wb.from_hf(directory)  # the file is float32: same dtype
    W_in, W_Q = mapped.blocks[0].mlp.W_in, mapped.blocks[0].attn.W_Q
    assert not W_in.is_contiguous() and W_in.T.is_contiguous()  # up_proj.weight [d_mlp, d_model], seen as [d_model, d_mlp]
    assert W_Q.transpose(1, 2).is_contiguous()  # q_proj.weight reshaped [head, d_head, d_model]
    assert all(in_mapping(p, directory / "model.safetensors") for p in mapped.parameters())
    converted = wb.from_hf(directory, dtype=torch.bfloat16)
    assert converted.blocks[0].mlp.W_in.T.is_contiguous()
    assert not any(in_mapping(p, directory / "model.safetensors") for p in converted.parameters())


def test_imported_attention_reads_its_weights_in_place_and_equals_the_concatenated_path(models, tmp_path, monkeypatch):
    """Q/K/V weights in HF's layout are multiplied where they lie (three matmuls, no concatenated
    copy per call); the same weights made contiguous take the one-matmul path: same logits, and an
    edit through ``.data`` is seen by the next forward on both paths."""
    from workbench.components.attention import Attention

    mapped = wb.from_hf(save(models["llama"], tmp_path))
    copied = wb.from_hf(tmp_path)
    for block in copied.blocks:
        for name in ("W_Q", "_W_K", "_W_V"):
            getattr(block.attn, name).data = getattr(block.attn, name).data.contiguous()
    tokens = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        expected = copied(tokens)
        calls = []
        monkeypatch.setattr(Attention, "_fused_qkv_weight", lambda self, *a: calls.append(1) or 1 / 0)
        assert max_diff(mapped(tokens), expected) < 1e-5 and not calls  # in place: never concatenated
        monkeypatch.undo()
        for model in (mapped, copied):
            model.blocks[1].attn._W_V.data.mul_(0.5)
        assert max_diff(mapped(tokens), copied(tokens)) < 1e-5
        assert max_diff(mapped(tokens), expected) > 1e-3


def in_mapping(tensor, path: Path) -> bool:
    """Whether ``tensor``'s memory lies in a mapping of the file ``path`` (Linux's /proc/self/maps)."""
    if not Path("/proc/self/maps").exists():
        pytest.skip("reads /proc/self/maps (Linux)")
    ptr = tensor.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 6 and parts[-1] == str(path.resolve()):
            start, end = (int(x, 16) for x in parts[0].split("-"))
            if start <= ptr < end:
                return True
    return False


def test_built_model_import_copies_and_reads_fused_experts():
    hf = build_hf(*HF_CASES["mixtral"][:1], **HF_CASES["mixtral"][1])
    assert any(k.endswith("experts.gate_up_proj") for k in hf.state_dict())  # transformers 5 fuses in memory
    ours = wb.from_hf(hf)
    tokens = torch.randint(0, VOCAB, (2, 12))
    assert logits_diff(hf, ours, tokens) <= TOL
    before = ours(tokens)
    with torch.no_grad():
        hf.model.layers[0].mlp.experts.down_proj.zero_()  # the import is a copy: editing HF's leaves ours
        hf.model.embed_tokens.weight.zero_()
    assert torch.equal(ours(tokens), before)


# ---- dtypes -------------------------------------------------------------------------------------
def ulp(scale: float, dtype: torch.dtype) -> float:
    """The spacing of ``dtype`` numbers at magnitude ``scale``: what one rounding can move a logit."""
    return torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(scale))


def our_routing(model, tokens):
    """Each position's chosen experts in every layer ([batch, pos, layer * k], sorted), or None."""
    if model.cfg.ffn != "moe":
        return None
    _, cache = model.run_with_cache(tokens, names_filter=lambda n: n.endswith("hook_expert_indices"))
    moe_layers = range(model.cfg.moe_first_dense, model.cfg.n_layers)  # DeepSeek's first layers are dense
    return torch.cat([cache[f"blocks.{l}.mlp.hook_expert_indices"].sort(-1).values for l in moe_layers], -1)


def hf_routing(hf, tokens):
    if hf.config.model_type.startswith("deepseek"):  # grouped/biased choice: read the router's own top-k
        chosen = []
        gates = [m for name, m in hf.named_modules() if name.endswith("mlp.gate")]
        handles = [g.register_forward_hook(lambda mod, args, out: chosen.append(out[2])) for g in gates]
        try:
            hf(tokens)
        finally:
            for h in handles:
                h.remove()
        return torch.cat([c.sort(-1).values.reshape(*tokens.shape, -1) for c in chosen], -1) if chosen else None
    if not getattr(hf.config, "num_local_experts", None):
        return None
    k = hf.config.num_experts_per_tok
    logits = hf(tokens, output_router_logits=True).router_logits
    return torch.cat([r.topk(k, -1).indices.sort(-1).values.reshape(*tokens.shape, k) for r in logits], -1)


def same_routing(a, b, tokens):
    """Positions where two runs chose the same experts in every layer (all of them without MoE)."""
    if a is None:
        return torch.ones(tokens.shape, dtype=torch.bool, device=tokens.device)
    return (a == b).all(-1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", list(HF_CASES))
def test_low_precision_matches_transformers_in_the_same_dtype(name, dtype, tmp_path, device):
    """Ours in bf16/fp16 is close to fp32 (4 eps of the logit scale) and agrees with transformers
    in the same dtype to two roundings at the logit scale: the norms and softmax round where
    HF's do (with RMSNorm rounding once, after the weight, the Llama family was 3-4.5 roundings
    off in bf16). MoE: a router logit one rounding away flips a top-k choice, a different model
    from there on, so positions are compared where both runs chose the same experts (most do)."""
    config_class, kwargs = HF_CASES[name]
    hf32 = build_hf(config_class, **kwargs)
    save(hf32, tmp_path)
    hf_low = T.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype).to(device).eval()
    ours, ours32 = wb.from_hf(tmp_path, dtype=dtype, device=device), wb.from_hf(tmp_path, device=device)
    kept = float32_weights(ours)  # DeepSeek's router weights stay float32, as transformers keeps them
    assert {p.dtype for n, p in ours.named_parameters() if n not in kept} == {dtype} and ours.device.type == device.type
    tokens = torch.randint(0, VOCAB, (3, 20), device=device)
    with torch.no_grad():
        reference = hf32.to(device)(tokens).logits.float()
        theirs, mine = hf_low(tokens).logits.float(), ours(tokens).float()
        cached, _ = ours.run_with_cache(tokens)
        routes = our_routing(ours, tokens)
        as_hf, as_fp32 = same_routing(routes, hf_routing(hf_low, tokens), tokens), same_routing(routes, our_routing(ours32, tokens), tokens)
    assert as_hf.float().mean() >= 0.75 and as_fp32.float().mean() >= 0.75
    scale, eps = reference.abs().max().item(), torch.finfo(dtype).eps
    to_fp32, to_hf = max_diff(mine[as_fp32], reference[as_fp32]), max_diff(mine[as_hf], theirs[as_hf])
    print(f"\n[interop] {name} {dtype}: vs fp32 {to_fp32:.4f}, vs transformers {to_hf:.4f} (one ulp {ulp(scale, dtype):.4f}; "
          f"same routing at {as_hf.float().mean():.0%} of positions)")
    assert to_fp32 <= 4 * eps * scale
    assert to_hf <= 2 * ulp(scale, dtype) * (1 if device.type == "cpu" else 2)  # other kernels on a GPU
    assert max_diff(cached.float()[as_fp32], reference[as_fp32]) <= 4 * eps * scale


def test_bf16_cache_dtypes_and_buffers(models, tmp_path):
    ours = wb.from_hf(save(models["llama"], tmp_path), dtype="bfloat16")
    buffers = {name: b.dtype for name, b in ours.named_buffers()}
    assert all(dt == torch.bfloat16 for n, dt in buffers.items() if n.endswith(("b_O", "b_in", "b_out")))
    assert all(dt == torch.float32 for n, dt in buffers.items() if n.endswith("inv_freq"))
    _, cache = ours.run_with_cache(torch.randint(0, VOCAB, (1, 8)))
    assert cache["blocks.0.hook_resid_post"].dtype == torch.bfloat16
    assert cache["blocks.0.attn.hook_pattern"].dtype == torch.bfloat16
    assert cache["blocks.0.ln1.hook_scale"].dtype == torch.float32  # as TransformerLens keeps it


def test_processing_runs_in_fp32_then_casts(models, tmp_path):
    directory = save(models["gpt2"], tmp_path)
    plain = wb.from_hf(directory)
    processed = wb.from_hf(directory, fold_ln=True, center_writing_weights=True, dtype=torch.bfloat16)
    assert processed.cfg.folded_ln and processed.embed.W_E.dtype == torch.bfloat16
    tokens = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad():
        expected = plain(tokens).log_softmax(-1)
        got = processed(tokens).float().log_softmax(-1)
    assert max_diff(got, expected) <= 4 * torch.finfo(torch.bfloat16).eps * expected.abs().max().item()


def test_load_checkpoint_device_and_dtype(tmp_path):
    from factories import tiny

    model = wb.HookedDecoder(tiny(positional="rope", norm="rmsnorm", ffn="swiglu"))
    wb.save_checkpoint(model, tmp_path / "ck")
    tokens = torch.randint(0, model.cfg.d_vocab, (2, 10))
    for dtype in (torch.bfloat16, "float16"):
        loaded, _ = wb.load_checkpoint(tmp_path / "ck", device="cpu", dtype=dtype)
        want = check_placement("cpu", dtype)[1]
        assert {p.dtype for p in loaded.parameters()} == {want}
        with torch.no_grad():
            assert max_diff(loaded(tokens), model(tokens)) <= 4 * torch.finfo(want).eps * model(tokens).abs().max().item()
    processed, _ = wb.load_checkpoint(tmp_path / "ck", dtype=torch.bfloat16, fold_ln=True)
    assert processed.cfg.folded_ln and processed.embed.W_E.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype=torch.int8"):
        wb.load_checkpoint(tmp_path / "ck", dtype=torch.int8)


# ---- export -------------------------------------------------------------------------------------
def test_export_streams_sharded_safetensors_with_an_index(models, tmp_path):
    ours = wb.from_hf(save(models["mixtral"], tmp_path / "in"))
    wb.to_hf(ours, tmp_path / "out", max_shard_size="16KiB")
    out = tmp_path / "out"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and not (out / "model.safetensors").exists()
    assert all((out / s).stat().st_size <= 16 * 1024 + 4096 for s in shards)  # header aside, within the limit
    on_disk = {k for s in shards for k in keys_of(out / s)}
    assert on_disk == set(index["weight_map"])
    assert "model.layers.1.block_sparse_moe.experts.2.w3.weight" in on_disk  # the layout transformers saves
    assert index["metadata"]["total_size"] == sum(p.numel() * 4 for p in ours.parameters())
    back = T.AutoModelForCausalLM.from_pretrained(out).eval()
    assert logits_diff(back, ours, torch.randint(0, VOCAB, (2, 12))) <= TOL
    again = wb.from_hf(out)
    assert all(torch.equal(again.state_dict()[k], v) for k, v in ours.state_dict().items())
    manifest = json.loads((out / "workbench.json").read_text())
    assert set(shards) | {"model.safetensors.index.json", "config.json"} <= set(manifest["files"])


def test_export_in_bf16(models, tmp_path):
    ours = wb.from_hf(save(models["gpt2"], tmp_path / "in"))
    wb.to_hf(ours, tmp_path / "out", dtype=torch.bfloat16)
    assert {dt for _, dt in keys_of(tmp_path / "out" / "model.safetensors").values()} == {"BF16"}
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    back = T.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert back.dtype == torch.bfloat16
    low = wb.from_hf(tmp_path / "out", dtype=torch.bfloat16)
    tokens = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad():
        assert max_diff(back(tokens).logits, low(tokens)) <= ulp(back(tokens).logits.abs().max().item(), torch.bfloat16)
    with pytest.raises(ValueError, match="max_shard_size"):
        wb.to_hf(ours, tmp_path / "bad", max_shard_size="lots")
    assert not (tmp_path / "bad").exists()


# ---- hub ids ------------------------------------------------------------------------------------
@pytest.fixture
def hf_home(tmp_path, monkeypatch):
    """An empty, offline HF_HOME. huggingface_hub reads these variables once, at import, so its
    constants are set as well; the subprocess test below sets only the environment."""
    import huggingface_hub.constants as C

    home = tmp_path / "hf_home"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(C, "HF_HOME", str(home))
    monkeypatch.setattr(C, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(C, "HF_HUB_OFFLINE", True)
    return home


def cache_repo(home: Path, repo_id: str, source: Path, rev: str = "a" * 40, refs=("main",)) -> Path:
    """Lay ``source``'s files out as huggingface_hub's cache does: content-addressed blobs, and a
    snapshot folder of symlinks named by the commit that refs/<ref> holds."""
    repo = home / "hub" / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / rev
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for f in sorted(source.iterdir()):
        blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, blob)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(rev)
    return snapshot


def test_hub_id_resolves_from_the_cache_offline(models, hf_home, tmp_path):
    from test_interop import _llama_style_tokenizer

    directory = save(models["llama"], tmp_path / "src", max_shard_size="20KB")
    _llama_style_tokenizer().save_pretrained(directory)
    snapshot = cache_repo(hf_home, "tiny-org/tiny-llama", directory, refs=("main", "v1"))
    ours = wb.from_hf("tiny-org/tiny-llama", dtype=torch.bfloat16)
    local = wb.from_hf(directory, dtype=torch.bfloat16)
    assert all(torch.equal(ours.state_dict()[k], v) for k, v in local.state_dict().items())
    assert ours.tokenizer is not None and ours.to_tokens("the cat").tolist() == local.to_tokens("the cat").tolist()
    assert ours.cfg.name == "tiny-org/tiny-llama" and ours.cfg.replace(name="") == local.cfg.replace(name="")
    assert wb.from_hf("tiny-org/tiny-llama", revision="v1").cfg == ours.cfg
    assert snapshot.is_dir()


@pytest.mark.parametrize("repo_id, revision, needle", [
    ("tiny-org/not-cached", None, "not in the Hugging Face cache"),
    ("tiny-org/tiny-llama", "v2", "not in the Hugging Face cache"),
])
def test_hub_id_not_cached_offline_is_one_clear_error(models, hf_home, tmp_path, repo_id, revision, needle):
    cache_repo(hf_home, "tiny-org/tiny-llama", save(models["llama"], tmp_path / "src"))
    with pytest.raises(HFImportError, match=needle) as err:
        wb.from_hf(repo_id, revision=revision)
    assert repo_id in str(err.value) and "HF_HUB_OFFLINE" in str(err.value)


def _hub_error(kind: str):
    """huggingface_hub's own exception for a gated / missing repository. Built without its HTTP
    response (whose class changed between huggingface_hub versions): only the type is used."""
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    cls = {"gated": GatedRepoError, "missing": RepositoryNotFoundError}[kind]
    error = cls.__new__(cls)
    Exception.__init__(error, f"{kind}: https://huggingface.co/api/models/meta-llama/Llama-3.1-8B")
    return error


@pytest.mark.parametrize("kind, needle", [("gated", r"gated repository.*huggingface\.co/meta-llama/Llama-3\.1-8B.*token"),
                                          ("missing", "no model repository 'meta-llama/Llama-3.1-8B'")])
def test_hub_refusals_are_one_clear_error(kind, needle, monkeypatch):
    import huggingface_hub

    def refuse(*args, **kwargs):
        raise _hub_error(kind)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    with pytest.raises(HFImportError, match=needle):
        wb.from_hf("meta-llama/Llama-3.1-8B", dtype=torch.bfloat16)


def test_import_hf_cli_reads_the_hub_cache_from_the_environment(models, tmp_path):
    """The real thing: HF_HOME and HF_HUB_OFFLINE set before Python starts, a hub id on the command line."""
    home = tmp_path / "home"
    cache_repo(home, "tiny-org/tiny-neox", save(models["gpt_neox"], tmp_path / "src"))
    env = python_env(HF_HOME=str(home), HF_HUB_OFFLINE="1")
    env.pop("HF_HUB_CACHE", None)
    out = tmp_path / "ck"
    run = subprocess.run([sys.executable, "-m", "workbench", "import-hf", "tiny-org/tiny-neox", "--out", str(out),
                          "--dtype", "bfloat16"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "tiny-org/tiny-neox" in run.stdout and "bfloat16" in run.stdout
    assert {dt for _, dt in keys_of(out / "model.safetensors").values()} == {"BF16"}
    meta = json.loads((out / "meta.json").read_text())
    assert meta["hf_family"] == "gpt_neox" and meta["imported_from"] == "tiny-org/tiny-neox"
    loaded, _ = wb.load_checkpoint(out, dtype=torch.bfloat16)
    assert loaded.cfg.name == "tiny-org/tiny-neox"  # the id, not the snapshot's path
    local = wb.from_hf(tmp_path / "src", dtype=torch.bfloat16)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in local.state_dict().items())
    run = subprocess.run([sys.executable, "-m", "workbench", "import-hf", "tiny-org/absent", "--out", str(tmp_path / "x")],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert run.returncode != 0 and "tiny-org/absent" in run.stderr and "Traceback" not in run.stderr
    assert not (tmp_path / "x").exists()


def test_app_checkpoint_box_takes_a_hub_id(models, hf_home, tmp_path):
    from ui import common

    cache_repo(hf_home, "tiny-org/tiny-gpt2", save(models["gpt2"], tmp_path / "src"))

    class Where:
        def __init__(self):
            self.errors = []

        def error(self, message):
            self.errors.append(message)

    where = Where()
    ckpt = common.load("tiny-org/tiny-gpt2", where=where)
    assert where.errors == [] and ckpt is not None and ckpt.name == "tiny-org/tiny-gpt2"
    assert logits_diff(models["gpt2"], ckpt.model, torch.randint(0, VOCAB, (2, 8))) <= TOL
    assert common.load("tiny-org/absent", where=where) is None
    assert "tiny-org/absent" in where.errors[-1] and "HF_HUB_OFFLINE" in where.errors[-1]


# ---- bad input: one clear error each, nothing half-written --------------------------------------
def _import_cli(source, out):
    import argparse

    from workbench.interop import cli

    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["import-hf", str(source), "--out", str(out)])
    return args.func(args)


def _nothing_written(out: Path) -> bool:
    return not out.exists() and not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")
                                     and not p.name.endswith(".lock")]


def test_truncated_shard_is_named_and_nothing_is_written(models, tmp_path):
    directory = save(models["llama"], tmp_path / "hf", max_shard_size="20KB")
    shard = sorted(directory.glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(HFImportError, match=rf"{shard.name} is truncated or corrupt"):
        _import_cli(directory, tmp_path / "ck")
    assert _nothing_written(tmp_path / "ck")


def test_index_naming_a_missing_shard(models, tmp_path):
    directory = save(models["llama"], tmp_path / "hf", max_shard_size="20KB")
    shard = sorted(directory.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(HFImportError, match=rf"names shard {shard.name} .* is missing"):
        wb.from_hf(directory)
    (directory / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(HFImportError, match="model.safetensors.index.json is not a valid safetensors index"):
        wb.from_hf(directory)


def test_pickled_weights_only_are_refused_unread(models, tmp_path, monkeypatch):
    directory = tmp_path / "bin"
    models["gpt2"].config.save_pretrained(directory)
    (directory / "pytorch_model.bin").write_bytes(b"not read: a pickle could run code")
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load called"))
    with pytest.raises(HFImportError, match="holds pytorch_model.bin and no safetensors weights; .*never unpickles"):
        wb.from_hf(directory)


def test_weights_that_do_not_match_the_config_are_named(models, tmp_path):
    directory = save(models["llama"], tmp_path / "hf")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "intermediate_size": 48}))
    with pytest.raises(HFImportError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight in model\.safetensors has shape \[40, 32\], but config\.json implies \[48, 32\]"):
        wb.from_hf(directory)
    (directory / "config.json").write_text(json.dumps(config))
    state = load_file(str(directory / "model.safetensors"))
    state["model.layers.0.self_attn.q_norm.weight"] = torch.ones(8)  # a Qwen3-style QK-norm
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(HFImportError, match=r"q_norm\.weight in model\.safetensors, which the imported llama config has no place for"):
        wb.from_hf(directory)
    del state["model.layers.0.self_attn.q_norm.weight"], state["model.layers.1.self_attn.o_proj.weight"]
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(HFImportError, match=r"no tensor model\.layers\.1\.self_attn\.o_proj\.weight"):
        wb.from_hf(directory)


def test_unsupported_model_type_fails_before_the_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba", "hidden_size": 8}))
    with pytest.raises(UnsupportedHFConfig, match="model_type='mamba'"):
        wb.from_hf(tmp_path)


@pytest.mark.parametrize("device, dtype, needle", [
    ("cpu", torch.int8, r"dtype=torch\.int8 is not supported; choose one of float32, bfloat16, float16"),
    ("cpu", "float8", "dtype='float8' is not supported"),
    ("tpu:0", torch.float32, "device='tpu:0' is not a torch device"),
])
def test_bad_device_or_dtype_is_named(device, dtype, needle):
    with pytest.raises(HFImportError, match=needle):
        wb.from_hf("unused/never-resolved", device=device, dtype=dtype)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without a GPU gives")
def test_cuda_without_a_gpu_is_named():
    with pytest.raises(HFImportError, match=r"device='cuda' but this machine has no CUDA GPU"):
        wb.from_hf("unused/never-resolved", device="cuda")


def test_bf16_on_a_gpu_without_it_is_named(monkeypatch):
    """A pre-Ampere GPU (simulated: this machine may have none) has no native bfloat16."""
    for name, value in {"is_available": True, "device_count": 1, "current_device": 0, "is_bf16_supported": False,
                        "get_device_name": "Tesla T4", "get_device_capability": (7, 5)}.items():
        monkeypatch.setattr(torch.cuda, name, lambda *a, v=value, **k: v)
    with pytest.raises(HFImportError, match=r"bfloat16 is not supported natively on Tesla T4 .*7\.5.*float16"):
        check_placement("cuda", torch.bfloat16, HFImportError)


# ---- memory ---------------------------------------------------------------------------------------
def peak_rss_code() -> str:
    """Python that prints this process's peak RSS in bytes. VmHWM, not getrusage's ru_maxrss: a
    child's ru_maxrss starts at its parent's RSS at fork (Linux keeps it across exec), which
    here would count the test process's own model."""
    return ("int(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1]) * 1024")


@pytest.mark.slow
def test_import_peak_memory_is_about_one_model(tmp_path):
    """A 100M-parameter Llama (bf16 on disk) imported in float32 in a fresh process: the peak RSS
    rises by at most 1.3x the model's float32 bytes (the weights plus about one tensor in flight).
    A tiny model of the same family is imported first, so the code transformers and the
    workbench load on first use is not counted as weights."""
    shape = dict(n_heads=8, n_kv_heads=4, n_ctx=64, norm="rmsnorm", positional="rope", ffn="swiglu", bias=False,
                 tie_embeddings=False)
    big = wb.ModelConfig(d_model=1024, n_layers=8, d_mlp=2816, d_vocab=4096, **shape)
    small = wb.ModelConfig(d_model=32, n_layers=2, d_mlp=48, d_vocab=64, **shape)
    for name, cfg in (("big", big), ("small", small)):
        wb.to_hf(wb.HookedDecoder(cfg), tmp_path / name, dtype=torch.bfloat16, max_shard_size="100MB")
    code = (
        "import torch, workbench as wb\n"
        f"wb.from_hf({str(tmp_path / 'small')!r})\n"
        "before = int(open('/proc/self/statm').read().split()[1]) * 4096\n"
        f"m = wb.from_hf({str(tmp_path / 'big')!r}, dtype=torch.float32)\n"
        f"print(before, {peak_rss_code()}, sum(p.numel() * p.element_size() for p in m.parameters()))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=python_env())
    assert run.returncode == 0, run.stderr
    before, peak, model_bytes = map(int, run.stdout.split()[-3:])
    rise = peak - before
    print(f"\n[interop] import peak RSS rise {rise / 2**20:.0f} MiB for {model_bytes / 2**20:.0f} MiB of weights "
          f"({rise / model_bytes:.2f}x)")
    assert model_bytes > 350 * 2**20 and rise <= 1.3 * model_bytes
