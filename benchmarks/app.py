"""The Inspect page's rerun time for a new 32-token prompt, after the model is loaded.

    python benchmarks/app.py [--checkpoints DIR] [--repeats 5]

Runs app.py headless with Streamlit's AppTest on the shipped default checkpoint: one run
loads the model (not timed), then each timed rerun types a prompt the page has not seen
(so no cached analysis helps) and draws everything the page shows by default. Prints the
median against the 1.5 s target, and the share of that time each part of the page takes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TARGET_S = 1.5


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoints", type=Path, default=Path(os.environ.get("WORKBENCH_CHECKPOINTS", REPO / "checkpoints")))
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    os.environ["WORKBENCH_CHECKPOINTS"] = str(args.checkpoints)

    from streamlit.testing.v1 import AppTest

    from ui import common

    texts = prompts(args.checkpoints / common.DEFAULT_CHECKPOINT, args.repeats)
    at = AppTest.from_file(str(REPO / "app.py"), default_timeout=300)
    started = time.perf_counter()
    at.run()
    print(f"first run (loads {common.DEFAULT_CHECKPOINT}): {time.perf_counter() - started:.2f} s")
    if at.exception:
        raise SystemExit(f"the page raised: {at.exception[0].value}")
    times = []
    for text in texts:
        started = time.perf_counter()
        at.text_area(key="prompt").set_value(text).run()
        times.append(time.perf_counter() - started)
        if at.exception or at.warning:
            raise SystemExit(f"the page did not draw the prompt: {(at.exception or at.warning)[0].value}")
    median = statistics.median(times)
    print(f"Inspect rerun, new 32-token prompt: median {median:.2f} s over {len(times)} "
          f"(min {min(times):.2f}, max {max(times):.2f}); target <= {TARGET_S} s; "
          f"ratio to target {median / TARGET_S:.2f} ({'OK' if median <= TARGET_S else 'OVER'})")
    print(f"models loaded from disk during the reruns: {sum(common.LOADS.values()) - 1}")


if __name__ == "__main__":
    main()
