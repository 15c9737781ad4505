"""The app's server time: first page after start, a new prompt, and cached widget changes.

    python benchmarks/app.py [--checkpoints DIR] [--repeats 5]
    python benchmarks/app.py --browser [--repeats 3] [--cold 1]   # in Chromium (benchmarks/app_browser.py)

Runs app.py headless with Streamlit's AppTest on the shipped default checkpoint, and prints
each measurement against its target:

- first page after start (<= 10 s on 2 CPU cores): a fresh Python process from its start
  (imports included) to the end of the Inspect page's first run (the model loaded, every
  analysis computed, every figure built);
- a new prompt on the default page (<= 0.5 s): a rerun after typing a 32-token prompt the
  page has not seen (no cached analysis helps), median over ``--repeats``;
- cached widget changes (<= 0.3 s each): a layer select, a head select and a tab switch
  on a prompt already analysed (the analyses are cached; only drawing remains), median;
  and on the Steer and Features pages, a scale and a feature changed back to values drawn before.

Server time is what AppTest measures: the script's run, not the browser drawing it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TARGETS = {"first page": 10.0, "new prompt": 0.5, "cached widget": 0.3}

FIRST_PAGE = """
import sys, time
start = float(sys.argv[1])
sys.path.insert(0, sys.argv[2])
from streamlit.testing.v1 import AppTest
at = AppTest.from_file(sys.argv[2] + "/app.py", default_timeout=300)
at.run()
assert not at.exception, at.exception[0].value
print(time.time() - start)
"""


def prompts(checkpoint: Path, n: int, length: int = 32) -> list[str]:
    """``n`` different prompts of exactly ``length`` tokens, cut from the default prompt repeated."""
    import workbench as wb
    from ui import common

    model, tok = wb.load_checkpoint(checkpoint)
    ckpt = common.Checkpoint(checkpoint.name, str(checkpoint), 0, model,
                             tok or common.IdTokenizer(model.cfg.d_vocab), {}, None)
    ids = ckpt.tokenizer.encode(common.default_prompt(ckpt))
    ids = ids * (length // len(ids) + 2)
    out = []
    for start in range(len(ids)):
        text = ckpt.tokenizer.decode(ids[start : start + length])
        if len(ckpt.tokenizer.encode(text)) == length and text not in out:
            out.append(text)
        if len(out) == n:
            return out
    raise SystemExit(f"could not cut {n} distinct {length}-token prompts from the default prompt")


def report(name: str, seconds: list[float]) -> None:
    target = TARGETS["cached widget" if name.startswith("cached") else name]
    median = statistics.median(seconds)
    spread = f" over {len(seconds)} (min {min(seconds):.2f}, max {max(seconds):.2f})" if len(seconds) > 1 else ""
    print(f"{name}: median {median:.2f} s{spread}; target <= {target} s; ratio to target {median / target:.2f} "
          f"({'OK' if median <= target else 'OVER'})")


def first_page(env: dict) -> float:
    started = time.time()
    out = subprocess.run([sys.executable, "-c", FIRST_PAGE, str(started), str(REPO)], env=env, capture_output=True,
                         text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def timed(at, change) -> float:
    change(at)
    started = time.perf_counter()
    at.run()
    seconds = time.perf_counter() - started
    if at.exception:
        raise SystemExit(f"the page raised: {at.exception[0].value}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoints", type=Path, default=Path(os.environ.get("WORKBENCH_CHECKPOINTS", REPO / "checkpoints")))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--browser", action="store_true",
                        help="click-to-settled times in Chromium instead of AppTest's server time")
    parser.add_argument("--cold", type=int, default=1, help="with --browser: cold server starts to time")
    parser.add_argument("--first-only", action="store_true", help="with --browser: only the first page")
    parser.add_argument("--real-model", action="store_true",
                        help="with --browser: also the first page with the real model (SmolLM2-135M, the picker's "
                             "pretrained entry) as the default, from an empty checkpoints folder")
    args = parser.parse_args()
    if args.browser:
        from app_browser import main as browser_main

        browser_main(args.repeats, args.cold, args.checkpoints, args.first_only, args.real_model)
        return
    os.environ["WORKBENCH_CHECKPOINTS"] = str(args.checkpoints)
    print(f"{os.cpu_count()} CPU cores; torch threads per the app: {os.environ.get('WORKBENCH_THREADS', '1')}")

    report("first page", [first_page(dict(os.environ))])

    from streamlit.testing.v1 import AppTest

    from ui import common

    texts = prompts(args.checkpoints / common.DEFAULT_CHECKPOINT, args.repeats + 1)
    at = AppTest.from_file(str(REPO / "app.py"), default_timeout=300)
    at.run()
    if at.exception:
        raise SystemExit(f"the page raised: {at.exception[0].value}")
    timed(at, lambda at: at.text_area(key="prompt").set_value(texts[-1]))  # warms what is cached per process
    new = [timed(at, lambda at, t=t: at.text_area(key="prompt").set_value(t)) for t in texts[:-1]]
    report("new prompt", new)

    layers, heads = len(at.selectbox(key="attn_layer").options), len(at.selectbox(key="attn_head").options)
    changes = {
        "cached layer select": [lambda at, i=i: at.selectbox(key="attn_layer").set_value(i % layers)
                                for i in range(1, args.repeats + 1)],
        "cached head select": [lambda at, i=i: at.selectbox(key="attn_head").set_value(i % heads)
                               for i in range(1, args.repeats + 1)],
        "cached tab switch": [lambda at, i=i: at.session_state.__setitem__(
            "attn_tab", ("Head scores", "One head", "Every head")[i % 3]) for i in range(args.repeats + 3)],
    }
    for tab in ("Head scores", "Every head", "One head"):  # each tab once, so its analyses are cached
        timed(at, lambda at, tab=tab: at.session_state.__setitem__("attn_tab", tab))
    for name, steps in changes.items():
        times = [timed(at, step) for step in steps]
        report(name, times[-args.repeats:])
    # Steer and Features: back and forth between two values, each drawn once before (cached).
    for page, key, kind, pair in (("Steer", "steer_scale_add", "slider", (8.0, 4.0)),
                                  ("Features", "feat_id", "selectbox", None)):
        timed(at, lambda at, page=page: at.radio(key="page").set_value(page))
        pair = pair or (getattr(at, kind)(key=key).value, 206)
        steps = [lambda at, v=pair[i % 2], kind=kind, key=key: getattr(at, kind)(key=key).set_value(v)
                 for i in range(args.repeats + 2)]
        times = [timed(at, step) for step in steps]
        report(f"cached {page} {kind}", times[2:])
    print(f"models loaded from disk after the first run: {sum(common.LOADS.values()) - 1}")


if __name__ == "__main__":
    main()
