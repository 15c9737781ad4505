"""ui.tl_import: the app server imports TransformerLens's hook points without the package's heavy parts,
and every name still resolves to what a plain ``import transformer_lens`` gives."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("datasets", "transformers", "pytest", "rich", "transformer_lens.evals", "transformer_lens.model_bridge")


def _run(code: str) -> dict:
    """The JSON that ``code`` prints last, run in a fresh interpreter in the repository."""
    out = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, '.')\n" + code], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


# A forward of the shipped default checkpoint and TransformerLens' own cache methods over it.
MODEL = """
import json, torch, workbench
from transformer_lens import ActivationCache
model = workbench.load_checkpoint({path!r})[0]
tokens = torch.arange(12).unsqueeze(0) % model.cfg.d_vocab
logits, cache = model.run_with_cache(tokens)
resid = cache.accumulated_resid(layer=-1, incl_mid=True, apply_ln=True, pos_slice=-1)
heads = cache.stack_head_results(layer=-1, pos_slice=-1)
print(json.dumps(dict(logits=logits[0, -1, :50].tolist(), resid=resid.flatten()[:200].tolist(),
                      heads=heads.flatten()[:200].tolist(), cache_class=isinstance(cache, ActivationCache),
                      heavy=[m for m in {heavy!r} if m in sys.modules])))
"""


def test_the_core_import_leaves_out_datasets_and_transformers_and_the_model_gives_the_same_numbers(
        checkpoints_dir):
    """With import_core, the default checkpoint loads, runs and is read through ActivationCache's methods
    (which call into transformer_lens.utilities) with none of datasets, transformers, pytest, rich, the
    evals or the model bridge imported, and its numbers equal those of a process that imported
    TransformerLens the plain way."""
    code = MODEL.format(path=str(checkpoints_dir / "stories-2026"), heavy=HEAVY)
    lazy = _run("from ui import tl_import\nassert tl_import.import_core()\n" + code)
    plain = _run("import transformer_lens\n" + code)
    assert lazy["heavy"] == []
    assert set(plain["heavy"]) >= {"datasets", "transformers"}  # what the plain import costs
    assert lazy["cache_class"] and plain["cache_class"]
    for key in ("logits", "resid", "heads"):
        assert lazy[key] == plain[key], key


NAMESPACE = """
import json, types
import transformer_lens as tl
tl.TransformerBridge; dir(tl.utilities); dir(tl.conversion_utils)
def describe(module):
    return {name: (type(value).__name__, getattr(value, "__module__", None) or getattr(value, "__name__", None))
            for name, value in vars(module).items() if not name.startswith("__")}
print(json.dumps(dict(top=describe(tl), utilities=describe(tl.utilities), dir=sorted(dir(tl)),
                      conversion=describe(tl.conversion_utils))))
"""


def test_after_the_core_import_every_name_resolves_as_a_plain_import_would():
    """A name the core import left out runs the package's real __init__ on first use: then the package's
    namespace (names, types and defining modules), ``dir()`` included, equals a plain import's."""
    lazy = _run("from ui import tl_import\nassert tl_import.import_core()\n\n" + NAMESPACE)
    plain = _run(NAMESPACE)
    for key in ("top", "utilities", "conversion", "dir"):
        assert lazy[key] == plain[key], key


def test_a_removed_name_still_raises_transformer_lens_own_message_and_utilities_names_resolve_one_by_one():
    out = _run("""
import json, sys
from ui import tl_import
assert tl_import.import_core()
import transformer_lens
from transformer_lens.utilities import get_act_name
name = get_act_name("resid_pre", 3)
light = [m for m in ("datasets", "transformers") if m in sys.modules]
still_lazy = tl_import.lazy(transformer_lens.utilities)
try:
    from transformer_lens import utils
    message = None
except ImportError as error:
    message = str(error)
print(json.dumps(dict(name=name, light=light, still_lazy=still_lazy, message=message,
                      top_lazy=tl_import.lazy(transformer_lens))))
""")
    assert out["name"] == "blocks.3.hook_resid_pre"
    assert out["light"] == [] and out["still_lazy"]  # one name imported one module, not the whole package
    assert "transformer_lens.utilities" in out["message"]  # TransformerLens' own pointer
    assert not out["top_lazy"]  # the removed name ran the real __init__


def test_threads_asking_for_a_left_out_name_at_once_all_get_it():
    """Eight threads ask for TransformerBridge while the real __init__ runs: each waits for it and gets
    the class (none sees the half-built package)."""
    out = _run("""
import json, threading
from ui import tl_import
assert tl_import.import_core()
import transformer_lens
got, barrier = [], threading.Barrier(8)
def ask():
    barrier.wait()
    try:
        got.append(transformer_lens.TransformerBridge.__name__)
    except Exception as error:
        got.append(repr(error))
threads = [threading.Thread(target=ask) for _ in range(8)]
[t.start() for t in threads]; [t.join() for t in threads]
print(json.dumps(got))
""")
    assert out == ["TransformerBridge"] * 8


def test_it_does_nothing_when_transformer_lens_is_in_and_falls_back_to_a_plain_import_on_a_surprise():
    out = _run("""
import json, sys
from ui import tl_import
import transformer_lens
first = tl_import.import_core()
print(json.dumps(dict(first=first, lazy=tl_import.lazy(transformer_lens))))
""")
    assert out == {"first": False, "lazy": False}
    # A layout this does not expect (here: a module that is not there) leaves a plain import behind.
    out = _run("""
import json, sys
from ui import tl_import
tl_import.CORE = tl_import.CORE + ("transformer_lens.no_such_module",)
done = tl_import.import_core()
import transformer_lens
print(json.dumps(dict(done=done, lazy=tl_import.lazy(transformer_lens), datasets="datasets" in sys.modules,
                      bridge=transformer_lens.TransformerBridge.__name__)))
""")
    assert out == {"done": False, "lazy": False, "datasets": True, "bridge": "TransformerBridge"}


def test_a_first_page_under_plain_streamlit_run_leaves_out_datasets_and_transformers(checkpoints_dir):
    """app.py makes the same core import before its pages' (plain ``streamlit run``, no preload): the first
    Inspect run in a fresh process draws without datasets or transformers imported."""
    code = f"""
import json, os
from streamlit.testing.v1 import AppTest
os.environ["WORKBENCH_CHECKPOINTS"] = {str(checkpoints_dir)!r}
at = AppTest.from_file(os.path.join(os.getcwd(), "app.py"), default_timeout=300)
at.run()
assert not at.exception, [e.value for e in at.exception]
import transformer_lens
print(json.dumps(dict(heavy=[m for m in {HEAVY!r} if m in sys.modules], figures=len(at.get("plotly_chart")),
                      lazy=__import__("ui.tl_import").tl_import.lazy(transformer_lens))))
"""
    out = _run(code)
    assert out["heavy"] == [] and out["lazy"]
    assert out["figures"] >= 5  # the page drew its figures
