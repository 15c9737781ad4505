"""MoE routing in bf16/fp16 against transformers in the same dtype, family by family.

transformers' routers differ in precision: Mixtral's logits are a matmul in the model's dtype
(the softmax in float32); DeepSeek-V2/V3 keep ``gate.weight`` (and V3's score bias) in float32
and compute the logits from a float32 input. Both multiply the expert outputs by float32
weights and (the default grouped_mm experts path) sum them in float32, rounding once. A router
logit one rounding away from the reference flips a top-k choice now and then, and from there
the model is a different one; so the router is compared exactly, on one shared input.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch
import transformers as T
from test_interop import HF_CASES, VOCAB, build_hf, max_diff
from test_interop_streaming import hf_routing, our_routing, ulp

import workbench as wb
from workbench.interop.streaming import float32_weights

FAMILIES = ["mixtral", "deepseek_v2", "deepseek_v3"]
ROUTER_DTYPE = {"mixtral": None, "deepseek_v2": torch.float32, "deepseek_v3": torch.float32}  # None: the model's


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """family -> (directory of a random fp32 HF model, that model)."""
    out = {}
    for name in FAMILIES:
        config_class, kwargs = HF_CASES[name]
        hf = build_hf(config_class, **kwargs)
        directory = tmp_path_factory.mktemp(name)
        hf.save_pretrained(directory)
        out[name] = (directory, hf)
    return out


def both(saved, name, dtype):
    directory, _ = saved[name]
    hf = T.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).eval()
    return hf, wb.from_hf(directory, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", FAMILIES)
def test_router_logits_choices_and_block_output_match_transformers(saved, name, dtype):
    """One MoE layer of each, fed the same low-precision input: the router logits are the same
    numbers in the same dtype, the chosen experts are the same at all 4096 tokens, and the
    block's output is the same numbers (transformers' grouped_mm experts, on the CPU)."""
    hf, ours = both(saved, name, dtype)
    layer = ours.cfg.moe_first_dense
    theirs_moe, our_moe = hf.model.layers[layer].mlp, ours.blocks[layer].mlp
    torch.manual_seed(0)
    x = torch.randn(4, 1024, ours.cfg.d_model).to(dtype)
    seen = {}
    for hook in ("hook_router_logits", "hook_expert_indices"):
        getattr(our_moe, hook).add_hook(lambda t, hook, key=hook: seen.__setitem__(key, t))
    with torch.no_grad():
        logits, _, indices = theirs_moe.gate(x)
        mine_out, theirs_out = our_moe(x), theirs_moe(x)
    mine_logits = seen["hook_router_logits"].reshape(logits.shape)
    assert logits.dtype == mine_logits.dtype == (ROUTER_DTYPE[name] or dtype)
    assert torch.equal(mine_logits, logits), f"router logits differ by {max_diff(mine_logits, logits):.2e}"
    chosen = seen["hook_expert_indices"].reshape(indices.shape).sort(-1).values
    assert torch.equal(chosen, indices.sort(-1).values)
    # k=3 (V3) sums its three float32 products in another order now and then: one rounding, rarely
    exact = (mine_out == theirs_out).float().mean().item()
    assert exact >= 0.999, f"MoE outputs: only {exact:.2%} equal, max diff {max_diff(mine_out, theirs_out):.2e}"
    torch.testing.assert_close(mine_out, theirs_out, rtol=torch.finfo(dtype).eps, atol=ulp(theirs_out.abs().max().item(), dtype))


@pytest.mark.parametrize("name", FAMILIES)
def test_bf16_model_routes_as_transformers_and_logits_agree(saved, name):
    """The whole bf16 model against transformers' in bf16. Mixtral is the same numbers end to
    end. DeepSeek's MLA attention rounds differently from transformers' (about half its outputs
    are one rounding off), so a layer-1 router input can differ and with it, rarely, a choice:
    the routing must agree at >= 95% of positions and the logits there to two roundings."""
    hf, ours = both(saved, name, torch.bfloat16)
    tokens = torch.randint(0, VOCAB, (4, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs, mine = hf(tokens).logits.float(), ours(tokens).float()
        same = (our_routing(ours, tokens) == hf_routing(hf, tokens)).all(-1)
    diff, scale = max_diff(mine[same], theirs[same]), theirs.abs().max().item()
    print(f"\n[router] {name} bf16: same routing at {same.float().mean():.0%} of positions, max |logit diff| there "
          f"{diff:.4f} (one ulp {ulp(scale, torch.bfloat16):.4f})")
    assert same.float().mean() >= (1.0 if name == "mixtral" else 0.95)
    assert diff <= (0 if name == "mixtral" else 2 * ulp(scale, torch.bfloat16))


def test_deepseek_router_weights_stay_float32_through_every_path(saved, tmp_path):
    """from_hf(dtype=bf16), model.to(bf16) and load_checkpoint(dtype=bf16) all keep DeepSeek's
    router weight and score bias as the float32 numbers of the checkpoint; Mixtral's follow the model."""
    directory, hf = saved["deepseek_v3"]
    reference = {k: v for k, v in hf.state_dict().items() if k.endswith(("mlp.gate.weight", "e_score_correction_bias"))}
    fp32 = wb.from_hf(directory)
    names = {"blocks.1.mlp.W_gate", "blocks.1.mlp.b_score"}
    assert float32_weights(fp32) == names and fp32.cfg.moe_router_fp32
    wb.save_checkpoint(fp32, tmp_path / "ckpt")
    for model in (wb.from_hf(directory, dtype=torch.bfloat16), fp32.to(torch.bfloat16),
                  wb.load_checkpoint(tmp_path / "ckpt", dtype=torch.bfloat16)[0]):
        params = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        assert {params[n].dtype for n in names} == {torch.float32}
        assert torch.equal(params["blocks.1.mlp.W_gate"], reference["model.layers.1.mlp.gate.weight"].T)
        assert torch.equal(params["blocks.1.mlp.b_score"], reference["model.layers.1.mlp.gate.e_score_correction_bias"])
        assert {p.dtype for n, p in model.named_parameters() if n not in names} == {torch.bfloat16}
    mixtral = wb.from_hf(saved["mixtral"][0], dtype=torch.bfloat16)
    assert not mixtral.cfg.moe_router_fp32 and not float32_weights(mixtral)
    assert mixtral.blocks[0].mlp.W_gate.dtype == torch.bfloat16
