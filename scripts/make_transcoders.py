"""Rebuild the shipped MLP replacements of stories-2026 and stories-2020: a skip-transcoder set and a CLT each.

    python scripts/make_transcoders.py                    # into checkpoints/NAME/saes/{transcoders,clt}/
    python scripts/make_transcoders.py --check-only       # re-measure the shipped ones; train nothing
    python scripts/make_transcoders.py --only stories-2026

For each checkpoint: every layer's MLP input (``ln2.hook_normalized``) and output (``hook_mlp_out``)
on the stories task are collected into a temporary store (deleted afterwards), then trained:
one ReLU skip-transcoder per layer (``saes/transcoders/layer{l}``, SAELens' format) and one JumpReLU
cross-layer transcoder without skip (``saes/clt``, so it also exports to circuit-tracer's CLT files).
The weights are stored in float16 (a few hundred kB each). The metrics written into each folder
(and in docs/reference/cross-layer-transcoders.md) are measured on the float16 weights, on
``EVAL`` sequences of the task's validation split (the same sequences every time: the task's
batches are a function of the seed): explained variance per layer, L0, CE loss recovered with
every MLP replaced (no error term) and zero-ablated. ``--check-only`` measures them again and fails
when one moved by more than 1e-3, or when splicing with error terms changes the model's logits.

One thread, so a rebuild on the same machine and torch build gives the same weights.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

import workbench as wb  # noqa: E402
from workbench import analysis as an  # noqa: E402
from workbench.analysis.dictionaries.evaluate import ce_loss_recovered, reconstruction_metrics  # noqa: E402
from workbench.analysis.dictionaries.trainer import clt_hooks  # noqa: E402
from workbench.data import get_task  # noqa: E402

CHECKPOINTS = ("stories-2026", "stories-2020")
ROWS_PER_SHARD = 8 * 32 * 63  # 8 batches of 32 sequences of 64 tokens, the first position dropped
COLLECT = dict(tokens=4 * ROWS_PER_SHARD, batch_size=32, seq_len=64, tokens_per_shard=ROWS_PER_SHARD)  # 3 train, 1 held out
EVAL = dict(tokens=ROWS_PER_SHARD // 2, batch_size=32, seq_len=64, tokens_per_shard=ROWS_PER_SHARD // 2, split="val")
COMMON = dict(steps=800, batch_size=1024, seed=0, threads=1, log_every=50, save_train_state=False, eval_sequences=0)
TRANSCODER = dict(kind="skip_transcoder", d_sae=256, **COMMON)
CLT = dict(kind="clt", d_sae=256, activation="jumprelu", skip=False, **COMMON)
TOLERANCE = 1e-3


def folders(root: Path, name: str, n_layers: int) -> dict:
    saes = root / name / "saes"
    return {"transcoders": [saes / "transcoders" / f"layer{layer}" for layer in range(n_layers)], "clt": saes / "clt"}


def to_float16(folder: Path) -> None:
    """Rewrite a dictionary folder's weights in float16 and record the dtype in its JSON files."""
    for weights in folder.glob("*.safetensors"):
        save_file({k: v.half().contiguous() for k, v in load_file(str(weights)).items()}, str(weights))
    for config in ("cfg.json", "sae_meta.json", "clt.json"):
        file = folder / config
        if file.exists():
            data = json.loads(file.read_text())
            if "config" in data:
                data["config"]["dtype"] = "float16"
            if "dtype" in data:
                data["dtype"] = "float16"
            file.write_text(json.dumps(data, indent=1))


@torch.no_grad()
def measure(model, task, tcs: list, clt, tmp: Path) -> dict:
    """Metrics of the set and the CLT on the validation sequences (rebuilt identically each time)."""
    store = an.ActivationStore.collect(model, task, clt_hooks(model.cfg.n_layers), EVAL["tokens"], tmp / "eval",
                                       batch_size=EVAL["batch_size"], seq_len=EVAL["seq_len"],
                                       tokens_per_shard=EVAL["tokens_per_shard"], split="val", progress=False)
    tokens = store.load_shard(0, [], with_tokens=True)["token_ids"].long()[:64]
    out: dict = {"transcoders": {}, "clt": {}}
    for layer, tc in enumerate(tcs):
        m, _ = reconstruction_metrics(tc, store)
        out["transcoders"][f"explained_variance_layer{layer}"] = m["explained_variance"]
        out["transcoders"][f"l0_layer{layer}"] = m["l0"]
    out["transcoders"].update(_ce_all(model, tcs, tokens))
    m, _ = reconstruction_metrics(clt, store)
    out["clt"] = {k: v for k, v in m.items() if k.startswith(("explained_variance", "l0"))}
    out["clt"].update(ce_loss_recovered(model, clt, tokens))
    out["clt"]["dead_fraction"] = m["dead_fraction"]
    # with error terms every replacement leaves the model's logits as they were
    clean = model(tokens[:8])
    for reps in (tcs, [clt]):
        with an.spliced(model, *reps, error_term=True):
            drift = float((model(tokens[:8]) - clean).abs().max())
        out["clt" if reps[0] is clt else "transcoders"]["error_term_logit_drift"] = drift
    out["eval"] = {"split": "val", "rows": store.n_rows, "ce_sequences": len(tokens)}
    shutil.rmtree(tmp / "eval", ignore_errors=True)
    return out


def _ce_all(model, tcs: list, tokens) -> dict:
    """CE loss with every MLP replaced by its transcoder (no error term), clean and every MLP zeroed."""
    def zero(value, hook):
        return torch.zeros_like(value)

    clean = float(model(tokens, return_type="loss"))
    ablated = float(model.run_with_hooks(tokens, return_type="loss",
                                         fwd_hooks=[(tc.cfg.hook_name_out, zero) for tc in tcs]))
    with an.spliced(model, *tcs, error_term=False):
        spliced = float(model(tokens, return_type="loss"))
    return {"ce_loss_clean": clean, "ce_loss_spliced": spliced, "ce_loss_zero_ablated": ablated,
            "ce_loss_recovered": (ablated - spliced) / (ablated - clean)}


def build(root: Path, name: str) -> dict:
    model, _ = wb.load_checkpoint(root / name)
    model.eval()
    task = get_task("stories", seed=0)
    where = folders(root, name, model.cfg.n_layers)
    tmp = Path(tempfile.mkdtemp(prefix="acts-"))
    started = time.perf_counter()
    try:
        store = an.ActivationStore.collect(model, task, clt_hooks(model.cfg.n_layers), COLLECT["tokens"], tmp / "store",
                                           batch_size=COLLECT["batch_size"], seq_len=COLLECT["seq_len"],
                                           tokens_per_shard=COLLECT["tokens_per_shard"], progress=False)
        for folder in where["transcoders"] + [where["clt"]]:
            if folder.exists():
                shutil.rmtree(folder)
        for layer, folder in enumerate(where["transcoders"]):
            an.train_sae(store, out=folder, model=model, hook=f"blocks.{layer}.ln2.hook_normalized",
                         hook_out=f"blocks.{layer}.hook_mlp_out", progress=False, **TRANSCODER)
        an.train_sae(store, out=where["clt"], model=model, progress=False, **CLT)
        for folder in where["transcoders"] + [where["clt"]]:
            to_float16(folder)
        tcs, clt = load(root, name, model.cfg.n_layers)
        metrics = measure(model, task, tcs, clt, tmp)
        for folder, part in [(f, "transcoders") for f in where["transcoders"]] + [(where["clt"], "clt")]:
            meta_file = folder / ("clt.json" if part == "clt" else "sae_meta.json")
            meta = json.loads(meta_file.read_text())
            meta["shipped_metrics"] = metrics[part] | {"eval": metrics["eval"]}
            meta_file.write_text(json.dumps(meta, indent=1))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    size_mb = sum(f.stat().st_size for folder in where["transcoders"] + [where["clt"]]
                  for f in folder.iterdir()) / 1e6
    print(f"{name}: {size_mb:.2f} MB in {(time.perf_counter() - started) / 60:.1f} min", flush=True)
    show(name, metrics)
    return {"metrics": metrics, "size_mb": size_mb}


def load(root: Path, name: str, n_layers: int) -> tuple[list, object]:
    where = folders(root, name, n_layers)
    return [an.load_dictionary(f) for f in where["transcoders"]], an.load_dictionary(where["clt"])


def show(name: str, metrics: dict) -> None:
    for part in ("transcoders", "clt"):
        m = metrics[part]
        layers = sorted(int(k.rsplit("layer", 1)[1]) for k in m if k.startswith("explained_variance_layer"))
        ev = ", ".join(f"{m[f'explained_variance_layer{layer}']:.3f}" for layer in layers)
        l0 = ", ".join(f"{m[f'l0_layer{layer}']:.1f}" for layer in layers)
        print(f"  {name} {part}: explained variance per layer [{ev}], L0 per layer [{l0}], "
              f"CE loss {m['ce_loss_clean']:.3f} clean / {m['ce_loss_spliced']:.3f} replaced / "
              f"{m['ce_loss_zero_ablated']:.3f} zeroed (recovered {m['ce_loss_recovered']:.3f}), "
              f"error-term drift {m['error_term_logit_drift']:.1e}", flush=True)


def check(root: Path, name: str) -> bool:
    model, _ = wb.load_checkpoint(root / name)
    model.eval()
    tcs, clt = load(root, name, model.cfg.n_layers)
    tmp = Path(tempfile.mkdtemp(prefix="acts-"))
    try:
        metrics = measure(model, get_task("stories", seed=0), tcs, clt, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    show(name, metrics)
    ok = True
    for part, folder in (("transcoders", folders(root, name, model.cfg.n_layers)["transcoders"][0]),
                         ("clt", folders(root, name, model.cfg.n_layers)["clt"])):
        recorded = json.loads((folder / ("clt.json" if part == "clt" else "sae_meta.json")).read_text())["shipped_metrics"]
        for key, value in metrics[part].items():
            if key == "error_term_logit_drift":
                good = value < 1e-4
            else:
                good = abs(value - recorded[key]) <= TOLERANCE
            if not good:
                print(f"  FAIL {name} {part} {key}: {value:.5f} now, {recorded.get(key)} recorded")
                ok = False
    print(f"  {'ok  ' if ok else 'FAIL'} {name}: the shipped metrics hold")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoints", type=Path, default=Path(__file__).resolve().parents[1] / "checkpoints")
    parser.add_argument("--check-only", action="store_true", help="re-measure the shipped replacements; train nothing")
    parser.add_argument("--only", choices=CHECKPOINTS, help="one checkpoint only")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    names = [args.only] if args.only else list(CHECKPOINTS)
    if args.check_only:
        return 0 if all([check(args.checkpoints, n) for n in names]) else 1
    results = [build(args.checkpoints, n) for n in names]
    return 0 if all(r["size_mb"] < 2.0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
