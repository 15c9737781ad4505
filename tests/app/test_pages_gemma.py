"""Build & train offers Gemma's options (soft-caps, query_pre_attn_scalar, sliding window,
global_every, local RoPE base, scaled embeddings, gemma_rmsnorm, geglu_tanh) as widgets; a bad
combination shows the config's own message instead of a Train button."""

from ui import build_train


def _messages(at) -> str:
    return " | ".join(str(e.value) for e in [*at.warning, *at.error, *at.info])


def test_build_offers_gemma_options_and_explains_bad_combinations(app):
    at = app("Build & train")
    assert all(at.number_input(key=f"bt_{name}").value is None for name in build_train.GEMMA if name != "global_every")
    at.selectbox(key="bt_norm").set_value("gemma_rmsnorm")
    at.selectbox(key="bt_positional").set_value("rope")
    at.toggle(key="bt_attn_only").set_value(False).run()
    at.selectbox(key="bt_ffn").set_value("geglu_tanh")
    at.toggle(key="bt_scale_embeddings").set_value(True)
    at.number_input(key="bt_global_every").set_value(2).run()
    assert "global_every=2 needs sliding_window" in _messages(at)
    assert not [b for b in at.button if b.key == "bt_train"]
    for name, value in (("sliding_window", 4), ("attn_logit_softcap", 50.0), ("final_logit_softcap", 30.0),
                        ("query_pre_attn_scalar", 16.0), ("rope_local_base", 100.0)):
        at.number_input(key=f"bt_{name}").set_value(value)
    at.run()
    assert not at.exception and not _messages(at), _messages(at)
    assert at.button(key="bt_train")
    assert at.metric[0].value  # the costs are drawn for the Gemma-style model
