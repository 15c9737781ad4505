"""Directions and steering: steered KV-cache generation equals the steered recompute and a
hand-written reference (every mode, all or chosen absolute positions, RoPE and learned
positions); a batched scale sweep equals separate runs; steering vectors, projections and
prompt differences against direct computations from the cache; save/load is exact; bad input
(another model, another width, zero, NaN, unknown hook, wrong batch for a scale list) is refused."""

import pytest
import torch
from factories import tiny

import workbench as wb
from workbench import analysis as an

HOOK = "blocks.0.hook_resid_post"


def _model(positional="rope", **kw):
    return wb.HookedDecoder(tiny(positional=positional, **kw)).eval()


def _salient_direction(model, prompt, hook=HOOK):
    """The first prompt's last activation at the hook: ablating or clamping it changes what a tiny
    random model says (the mean activation does not: the token embedding dominates)."""
    _, cache = model.run_with_cache(prompt)
    return an.Direction(cache[hook][0, -1], hook)


def _reference_generate(model, tokens, vector, scale, mode, positions, n_new):
    """Greedy decoding by full recompute with a hand-written hook that edits position by position."""
    unit = vector / vector.norm()

    def edit(act, hook):
        act = act.clone()
        chosen = range(act.shape[1]) if positions == "all" else [p for p in positions if p < act.shape[1]]
        for p in chosen:
            x = act[:, p]
            along = (x @ unit)[:, None] * unit
            act[:, p] = {"add": x + scale * vector, "ablate": x - scale * along,
                         "clamp": x - along + scale * vector}[mode]
        return act

    for _ in range(n_new):
        logits = model.run_with_hooks(tokens, fwd_hooks=[(HOOK, edit)])
        tokens = torch.cat([tokens, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return tokens


@pytest.mark.parametrize("positional", ["rope", "learned"])
@pytest.mark.parametrize("mode,scale", [("add", 3.0), ("ablate", 1.0), ("clamp", -2.0)])
@pytest.mark.parametrize("positions", ["all", [3, 5, 7]])  # 3 is in the prompt; 5 and 7 are decode steps
def test_steered_kv_cache_generation_equals_the_steered_recompute(positional, mode, scale, positions):
    model = _model(positional)
    prompt = torch.randint(0, 50, (2, 4), generator=torch.Generator().manual_seed(1))
    direction = _salient_direction(model, prompt)
    with model.steer(direction, scale, mode, positions):
        cached = model.generate(prompt, max_new_tokens=6, use_kv_cache=True)
        recomputed = model.generate(prompt, max_new_tokens=6, use_kv_cache=False)
    reference = _reference_generate(model, prompt, direction.vector, scale, mode, positions, 6)
    assert torch.equal(cached, recomputed)
    assert torch.equal(cached, reference)
    assert not torch.equal(cached, model.generate(prompt, max_new_tokens=6))  # the steering did something
    assert model.pos_offset == 0 and not any(h.fwd_hooks for h in model.hook_dict.values())  # all cleaned up


@pytest.mark.parametrize("positional", ["rope", "learned"])
@pytest.mark.parametrize("mode", ["add", "ablate", "clamp"])
def test_every_decode_step_is_steered_at_its_absolute_position(positional, mode):
    """Logits, not tokens: a prefill then one-token steps through a KV cache equal one steered forward."""
    model = _model(positional)
    tokens = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(2))
    direction = an.Direction(torch.randn(32, generator=torch.Generator().manual_seed(4)), HOOK)
    with model.steer(direction, 2.0, mode, positions=[2, 5, 7]):
        full = model(tokens)
        cache = model.make_kv_cache(2)
        steps = [model(tokens[:, :4], kv_cache=cache)]
        steps += [model(tokens[:, i:i + 1], kv_cache=cache) for i in range(4, 9)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)
    changed = (full - model(tokens)).abs().amax(-1).amin(0) > 1e-4
    assert changed.tolist() == [p >= 2 for p in range(9)]  # untouched before the first steered position


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("per_position", [False, True])
def test_chosen_positions_in_a_padded_batch_are_each_prompts_own(side, per_position):
    """Steering positions [1, 3] (or a per-position direction) of prompts of different lengths,
    padded together: each row's logits and greedy tokens (KV cache and recompute) equal its prompt
    steered alone; on the left-padded side the pads shift the slots, not the positions."""
    from workbench.padding import TokenBatch

    model = _model("rope")
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 50, (n,), generator=gen) for n in (6, 3, 5)]
    if per_position:
        direction = an.Direction(torch.randn(9, 32, generator=gen), HOOK)  # one row per position
        positions = "all"
    else:
        direction, positions = an.Direction(torch.randn(32, generator=gen), HOOK), [1, 3]
    batch = TokenBatch.from_ids([p.tolist() for p in prompts], 0, side)
    with model.steer(direction, 3.0, "add", positions):
        padded = model(batch)
        alone = [model(p[None])[0] for p in prompts]
        if side == "left":  # generation continues left-padded batches
            generated = model.generate(batch, max_new_tokens=3, use_kv_cache=True)
            recomputed = model.generate(batch, max_new_tokens=3, use_kv_cache=False)
            generated_alone = [model.generate(p[None], max_new_tokens=3)[0] for p in prompts]
    mask = batch.attention_mask.bool()
    for i, (p, want) in enumerate(zip(prompts, alone)):
        torch.testing.assert_close(padded[i][mask[i]], want, rtol=1e-5, atol=1e-5)
    assert model.row_positions is None  # nothing left for a later run to read
    if side == "left":
        assert torch.equal(generated.tokens, recomputed.tokens)
        for i, want in enumerate(generated_alone):
            assert generated.tokens[i][generated.attention_mask[i].bool()].tolist() == want.tolist()


def test_steered_logits_equal_a_direct_edit_and_the_hook_list():
    model = _model()
    direction = an.Direction(torch.randn(32), HOOK)
    tokens = torch.randint(0, 50, (3, 7))
    with model.steer(direction, 2.5):
        steered = model(tokens)
    via_hooks = model.run_with_hooks(tokens, fwd_hooks=direction.hooks(2.5))
    _, cache = model.run_with_cache(tokens)
    direct = model(cache[HOOK] + 2.5 * direction.vector, start_at_layer=1)
    torch.testing.assert_close(steered, via_hooks, rtol=0, atol=0)
    torch.testing.assert_close(steered, direct, rtol=1e-5, atol=1e-5)


def test_per_position_direction_steers_each_position_with_its_own_row():
    model = _model("learned")
    a, b = torch.randint(0, 50, (1, 6)), torch.randint(0, 50, (1, 6))
    direction = an.Direction.from_prompts(model, a, b, HOOK)
    _, cache_a = model.run_with_cache(a)
    _, cache_b = model.run_with_cache(b)
    torch.testing.assert_close(direction.vector, (cache_a[HOOK] - cache_b[HOOK])[0])
    assert direction.per_position and direction.provenance["kind"] == "prompt_diff"
    prompt = torch.randint(0, 50, (2, 3))
    with model.steer(direction, 5.0, "add", "all"):  # rows 0..5: the prompt and three generated tokens
        cached = model.generate(prompt, max_new_tokens=8)
        recomputed = model.generate(prompt, max_new_tokens=8, use_kv_cache=False)
    assert torch.equal(cached, recomputed)
    with pytest.raises(ValueError, match="model="):
        direction.hooks(1.0)  # per-position needs the model to know where a decode step is


@pytest.mark.parametrize("mode", ["add", "clamp"])
def test_batched_scale_sweep_equals_separate_runs(mode):
    model = _model()
    prompt = torch.randint(0, 50, (2, 5))
    direction = _salient_direction(model, prompt)
    scales = [-4.0, 0.0, 2.0, 6.0]
    batched = an.steered_generate(model, prompt, direction, scales, max_new_tokens=5, mode=mode, positions=[2, 7])
    separate = an.steered_generate(model, prompt, direction, scales, max_new_tokens=5, mode=mode, positions=[2, 7],
                                   batched=False)
    assert batched.shape == (4, 2, 10) and torch.equal(batched, separate)
    assert len({tuple(row.flatten().tolist()) for row in batched}) > 1  # scales differ in what they make
    one = an.steering_sweep(model, prompt, direction, scales, mode=mode)
    many = an.steering_sweep(model, prompt, direction, scales, mode=mode, batched=False)
    assert list(one.columns) == ["scale", "prompt", "metric"] and len(one) == 8
    torch.testing.assert_close(torch.tensor(one.metric.values), torch.tensor(many.metric.values), rtol=1e-5, atol=1e-5)
    clean = model.loss_fn(model(prompt), prompt, per_token=True).mean(-1)
    zero = one[one.scale == 0.0].metric.values if mode == "add" else None
    if zero is not None:
        torch.testing.assert_close(torch.tensor(zero), clean.double(), rtol=1e-5, atol=1e-5)


def test_steering_vector_is_the_difference_of_means_at_each_prompts_last_token():
    model = _model()
    positive = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12]]  # different lengths, no padding needed
    negative = torch.randint(0, 50, (2, 6))
    d = an.steering_vector(model, positive, negative, HOOK)
    last = [model.run_with_cache(torch.tensor([p]))[1][HOOK][0, -1] for p in positive]
    expected = torch.stack(last).mean(0) - model.run_with_cache(negative)[1][HOOK][:, -1].mean(0)
    torch.testing.assert_close(d.vector, expected, rtol=1e-5, atol=1e-6)
    assert d.provenance["kind"] == "contrastive" and d.provenance["n_positive"] == 3
    # the same prompts right-padded with a mask give the same vector
    padded = torch.zeros(3, 5, dtype=torch.long)
    mask = torch.zeros(3, 5, dtype=torch.bool)
    for i, p in enumerate(positive):
        padded[i, :len(p)], mask[i, :len(p)] = torch.tensor(p), True
    masked = an.steering_vector(model, padded, negative, HOOK, mask=(mask, None))
    torch.testing.assert_close(masked.vector, d.vector, rtol=1e-5, atol=1e-6)
    mean = an.steering_vector(model, positive, negative, HOOK, position="mean")
    assert not torch.allclose(mean.vector, d.vector)


def test_project_reads_the_cache_along_the_unit_vector():
    model = _model()
    direction = an.Direction(torch.randn(32), "blocks.1.hook_resid_mid")
    tokens = torch.randint(0, 50, (2, 6))
    table = an.project(model, tokens, direction)
    _, cache = model.run_with_cache(tokens)
    expected = cache["blocks.1.hook_resid_mid"] @ (direction.vector / direction.vector.norm())
    assert list(table.columns) == ["prompt", "pos", "token", "projection"] and len(table) == 12
    torch.testing.assert_close(torch.tensor(table.projection.values, dtype=torch.float32), expected.flatten(),
                               rtol=1e-5, atol=1e-5)


def test_weight_row_directions():
    model = _model(ffn="gelu")
    row = an.Direction.from_weight(model, "blocks.0.mlp.W_out", 7, HOOK)
    torch.testing.assert_close(row.vector, model.blocks[0].mlp.W_out[7].detach())
    column = an.Direction.from_weight(model, "W_U", 3, "blocks.1.hook_resid_post")
    torch.testing.assert_close(column.vector, model.W_U[:, 3].detach())
    with pytest.raises(ValueError, match="index"):
        an.Direction.from_weight(model, "W_U", 50, HOOK)


def test_save_and_load_round_trip_exactly(tmp_path):
    model = _model()
    d = an.steering_vector(model, torch.randint(0, 50, (3, 5)), torch.randint(0, 50, (3, 5)), HOOK)
    stem = d.save(tmp_path / "directions" / "names")
    assert {p.name for p in (tmp_path / "directions").iterdir()} == {"names.safetensors", "names.json"}
    back = an.Direction.load(stem)
    assert torch.equal(back.vector, d.vector) and back.hook == d.hook and back.provenance == d.provenance
    back.check(model)  # the stamped model still matches
    with pytest.raises(FileNotFoundError, match="no saved direction"):
        an.Direction.load(tmp_path / "nothing")


def test_one_file_bytes_round_trip_and_hold_what_save_writes(tmp_path):
    import io
    import json
    import zipfile

    from safetensors.torch import load_file

    model = _model()
    d = an.steering_vector(model, torch.randint(0, 50, (3, 5)), torch.randint(0, 50, (3, 5)), HOOK)
    data = d.to_bytes("names")
    back = an.Direction.from_bytes(data)
    assert torch.equal(back.vector, d.vector) and back.hook == d.hook and back.provenance == d.provenance
    back.check(model)
    # The zip holds the two files Direction.save writes, byte for byte in the JSON, equal tensors.
    stem = d.save(tmp_path / "names")
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        assert sorted(archive.namelist()) == ["names.json", "names.safetensors"]
        assert archive.read("names.json") == (tmp_path / "names.json").read_bytes()
        (tmp_path / "zipped.safetensors").write_bytes(archive.read("names.safetensors"))
    assert torch.equal(load_file(str(tmp_path / "zipped.safetensors"))["vector"], load_file(f"{stem}.safetensors")["vector"])
    rows = an.Direction(torch.randn(4, 32), HOOK, {"kind": "prompt_diff", "plus": [1, 2], "minus": [3, 4]})
    assert torch.equal(an.Direction.from_bytes(rows.to_bytes()).vector, rows.vector)  # a per-position direction

    def zipped(files: dict) -> bytes:
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w") as archive:
            for name, content in files.items():
                archive.writestr(name, content)
        return buffer.getvalue()

    with pytest.raises(ValueError, match="not a direction file: not a zip"):
        an.Direction.from_bytes(b"{}")
    with pytest.raises(ValueError, match="exactly one .json and one .safetensors.*'a.json'"):
        an.Direction.from_bytes(zipped({"a.json": "{}"}))
    (tmp_path / "names.json").write_text(json.dumps({**json.loads((tmp_path / "names.json").read_text()), "shape": [31]}))
    with pytest.raises(ValueError, match="names.safetensors does not hold the vector its JSON describes"):
        an.Direction.from_bytes(zipped({"names.json": (tmp_path / "names.json").read_text(),
                                        "names.safetensors": (tmp_path / "zipped.safetensors").read_bytes()}))
    with pytest.raises(ValueError, match="a.json is not valid JSON"):
        an.Direction.from_bytes(zipped({"a.json": "{", "a.safetensors": (tmp_path / "zipped.safetensors").read_bytes()}))
    with pytest.raises(ValueError, match="the direction zip cannot be read"):
        an.Direction.from_bytes(zipped({"a.json": "{}", "a.safetensors": b"not safetensors"}))
    with pytest.raises(ValueError, match="name must be a plain file name"):
        d.to_bytes("../up")


def test_bad_input_is_refused_clearly():
    model = _model()
    with pytest.raises(ValueError, match="zero vector"):
        an.Direction(torch.zeros(32), HOOK)
    with pytest.raises(ValueError, match="NaN"):
        an.Direction(torch.tensor([1.0, float("nan")] + [0.0] * 30), HOOK)
    wide = an.Direction(torch.randn(64), HOOK)
    with pytest.raises(ValueError, match="64 wide"):
        with model.steer(wide):
            pass
    with pytest.raises(ValueError, match="64 wide"):  # the hook list without a model checks at the hook
        model.run_with_hooks(torch.randint(0, 50, (1, 4)), fwd_hooks=wide.hooks(1.0))
    other = wb.HookedDecoder(tiny(positional="rope", seed=1)).eval()
    foreign = an.steering_vector(other, torch.randint(0, 50, (2, 4)), torch.randint(0, 50, (2, 4)), HOOK)
    with pytest.raises(ValueError, match="made on model"):
        with model.steer(foreign):
            pass
    an.project(model, torch.randint(0, 50, (1, 4)), foreign, check_model=False)  # allowed when asked
    with pytest.raises(ValueError, match="not a hook"):
        an.Direction(torch.randn(32), "blocks.9.hook_resid_post").check(model)
    d = an.Direction(torch.randn(32), HOOK)
    with pytest.raises(ValueError, match="mode"):
        with model.steer(d, mode="multiply"):
            pass
    with pytest.raises(ValueError, match="positions"):
        with model.steer(d, positions=[-1]):
            pass
    with pytest.raises(ValueError, match="scale"):
        with model.steer(d, scale=float("nan")):
            pass
    with pytest.raises(ValueError, match="scale-major"):
        with model.steer(d, scale=[1.0, 2.0]):
            model(torch.randint(0, 50, (3, 4)))
    with pytest.raises(ValueError, match="same mean activation"):
        same = torch.randint(0, 50, (2, 4))
        an.steering_vector(model, same, same, HOOK)
    with pytest.raises(ValueError, match="provenance"):
        an.Direction(torch.randn(32), HOOK, {"kind": "guess"})
