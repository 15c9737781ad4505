"""Small builders shared by the tests (a module of its own: tests/app has its own conftest.py,
and two modules named ``conftest`` cannot both be imported by name)."""


def tiny(**overrides):
    """A tiny seeded ModelConfig (d_model 32, 2 layers, 4 heads, vocab 50, ctx 24); overrides win."""
    import workbench as wb

    base = dict(d_model=32, n_layers=2, n_heads=4, d_vocab=50, n_ctx=24, seed=0)
    base.update(overrides)
    return wb.ModelConfig(**base)
