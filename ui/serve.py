"""``python -m ui.serve [streamlit options] [-- --checkpoints DIR]``: the app, warmed before it serves.

``streamlit run app.py`` imports torch, plotly and the pages when the first browser session runs
the script, and loads the default checkpoint then: that session waits for all of it. This
launcher does that work in the server's own process first (the imports, the default checkpoint
through the same ``st.cache_resource`` loader the pages use, one forward), then hands over to
``streamlit run app.py`` in the same process, so the first page a user opens finds it done.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

APP = Path(__file__).resolve().parent.parent / "app.py"


def preload(script_args: list[str]) -> str:
    """Import what app.py imports and load the default checkpoint; a line saying what was done."""
    started = time.perf_counter()
    import plotly.graph_objects
    import torch

    from ui import (ablate, build_train, circuit, common, compare, features, inspect, patch,  # noqa: F401
                    steer, sweeps, training)
    from workbench import viz  # noqa: F401

    torch.set_num_threads(int(os.environ.get("WORKBENCH_THREADS", "1")))
    found = common.list_checkpoints(common.checkpoints_root(script_args))
    name = common.default_checkpoint(list(found))
    if name is None:
        return f"preloaded the app's imports in {time.perf_counter() - started:.1f} s (no checkpoint to load)"
    path = found[name]
    model, _, _, _ = common._load(str(Path(path).resolve()), common.weights_stamp(path), common.app_device())
    with torch.no_grad():  # the first forward of a process pays for kernels and allocator set-up
        model(torch.zeros(1, min(8, model.cfg.n_ctx), dtype=torch.long, device=model.device))
    # plotly imports a trace type's validators when the first figure of that type is built
    from plotly.subplots import make_subplots

    warm = make_subplots(rows=1, cols=2)
    for trace in (plotly.graph_objects.Heatmap(z=[[0.0]]), plotly.graph_objects.Scatter(x=[0], y=[0]),
                  plotly.graph_objects.Bar(x=[0], y=[0])):
        warm.add_trace(trace, row=1, col=1)
    warm.update_layout(coloraxis=dict(colorscale="Viridis")).to_json()
    return f"preloaded the app's imports and {name} in {time.perf_counter() - started:.1f} s"


def main(argv: list[str]) -> None:
    streamlit_args, script_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    sys.path.insert(0, str(APP.parent))
    print(preload(script_args), flush=True)
    from streamlit.web import cli

    # 127.0.0.1 unless told otherwise, also when started from another folder (where .streamlit/config.toml,
    # which says the same, is not read): the app runs models and reads folders on this machine.
    if not any(arg.startswith("--server.address") for arg in streamlit_args):
        streamlit_args = ["--server.address", "127.0.0.1", *streamlit_args]
    sys.argv = ["streamlit", "run", str(APP), "--browser.gatherUsageStats", "false", *streamlit_args,
                *(["--", *script_args] if script_args else [])]
    sys.exit(cli.main())


if __name__ == "__main__":
    main(sys.argv[1:])
