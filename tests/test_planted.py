"""The planted-circuit models: the shipped files are what the builders make, small, loadable, and
still do what their meta.json says; the high-level models behind IIT are right; the established
circuit of induction-attn2l belongs to that model and no other."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import workbench as wb
from workbench.analysis import Circuit, faithfulness
from workbench.planted import PLANTED, checkpoint_dir, load_planted
from workbench.planted.hand import TRUTH, build_hand_induction
from workbench.planted.iit import IGNORE, SPECS, copy_labels, evaluate

ROOT = Path(__file__).resolve().parents[1] / "checkpoints"


def _shipped(name):
    path = ROOT / checkpoint_dir(name)
    if not (path / "config.json").is_file():
        pytest.skip(f"{path} is not built: run scripts/make_planted.py")
    return path


@pytest.mark.parametrize("name", [n for n in PLANTED if n != "induction-attn2l"])
def test_shipped_planted_checkpoints_are_small_and_load(name):
    path = _shipped(name)
    assert sum(f.stat().st_size for f in path.iterdir()) < 1_000_000
    planted = load_planted(name)
    assert set(planted.truth) <= set(wb.analysis.ComputationGraph(planted.model).edge_labels)
    assert not set(planted.truth) & set(planted.unscored)
    clean, corrupted = planted.prompts(16, seed=5)
    metric = planted.metric(clean)
    with torch.no_grad():
        assert float(metric(planted.model(clean))) > -0.05 > float(metric(planted.model(corrupted)))
    assert faithfulness(planted.model, Circuit.from_edges(planted.model, planted.truth), (clean, corrupted),
                        metric) > 0.95


def test_shipped_hand_built_model_is_the_builder_bit_for_bit():
    shipped = load_file(str(_shipped("hand-induction") / "model.safetensors"))
    built = build_hand_induction().state_dict()
    assert shipped.keys() == {k for k in built if k in shipped}
    for name, tensor in shipped.items():
        assert torch.equal(tensor, built[name]), name
    assert load_planted("hand-induction").truth == TRUTH


@pytest.mark.parametrize("name", list(SPECS))
def test_iit_models_still_follow_their_high_level_graphs(name):
    _shipped(name)
    planted = load_planted(name)
    metrics = evaluate(planted.model, SPECS[name](), batch=48, seed=7)
    assert min(metrics.values()) >= 0.98, metrics
    assert planted.meta["nodes"] == {node: c.label for node, c in SPECS[name]().nodes.items()}


def test_copy_labels_is_the_induction_rule():
    tokens = torch.tensor([[3, 4, 5, 3, 4, 9, 3]])
    labels = copy_labels(tokens, torch.cat([torch.tensor([[-1]]), tokens[:, :-1]], 1), tokens)
    # 3 was followed by 4 before; 4 by 5 before; position 6 sees "3 -> 4" twice: both say 4
    assert labels.tolist() == [[IGNORE, IGNORE, IGNORE, 4, 5, IGNORE, 4]]
    clash = torch.tensor([[3, 4, 3, 5, 3]])
    labels = copy_labels(clash, torch.cat([torch.tensor([[-1]]), clash[:, :-1]], 1), clash)
    assert labels[0, -1] == IGNORE  # 3 was followed by 4 and by 5: the rule does not decide


def test_established_circuit_belongs_to_induction_attn2l_only(tmp_path):
    path = _shipped("induction-attn2l")
    if not (path / "circuit.json").is_file():
        pytest.skip("the established circuit is not built: run scripts/make_planted.py induction-attn2l")
    planted = load_planted("induction-attn2l")
    assert "ACDC" in planted.established_by and len(planted.truth) > 5
    with pytest.raises(ValueError, match="found on model 'induction-attn2l'.*this model is 'planted-hand-induction'"):
        Circuit.load(path / "circuit.json", build_hand_induction())


def test_unknown_planted_name_is_named():
    with pytest.raises(ValueError, match="unknown planted model 'ioi'; valid names are"):
        load_planted("ioi")
