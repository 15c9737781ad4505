"""``python -m ui.serve [streamlit options] [-- --checkpoints DIR]``: the app, warmed while the server starts.

``streamlit run app.py`` imports torch, plotly and the pages when the first browser session runs
the script, and loads the default checkpoint then: that session waits for all of it. This
launcher does that work in the server's own process (the imports, the default checkpoint
through the same ``st.cache_resource`` loader the pages use, the Inspect page's analyses of the
default prompt into the ``st.cache_data`` entries the page reads, one figure of each trace type) on
a background thread, while ``streamlit run app.py`` starts in the same process and the browser
loads the page's JavaScript. app.py calls :func:`wait_for_preload` before its first
import, so a session that arrives early waits for the preload instead of racing it.

With ``WORKBENCH_TIMINGS=1`` in the environment each phase prints ``timing <phase> <epoch s>``
(``benchmarks/app.py --browser`` reads them to split the first page's time into its parts).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

APP = Path(__file__).resolve().parent.parent / "app.py"
_preload: threading.Thread | None = None
_light = threading.Event()  # the preload has imported pandas and plotly


def mark(phase: str) -> None:
    """Print when ``phase`` ended, with WORKBENCH_TIMINGS=1 (for the benchmark's breakdown)."""
    if os.environ.get("WORKBENCH_TIMINGS") == "1":
        print(f"timing {phase} {time.time():.3f}", flush=True)


def preload(script_args: list[str]) -> str:
    """Import what app.py imports and load the default checkpoint; a line saying what was done.

    pandas and plotly come first, whole: app.py's first run builds a small figure once
    :func:`wait_for_light` says they are in (built while this thread was importing pandas, that
    figure once found it half-imported, since plotly looks pandas up in ``sys.modules``)."""
    started = time.perf_counter()
    try:
        import pandas  # noqa: F401
        import plotly.graph_objects
        import plotly.io  # noqa: F401
    finally:
        _light.set()  # also on a failed import: app.py then imports them itself, and says what failed
    mark("pandas and plotly")
    from ui import tl_import

    # TransformerLens's hook points without its package's imports of datasets and transformers (1.1 s
    # here, none of it used by the workbench): see ui/tl_import.py
    tl_import.import_core()
    import torch

    from ui import (ablate, build_train, circuit, common, compare, features, graph, inspect, patch,  # noqa: F401
                    steer, sweeps, training)
    from ui.common import pretrained
    from workbench import viz  # noqa: F401

    mark("imports")
    torch.set_num_threads(int(os.environ.get("WORKBENCH_THREADS", "1")))
    # the picker's list: the checkpoints folder's models, then the pretrained model (the default when
    # the folder has none)
    found = {**common.list_checkpoints(common.checkpoints_root(script_args)), **pretrained.entries()}
    name = common.default_checkpoint(list(found))
    if name is None:
        return f"preloaded the app's imports in {time.perf_counter() - started:.1f} s (no checkpoint to load)"
    path = found[name]
    if name == pretrained.LABEL and not pretrained.converted(path):
        pretrained.convert()
    model, _, _, _ = common._load(str(Path(path).resolve()), common.weights_stamp(path), common.app_device())
    mark("model loaded")
    # The default page's analyses of the default prompt, into the cache entries the page reads: the
    # first session then only draws (on SmolLM2-135M these were about 12 s of its first page at load 9).
    ckpt = common.load(path, name=name)  # the Checkpoint the page builds, over the model loaded above
    ids = common.prompt_ids(ckpt, common.default_prompt(ckpt)) if ckpt is not None else None
    if ids is not None:
        inspect.precompute(ckpt, ids)
    else:
        with torch.no_grad():  # the first forward of a process pays for kernels and allocator set-up
            model(torch.zeros(1, min(8, model.cfg.n_ctx), dtype=torch.long, device=model.device))
    mark("analyses")
    # plotly imports a trace type's validators when the first figure of that type is built
    from plotly.subplots import make_subplots

    warm = make_subplots(rows=1, cols=2)
    for trace in (plotly.graph_objects.Heatmap(z=[[0.0]]), plotly.graph_objects.Scatter(x=[0], y=[0]),
                  plotly.graph_objects.Bar(x=[0], y=[0])):
        warm.add_trace(trace, row=1, col=1)
    warm.update_layout(coloraxis=dict(colorscale="Viridis")).to_json()
    mark("figures warmed")
    return f"preloaded the app's imports and {name} in {time.perf_counter() - started:.1f} s"


class _PreloadContextFilter:
    """Drops Streamlit's "missing ScriptRunContext! ... bare mode" warning for the preload thread only:
    it fills the pages' caches outside a script run on purpose, and the warning printed on every launch
    (any other thread's warning still shows)."""

    def filter(self, record) -> bool:
        return not (record.getMessage().startswith(f"Thread '{PRELOAD_THREAD}': missing ScriptRunContext"))


PRELOAD_THREAD = "workbench-preload"


# How long the preload waits for the server to listen before it starts anyway (a start slower than this
# is a loaded machine, where the two then share the interpreter).
SERVER_START_WAIT = 10.0


def server_listening() -> threading.Event:
    """An event set once Streamlit's server listens (by its bootstrap's ``_on_server_start``, which this
    wraps); set at once where a Streamlit version has no such hook."""
    listening = threading.Event()
    from streamlit.web import bootstrap

    original = getattr(bootstrap, "_on_server_start", None)
    if not callable(original):
        listening.set()
        return listening

    def on_server_start(*args, **kwargs):
        mark("server listening")
        listening.set()
        return original(*args, **kwargs)

    bootstrap._on_server_start = on_server_start
    return listening


def start_preload(script_args: list[str], after: threading.Event | None = None) -> threading.Thread:
    """:func:`preload` on a daemon thread, once ``after`` is set (or :data:`SERVER_START_WAIT` has passed);
    its line (or its error) is printed when it ends."""
    global _preload
    work = preload  # bound now: the thread calls what was asked for, even if the name is rebound later

    def run() -> None:
        if after is not None:
            after.wait(SERVER_START_WAIT)
        try:
            print(work(script_args), flush=True)
        except Exception as error:  # the app still runs: the first session then pays for what failed here
            print(f"preload failed ({type(error).__name__}: {error}); the first page will load it", flush=True)
        finally:  # however it ended (a stand-in for preload that never got to pandas too): nothing to wait for
            _light.set()

    import logging

    from streamlit.runtime.scriptrunner_utils import script_run_context

    logger = logging.getLogger(script_run_context.__name__)
    if not any(isinstance(f, _PreloadContextFilter) for f in logger.filters):
        logger.addFilter(_PreloadContextFilter())
    _preload = threading.Thread(target=run, name=PRELOAD_THREAD, daemon=True)
    _preload.start()
    return _preload


def wait_for_light() -> None:
    """Until the preload (if this process started one) has imported pandas and plotly; at once otherwise.

    app.py calls this before its small first figure, which needs both whole."""
    if _preload is not None and _preload is not threading.current_thread():
        _light.wait()


def wait_for_preload() -> None:
    """Until the preload (if this process started one) has ended; at once otherwise.

    app.py calls this before importing torch and the pages: a session that arrives while the
    preload is importing them then waits for it rather than importing the same modules from a
    second thread (and loads the default checkpoint from the cache it filled, not a second time).
    """
    if _preload is not None and _preload is not threading.current_thread():
        _preload.join()


# Streamlit options this launcher sets unless the command line gives them: .streamlit/config.toml says
# the same, but Streamlit reads that file only from the folder it is started in.
DEFAULTS = {
    # Only this machine can reach the app: it runs models and reads folders on this machine.
    "--server.address": "127.0.0.1",
    # No watching of the app's source for edits (rerun on save). Streamlit's watcher walks the app's
    # whole folder, the .venv/ of the README's setup included (tens of thousands of files), when the
    # first session starts, on the thread that serves the page: that held the first page back until the
    # preload had ended, 1.5-2 s from launch at load 2. Someone editing the pages passes
    # --server.fileWatcherType auto.
    "--server.fileWatcherType": "none",
}


def with_defaults(streamlit_args: list[str]) -> list[str]:
    """``streamlit_args`` with each of :data:`DEFAULTS` it does not set (``--opt value`` or ``--opt=value``)."""
    added = []
    for option, value in DEFAULTS.items():
        if not any(arg == option or arg.startswith(option + "=") for arg in streamlit_args):
            added += [option, value]
    return [*added, *streamlit_args]


def main(argv: list[str]) -> None:
    streamlit_args, script_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    sys.path.insert(0, str(APP.parent))
    mark("python started")
    # Streamlit first, whole, on this thread (about 0.3 s): importing it sets up its plotly theme, which
    # builds plotly objects, and plotly looks pandas up in sys.modules without importing it. With the
    # preload thread halfway through importing pandas, that raised AttributeError ("partially initialized
    # module 'pandas'") and the server never came up. Nothing in the server's own start builds a figure.
    from streamlit.web import cli

    # The preload then runs beside the browser's loading of the page: from launch, the first page waits
    # for the longer of the two, not their sum. It starts once the server listens: beside the server's
    # own start (both are Python in one interpreter, so they take turns) the server answered at 0.8-0.9 s
    # instead of 0.5 s, and the page settled 0.1-0.3 s later (three starts each, 2026-12-05). app.py's
    # first run sends a small figure as soon as the preload has pandas and plotly (wait_for_light), so
    # the browser fetches and compiles plotly.js (4.7 MB) while the preload imports torch, instead of
    # after the page's script.
    start_preload(script_args, after=server_listening())
    streamlit_args = with_defaults(streamlit_args)
    sys.argv = ["streamlit", "run", str(APP), "--browser.gatherUsageStats", "false", *streamlit_args,
                *(["--", *script_args] if script_args else [])]
    sys.exit(cli.main())


if __name__ == "__main__":
    # Through the module ``ui.serve`` (not ``__main__``): app.py's ``from ui import serve`` must
    # find the thread this started.
    from ui import serve

    serve.main(sys.argv[1:])
