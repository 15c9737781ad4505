"""Unit labels: one writer and one reader, shared by the tables, the figures and the app."""

import pytest

from workbench.analysis import head_label, parse_head, parse_unit, unique_labels, unit_label


@pytest.mark.parametrize("args,label", [((1, 4, None), "L1H4"), ((0, None, "mlp"), "L0 mlp"),
                                        ((12, None, "attn bias"), "L12 attn bias"), ((3, None, None), "L3")])
def test_unit_labels_round_trip(args, label):
    layer, head, part = args
    assert unit_label(layer, head=head, part=part) == label
    assert parse_unit(label) == args


def test_head_labels_and_bad_labels():
    assert head_label(7) == "H7" and parse_head("H7") == 7
    assert parse_unit(" L1H4 ") == (1, 4, None)
    for bad in ("1H4", "L1H", "Lx", "L1mlp", "H1", ""):
        with pytest.raises(ValueError, match="not a unit"):
            parse_unit(bad)
    with pytest.raises(ValueError, match="not a head label"):
        parse_head("L1H2")
    with pytest.raises(ValueError, match="not both"):
        unit_label(1, head=2, part="mlp")


def test_unique_labels_prefix_positions():
    assert unique_labels(["a", "b", "a"]) == ["0: a", "1: b", "2: a"]
    assert unique_labels(["b", "a"], positions=[4, 5]) == ["4: b", "5: a"]
