"""ActivationStore: collected rows equal run_with_cache's, the position rule, resume after a kill
without duplicates, streaming that is a pure function of (seed, batch), and every bad input."""

import json
import shutil

import pytest
import torch
from factories import tiny
from safetensors.torch import load_file

import workbench as wb
from workbench.analysis.store import (
    ActivationStore,
    LiveActivations,
    StoreError,
    TensorActivations,
    check_hook,
    model_fingerprint,
)
from workbench.data import get_task

HOOKS = ["blocks.0.hook_resid_post", "blocks.1.attn.hook_z"]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return wb.HookedDecoder(tiny(d_vocab=40)).eval()


@pytest.fixture(scope="module")
def task():
    return get_task("induction", vocab=32)


def collect(model, task, out, tokens=600, **kw):
    kw = {"batch_size": 4, "tokens_per_shard": 150, "progress": False, **kw}
    return ActivationStore.collect(model, task, HOOKS, tokens, out, **kw)


def test_rows_equal_run_with_cache_at_the_kept_positions(model, task, tmp_path):
    store = collect(model, task, tmp_path / "s")
    assert store.n_rows == 600 and store.manifest["complete"] and store.n_shards == 4
    seen = 0
    for i in range(store.n_shards):
        shard = store.load_shard(i, with_tokens=True)
        _, cache = model.run_with_cache(shard["token_ids"].long())
        seq_len = shard["token_ids"].shape[1]
        seq, pos = shard["rows"] // seq_len, shard["rows"] % seq_len
        assert (pos > 0).all()  # the BOS-like first position is never kept
        for hook in HOOKS:
            expected = cache[hook][seq, pos].flatten(1)
            torch.testing.assert_close(shard[hook], expected, rtol=1e-5, atol=1e-6)
        seen += len(shard["rows"])
    assert seen == 600
    # Shard k holds source batches k * batches_per_shard onwards: the first shard's tokens are batch 0's.
    first = store.load_shard(0, [], with_tokens=True)["token_ids"]
    torch.testing.assert_close(first[:4].long(), task.batch(4, 24, step=0))


def test_rule_drops_listed_tokens_and_keeps_first_when_asked(model, task, tmp_path):
    store = collect(model, task, tmp_path / "s", tokens=200, exclude_first=False, exclude_token_ids=[3, 5])
    shard = store.load_shard(0, [], with_tokens=True)
    ids = shard["token_ids"].long().flatten()[shard["rows"]]
    assert not torch.isin(ids, torch.tensor([3, 5])).any()
    assert (shard["rows"] % shard["token_ids"].shape[1] == 0).any()
    assert store.manifest["rule"] == {"exclude_first": False, "exclude_token_ids": [3, 5]}


def test_killed_collection_resumes_without_duplicating_tokens(model, task, tmp_path):
    reference = collect(model, task, tmp_path / "ref")

    def kill_after(k):
        def on_shard(shard):
            if shard == k:
                raise KeyboardInterrupt
        return on_shard

    with pytest.raises(KeyboardInterrupt):
        collect(model, task, tmp_path / "run", on_shard=kill_after(1))
    assert ActivationStore(tmp_path / "run").n_rows == sum(s["rows"] for s in reference.manifest["shards"][:2])
    # A kill after a shard reached the disk but before the manifest listed it, and a half-written temp file.
    shutil.copy(tmp_path / "ref" / "shard_00002.safetensors", tmp_path / "run" / "shard_00002.safetensors")
    (tmp_path / "run" / ".shard_00003.safetensors.tmp").write_bytes(b"partial")
    resumed = collect(model, task, tmp_path / "run")
    assert resumed.n_shards == reference.n_shards
    for i in range(resumed.n_shards):  # the same tensors (file bytes differ: safetensors orders metadata freely)
        got, want = resumed.load_shard(i, with_tokens=True), reference.load_shard(i, with_tokens=True)
        assert all(torch.equal(got[k], want[k]) for k in want)
    ids = [resumed.load_shard(i, [], with_tokens=True)["token_ids"] for i in range(resumed.n_shards)]
    assert sum(len(t) for t in ids) == sum(s["sequences"] for s in reference.manifest["shards"])
    assert not list((tmp_path / "run").glob(".*.tmp"))
    # Asking for more continues where the store stopped; asking for what it has does nothing.
    more = collect(model, task, tmp_path / "run", tokens=900)
    assert more.n_rows == 900 and more.manifest["shards"][:4] == resumed.manifest["shards"]
    assert more.manifest["shards"][4]["first_batch"] == 4 * more.manifest["batches_per_shard"]


def test_batches_are_a_pure_function_of_seed_and_index(model, task, tmp_path):
    store = collect(model, task, tmp_path / "s")
    stream = store.batches(64, "blocks.0.hook_resid_post", seed=3, buffer_shards=2)
    first = [next(stream) for _ in range(12)]
    later = store.batches(64, "blocks.0.hook_resid_post", seed=3, buffer_shards=2, start_batch=5)
    for b in first[5:]:
        torch.testing.assert_close(next(later), b)
    # One epoch (each group's remainder skipped) visits every row at most once.
    rows = torch.cat(first[:8])
    assert len(torch.unique(rows, dim=0)) == len(rows)
    pair = next(store.batches(16, HOOKS, seed=0))
    assert pair[0].shape == (16, 32) and pair[1].shape == (16, 32)  # hook_z [4 heads, 8] flattened


def test_token_and_text_sources(model, tmp_path):
    ids = torch.randint(0, 40, (10, 24))
    store = ActivationStore.collect(model, ids, "blocks.0.hook_resid_post", 100, tmp_path / "t", batch_size=3,
                                    progress=False)
    torch.testing.assert_close(store.load_shard(0, [], with_tokens=True)["token_ids"][:5].long(), ids[:5])
    with pytest.raises(ValueError, match="ran out"):
        ActivationStore.collect(model, ids, "blocks.0.hook_resid_post", 10_000, tmp_path / "t2", progress=False)


def test_bfloat16_store_and_live_source(model, task, tmp_path):
    store = collect(model, task, tmp_path / "s", tokens=100, dtype="bfloat16")
    assert store.load_shard(0)[HOOKS[0]].dtype == torch.bfloat16
    live = LiveActivations(model, task, HOOKS[0], batch_size=4)
    batch = next(live.batches(32))
    assert batch.shape == (32, 32) and live.known_rows(0) == 4 * 23


def test_bad_hook_name_lists_close_matches(model, task, tmp_path):
    with pytest.raises(ValueError, match="did you mean 'blocks.0.hook_resid_post'"):
        check_hook(model, "blocks.0.hook_resid_pots")
    with pytest.raises(ValueError, match="no hook 'blocks.9.hook_resid_post'"):
        collect(model, task, tmp_path / "s").__class__.collect(model, task, ["blocks.9.hook_resid_post"], 10, tmp_path / "x")


def test_store_from_another_model_is_refused(model, task, tmp_path):
    store = collect(model, task, tmp_path / "s", tokens=100)
    other = wb.HookedDecoder(tiny(d_vocab=40, seed=1))
    assert model_fingerprint(other) != model_fingerprint(model)
    with pytest.raises(StoreError, match="another model"):
        collect(other, task, tmp_path / "s", tokens=200)
    with pytest.raises(StoreError, match="not from this model"):
        store.check_model(other)
    store.check_model(model)
    with pytest.raises(StoreError, match="another token source"):
        collect(model, get_task("induction", vocab=32, seed=5), tmp_path / "s", tokens=200)


def test_corrupt_and_inconsistent_stores_are_clear_errors(model, task, tmp_path):
    collect(model, task, tmp_path / "s")
    shard = tmp_path / "s" / "shard_00001.safetensors"
    good = shard.read_bytes()
    shard.write_bytes(good[:100])  # truncated
    with pytest.raises(StoreError, match="shard_00001.* corrupt"):
        ActivationStore(tmp_path / "s").load_shard(1)
    flipped = bytearray(good)
    flipped[-5] ^= 0xFF  # data bytes: the header parses, the checksum does not match
    shard.write_bytes(bytes(flipped))
    with pytest.raises(StoreError, match="checksum"):
        ActivationStore(tmp_path / "s").verify()
    shard.write_bytes(good)
    ActivationStore(tmp_path / "s").verify()

    manifest = json.loads((tmp_path / "s" / "manifest.json").read_text())
    manifest["shards"][0]["rows"] += 1
    manifest["tokens"] += 1
    (tmp_path / "s" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(StoreError, match="do not match"):
        ActivationStore(tmp_path / "s").load_shard(0)
    manifest["tokens"] += 5
    (tmp_path / "s" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(StoreError, match="inconsistent"):
        ActivationStore(tmp_path / "s")
    (tmp_path / "s" / "manifest.json").write_text("{not json")
    with pytest.raises(StoreError, match="corrupt"):
        ActivationStore(tmp_path / "s")
    with pytest.raises(StoreError, match="not an activation store"):
        ActivationStore(tmp_path)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("mine")
    with pytest.raises(StoreError, match="non-empty folder"):
        collect(model, task, tmp_path / "notes")


def test_shard_files_hold_what_the_manifest_says(model, task, tmp_path):
    store = collect(model, task, tmp_path / "s", tokens=200)
    entry = store.manifest["shards"][0]
    tensors = load_file(str(tmp_path / "s" / entry["file"]))
    assert set(tensors) == set(HOOKS) | {"token_ids", "rows"}
    assert store.manifest["model"]["fingerprint"] == model_fingerprint(model)
    assert store.manifest["hooks"]["blocks.1.attn.hook_z"]["shape"] == [4, 8]


def test_tensor_activations_stream_like_a_store():
    data = {"x": torch.arange(100.0)[:, None].repeat(1, 3)}
    src = TensorActivations(data, rows_per_shard=30)
    assert src.n_shards == 4 and src.subset([3]).shard_rows(0) == 10
    epoch = torch.cat([next(b) for b in [src.batches(10, seed=1)] for _ in range(9)])
    assert len(torch.unique(epoch[:, 0])) == 90


def test_fingerprints_ignore_config_fields_left_at_their_defaults():
    """A field ModelConfig gains later (with a default that keeps old models as they were) must not
    change recorded fingerprints: the shipped dictionary's record still names its model."""
    import dataclasses
    import json
    from pathlib import Path

    cfg = wb.ModelConfig(d_model=32, n_layers=2, n_heads=4, d_vocab=50, n_ctx=16)
    assert {"d_model", "n_layers", "n_heads", "d_vocab", "n_ctx"} <= set(cfg.identity_dict())
    assert not {"norm", "positional", "qk_norm", "folded_ln"} & set(cfg.identity_dict())
    assert not {"d_head", "d_mlp", "n_kv_heads", "moe_d_mlp"} & set(cfg.identity_dict()), "derived, not chosen"
    assert "d_mlp" in cfg.replace(d_mlp=100).identity_dict()
    assert cfg.replace(norm="rmsnorm").identity_dict()["norm"] == "rmsnorm"
    assert all(getattr(cfg, f.name) != f.default for f in dataclasses.fields(cfg) if f.name in cfg.identity_dict())
    shipped = Path(__file__).resolve().parents[1] / "checkpoints" / "stories-2026"
    model, _ = wb.load_checkpoint(shipped)
    recorded = json.loads((shipped / "saes" / "resid-post-1" / "sae_meta.json").read_text())
    assert recorded["config"]["model_fingerprint"] == model_fingerprint(model)


def test_a_folder_another_collection_is_writing_is_refused_and_left_alone(model, task, tmp_path):
    from workbench.checkpoint import locked

    out = tmp_path / "s"
    collect(model, task, out, tokens=100, tokens_per_shard=100)  # a store to continue
    before = json.loads((out / "manifest.json").read_text())
    stray = out / ".shard_00001.safetensors.tmp"  # the other collection's next shard, half-written
    stray.write_bytes(b"theirs")
    with locked(out, timeout=0.0):  # what a collection into out holds while it writes (another process's alike)
        with pytest.raises(StoreError, match="in use"):
            collect(model, task, out, tokens=600, tokens_per_shard=100)
        assert stray.read_bytes() == b"theirs"  # not deleted as a stray of ours
        assert json.loads((out / "manifest.json").read_text()) == before  # nothing written
    store = collect(model, task, out, tokens=600, tokens_per_shard=100)  # free again: it continues
    assert store.n_rows >= 600


def test_live_activations_of_a_short_token_source_say_it_ran_out(model):
    """Live activations of a text or token tensor are finite: reading past them was a reshape RuntimeError on
    an empty batch (training an SAE straight on a short text); it is one StoreError saying what to do."""
    ids = torch.randint(0, model.cfg.d_vocab, (3, 8))
    live = LiveActivations(model, ids, HOOKS[0], batch_size=2)  # 3 sequences: batches 0 (2) and 1 (1)
    assert len(live.load_shard(1)[HOOKS[0]]) == live.known_rows(1)
    with pytest.raises(StoreError, match=r"ran out: its 3 sequences of 8 tokens are 2 batch\(es\) of 2, and batch 2"):
        live.load_shard(2)
    with pytest.raises(StoreError, match="ActivationStore.collect"):
        list(live.batches(64))
