"""Every experiment runs end to end in --quick mode and writes its run directory; --help works;
the torchrun grid split gives the same rows as one process."""

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
EXPERIMENTS = ["param_table", "kv_cache_gqa", "head_ablation_sweep", "lens_comparison", "norm_placement_depth",
               "component_swap", "steering_sweep", "circuit_benchmark", "prompt_patching", "block_eras", "grokking",
               "mib_circuits", "synth_sae_bench", "real_induction", "real_lenses", "real_ioi"]
sys.path.insert(0, str(REPO / "experiments"))


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_quick_run_writes_its_run_directory(name, tmp_path, capsys):
    module = importlib.import_module(name)
    results = module.main(["--quick", "--out", str(tmp_path), "--threads", "1"])
    assert isinstance(results, pd.DataFrame) and len(results) > 0
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["experiment"] == name and config["quick"] is True
    on_disk = pd.read_csv(tmp_path / "results.csv")
    assert list(on_disk.columns) == list(results.columns) and len(on_disk) == len(results)
    figures = list(tmp_path.glob("*.html"))
    assert figures and all("plotly" in f.read_text()[:5000].lower() for f in figures)
    assert (tmp_path / "plotly.min.js").exists()  # figures open offline
    assert str(tmp_path) in capsys.readouterr().out  # the summary table was printed


def test_experiment_results_make_sense(tmp_path):
    table = importlib.import_module("param_table").main(["--quick", "--out", str(tmp_path)])
    gpt3 = table.set_index("preset").loc["gpt3-175b"]
    assert 174e9 < gpt3.exact < 176e9 and abs(gpt3.relative) < 0.001  # the closed form is GPT-3's count
    kv = importlib.import_module("kv_cache_gqa").main(["--quick", "--out", str(tmp_path / "kv")])
    mla, kv = kv[kv.kind == "MLA"], kv[kv.kind != "MLA"]
    assert kv.kv_bytes_per_token.is_monotonic_decreasing and kv.n_kv_heads.iloc[-1] == 1
    assert kv.cache_vs_mha.iloc[-1] == pytest.approx(1 / kv.n_heads.iloc[0])
    # MLA row: 1 layer x (latent 4 * d_head 8 = 32 + RoPE key 4) x bf16 against MHA's 2 x 4 heads x 8 x 2
    assert mla.kv_bytes_per_token.tolist() == [72] and mla.cache_vs_mha.iloc[0] == pytest.approx(72 / 128)


PROMPTS = [  # IOI-like prompts of different lengths; the corrupted prompts differ in length too
    ("When Mary and John went to the store , John gave a drink to", "When Mary and John went to the store , "
     "the tall Anna gave a drink to", "Mary", "John", 0),
    ("Then Anne and Bob talked ; Bob handed a book to", "Then Anne and Bob talked ; Tom handed a book to",
     "Anne", "Bob", 1),
    ("Tom and Kate met ; Kate gave a cup to", "Tom and Kate met ; Sam gave a cup to", "Tom", "Kate", 0),
]


def _prompt_file(tmp_path, suffix):
    frame = pd.DataFrame(PROMPTS, columns=["prompt", "corrupted", "answer", "wrong", "group"])
    path = tmp_path / f"prompts{suffix}"
    frame.to_csv(path, index=False) if suffix == ".csv" else frame.to_json(path, orient="records", lines=True)
    return path


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_head_ablation_sweep_over_a_prompt_file_reports_each_head_over_the_prompts(tmp_path, suffix):
    import workbench as wb
    from workbench.analysis import ablation_sweep

    path = _prompt_file(tmp_path, suffix)
    module = importlib.import_module("head_ablation_sweep")
    results = module.main(["--quick", "--out", str(tmp_path / "run"), "--threads", "1", "--prompts", str(path),
                           "--methods", "zero,mean", "--batch", "2"])
    assert set(results.prompt) == {0, 1, 2} and results.group.tolist()[:3] == [0, 1, 0]  # the file's columns
    summary = pd.read_csv(tmp_path / "run" / "summary.csv")
    assert summary.n.eq(3).all() and len(summary) == 2 * 2 * 4
    # the same sweep by hand: each head's mean over the prompts, each prompt scored alone
    prompts = wb.PromptSet.from_csv(path) if suffix == ".csv" else wb.PromptSet.from_jsonl(path)
    model = module._common.word_model(prompts, 0).eval()
    alone = [ablation_sweep(model, prompts[[i]], methods=("zero",)).delta.to_numpy() for i in range(3)]
    zero = summary[summary.method == "zero"]
    assert zero.delta_mean.to_numpy() == pytest.approx(sum(alone) / 3, abs=1e-5)


def test_prompt_patching_over_a_prompt_file_aligns_positions_per_row(tmp_path):
    path = _prompt_file(tmp_path, ".csv")
    module = importlib.import_module("prompt_patching")
    results = module.main(["--quick", "--out", str(tmp_path / "run"), "--threads", "1", "--prompts", str(path),
                           "--positions=-2,END", "--batch", "2"])
    assert set(results[results.site == "resid_pre"].pos) == {-2, "END"}  # positions named in the table
    heads = results[results.site == "head"]
    assert heads.attribution.notna().all() and set(heads.prompt) == {0, 1, 2}
    summary = pd.read_csv(tmp_path / "run" / "summary.csv")
    assert summary.n.eq(3).all()


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_help_describes_every_experiment(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        importlib.import_module(name).main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "--quick" in text and "--out" in text and f"experiments/{name}.py" in text


def test_seeds_give_each_cell_a_mean_and_an_interval(tmp_path, capsys):
    module = importlib.import_module("component_swap")
    results = module.main(["--quick", "--out", str(tmp_path), "--threads", "1", "--seeds", "2",
                           "--variants", "baseline,positions=learned"])
    assert sorted(zip(results.variant, results.seed)) == [("baseline", 0), ("baseline", 1),
                                                          ("positions=learned", 0), ("positions=learned", 1)]
    summary = pd.read_csv(tmp_path / "summary.csv").set_index("variant")
    assert summary.n.tolist() == [2, 2]
    from workbench.stats import t_interval

    base = results[results.variant == "baseline"].induction_score_max
    expected = t_interval(base)
    assert summary.loc["baseline", "induction_score_max_mean"] == pytest.approx(expected.mean)
    assert summary.loc["baseline", "induction_score_max_low"] == pytest.approx(expected.low)
    printed = capsys.readouterr().out
    assert "vs baseline: " in printed and "mean [95% interval]" in printed
    with pytest.raises(SystemExit, match="--seeds must be >= 1"):
        module.main(["--quick", "--out", str(tmp_path / "none"), "--seeds", "0"])


@pytest.mark.slow  # two torchrun processes; deselect with -m "not slow"
def test_seeds_grid_of_a_training_experiment_splits_across_ranks(tmp_path):
    # Each rank trains its own grid items with train(), which must stay single-process under
    # torchrun (no hiding of RANK / WORLD_SIZE); rank 0 gathers one table equal to one process's.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = ["--quick", "--threads", "1", "--seeds", "2", "--variants", "baseline,kv=MQA"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=29643",
           str(REPO / "experiments" / "component_swap.py"), *args, "--out", str(tmp_path / "two")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    importlib.import_module("component_swap").main([*args, "--out", str(tmp_path / "one")])
    for name in ("results.csv", "summary.csv"):
        pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "two" / name), pd.read_csv(tmp_path / "one" / name))


@pytest.mark.slow  # two torchrun processes; deselect with -m "not slow"
def test_grid_split_across_two_ranks_matches_one_process(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=29641",
           str(REPO / "experiments" / "param_table.py"), "--quick", "--out", str(tmp_path / "two")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    one = importlib.import_module("param_table").main(["--quick", "--out", str(tmp_path / "one")])
    two = pd.read_csv(tmp_path / "two" / "results.csv")
    pd.testing.assert_frame_equal(two, pd.read_csv(tmp_path / "one" / "results.csv"))
    assert len(one) == len(two)


def test_a_stopped_grid_resumes_from_its_journal_and_the_journal_goes_once_written(tmp_path):
    import argparse

    import _common

    args = argparse.Namespace(out=tmp_path / "run", seeds=1, seed=0, threads=0, quick=True, steps=3)
    calls, fail_at = [], {2}

    def one(item):
        calls.append(item)
        if item in fail_at:
            raise RuntimeError("stopped")  # the machine went away mid-grid
        yield {"item": item, "square": item * item, "half": item / 2}

    _common.setup(args)
    with pytest.raises(RuntimeError):
        _common.run_grid(list(range(4)), one)
    assert calls == [0, 1, 2] and (args.out / "grid.rank0.jsonl").exists()
    assert _common.run_files(args.out) is not None  # still a run directory: the same --out is accepted again
    fail_at.clear()
    calls.clear()
    _common.setup(args)
    frame = _common.run_grid(list(range(4)), one)
    assert calls == [2, 3]  # items 0 and 1 came from the journal
    assert frame.to_dict("records") == [{"item": i, "square": i * i, "half": i / 2} for i in range(4)]
    args.steps = 4  # other flags: the journal is not theirs, every item runs again
    calls.clear()
    _common.setup(args)
    _common.run_grid(list(range(4)), one)
    assert calls == [0, 1, 2, 3]
    _common.write_run(args.out, {"experiment": "x"}, frame, {})
    assert not (args.out / "grid.rank0.jsonl").exists()
    assert "grid.rank0.jsonl" not in _common.run_files(args.out)


def test_real_lenses_quick_reads_the_model_itself_at_the_final_layer(tmp_path):
    """At the final stream both lenses are the model: KL 0 and full agreement with its top token;
    below it the KLs are positive (a random model's streams are not its output)."""
    wide = importlib.import_module("real_lenses").main(["--quick", "--out", str(tmp_path), "--threads", "1"])
    last = wide[wide.layer == wide.layer.max()]
    assert (last[["logit_kl", "tuned_kl"]].abs() < 1e-5).all().all()
    assert (last[["logit_agree", "tuned_agree"]] == 1).all().all()
    assert (wide[wide.layer < wide.layer.max()].logit_kl > 0).all()


def _open_rank_journal(out: str, rank: int, world: int, start) -> None:
    """One torchrun rank opening its journal (a process of its own, as under torchrun)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(REPO / "experiments"))
    import _common

    _common._JOURNAL.update(out=Path(out), key={"flag": "1"})
    start.wait()
    _common._open_journal(rank, world, 8)


def test_ranks_opening_their_journals_at_once_all_land_in_the_manifest(tmp_path):
    """Every rank lists its journal in the run folder's manifest before writing it. The ranks start
    together, so the read-modify-write of one manifest must be serialised (and each write atomic): a
    rank that read the manifest half-written, or wrote over another rank's update, left that rank's
    journal unlisted, and the run's own tables were then refused as "not written by an experiment run"
    (seen with 3 torchrun ranks)."""
    import multiprocessing

    from workbench.checkpoint import MANIFEST_FILE

    ctx = multiprocessing.get_context("fork")
    for trial in range(3):
        out = tmp_path / f"run{trial}"
        world = 6
        start = ctx.Barrier(world)
        procs = [ctx.Process(target=_open_rank_journal, args=(str(out), r, world, start)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
        listed = json.loads((out / MANIFEST_FILE).read_text())["files"]
        assert sorted(listed) == sorted(f"grid.rank{r}.jsonl" for r in range(world)), (trial, listed)


def test_real_transcoders_quick_saves_a_transcoder_set_and_its_numbers_hold_against_references(tmp_path):
    """The --quick pipeline (a tiny random model): the transcoders land where the Graph page looks
    (saes/transcoders/layer{l}), each held-out explained variance matches one recomputed from the
    model's own activations, splicing with error terms gives the model's own loss (torch's cross
    entropy on its logits), and every re-measured edge equals the intervention on the frozen model."""
    from workbench.analysis.graphs import measured_edge

    module = importlib.import_module("real_transcoders")
    out, run = tmp_path / "ckpt", tmp_path / "run"
    r = module.main(["--quick", "--out", str(out), "--run-dir", str(run), "--threads", "1"])
    model, tcs = r["model"], r["transcoders"]
    n = model.cfg.n_layers
    folders = sorted((out / "saes" / "transcoders").iterdir())
    assert [f.name for f in folders] == [f"layer{layer}" for layer in range(n)]
    assert all((f / "cfg.json").is_file() and (f / "sae_weights.safetensors").is_file() for f in folders)
    _, cache = model.run_with_cache(r["eval_tokens"])
    for layer, tc in enumerate(tcs):
        x = cache[f"blocks.{layer}.ln2.hook_normalized"][:, 1:].reshape(-1, model.cfg.d_model)
        y = cache[f"blocks.{layer}.hook_mlp_out"][:, 1:].reshape(-1, model.cfg.d_model).double()
        with torch.no_grad():
            ev = 1 - (tc(x).double() - y).pow(2).sum() / (y - y.mean(0)).pow(2).sum()
        assert abs(float(ev) - r["layers"].explained_variance[layer]) < 2e-2  # the store holds float16
    tokens = r["ce_tokens"]
    with torch.no_grad():
        logits = model(tokens)
    own = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    assert abs(r["loss"]["ce_loss_spliced_with_error"] - float(own)) < 1e-4
    assert r["loss"]["error_term_max_logit_drift"] < 1e-4
    edges = r["edges"]
    assert len(edges) > 0 and (edges.abs_diff <= 1e-4 * edges.edge.abs().clip(lower=1)).all()
    assert (run / "ioi-graph.json").is_file() and (run / "path.csv").is_file()
    graph = r["graph"]  # edges into features from tokens at other positions (through attention) re-measured too
    cross = [(int(s), int(t), float(w)) for s, t, w in zip(graph.edge_source, graph.edge_target, graph.edge_weight)
             if graph.kind[t] == 0 and graph.kind[s] == 2 and graph.pos[s] != graph.pos[t]]
    cross = sorted(cross, key=lambda e: -abs(e[2]))[:4]
    assert cross and all(abs(measured_edge(graph, s, t) - w) <= 1e-4 * max(1.0, abs(w))
                         for s, t, w in cross)
    qk = r["qk"]  # the induction head's score split into pairs: they sum to the model's score
    assert len(qk) > 0 and abs(r["config"]["qk_bilinear"] + r["config"]["qk_residual"] - r["config"]["qk_score"]) < 1e-5
    module.check_folders(folders)  # its own folders: replaced by a rerun
    (folders[1] / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit, match="did not write"):
        module.main(["--quick", "--out", str(out), "--run-dir", str(run), "--threads", "1"])
    assert (folders[1] / "notes.txt").read_text() == "mine"


def test_real_transcoders_quick_topk_replaces_its_own_set_with_k_features_per_token(tmp_path):
    """--kind topk: every layer's saved transcoder keeps k features per held-out token and its edges
    still equal interventions; --install-from copies the set over the script's own ReLU set (and
    refuses a folder holding a file it did not write)."""
    from workbench.analysis import load_dictionary

    module = importlib.import_module("real_transcoders")
    out, trial = tmp_path / "ckpt", tmp_path / "trial"
    module.main(["--quick", "--out", str(out), "--run-dir", str(tmp_path / "relu"), "--threads", "1", "--qk-head", ""])
    r = module.main(["--quick", "--kind", "topk", "--k", "8", "--out", str(trial), "--run-dir", str(tmp_path / "topk"),
                     "--threads", "1", "--qk-head", ""])
    module.main(["--quick", "--install-from", str(trial), "--out", str(out)])  # over the script's own ReLU set
    for layer in range(r["model"].cfg.n_layers):
        for name in ("cfg.json", "sae_meta.json", "sae_weights.safetensors"):
            rel = Path("saes") / "transcoders" / f"layer{layer}" / name
            assert (out / rel).read_bytes() == (trial / rel).read_bytes()
    model = r["model"]
    _, cache = model.run_with_cache(r["eval_tokens"])
    for layer in range(model.cfg.n_layers):
        tc = load_dictionary(out / "saes" / "transcoders" / f"layer{layer}")
        assert tc.cfg.k == 8 and tc.cfg.kind == "skip_transcoder"
        x = cache[f"blocks.{layer}.ln2.hook_normalized"][:, 1:].reshape(-1, model.cfg.d_model)
        assert ((tc.encode(x) > 0).sum(-1) == 8).all()
    assert (r["layers"].l0 == 8).all()
    (out / "saes" / "transcoders" / "layer0" / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit, match="did not write"):
        module.main(["--quick", "--install-from", str(trial), "--out", str(out)])
    assert (out / "saes" / "transcoders" / "layer0" / "notes.txt").read_text() == "mine"
    with pytest.raises(SystemExit, match="--k \\(0\\) must lie in"):
        module.parse(["--quick", "--kind", "topk", "--k", "0"])
    edges = r["edges"]
    assert len(edges) > 0 and (edges.abs_diff <= 1e-4 * edges.edge.abs().clip(lower=1)).all()


def test_real_transcoders_quick_more_text_keeps_the_held_out_set_and_compare_measures_both_sets_alike(tmp_path):
    """--more-text trains on more sequences (the extra stdlib modules' docstrings) while the held-out
    sequences stay those of the plain run; --compare measures another set on those rows: its
    explained variances, spliced loss and IOI graph scores equal the ones its own run measured, and
    the paired differences are the means of the per-sequence and per-prompt differences."""
    import numpy as np

    module = importlib.import_module("real_transcoders")
    first = ["--quick", "--kind", "topk", "--k", "8", "--qk-head", "", "--ioi-prompts", "3", "--threads", "1"]
    a = module.main(first + ["--out", str(tmp_path / "a"), "--run-dir", str(tmp_path / "ra")])
    b = module.main(first + ["--more-text", "--out", str(tmp_path / "b"), "--run-dir", str(tmp_path / "rb"),
                             "--compare", str(tmp_path / "a")])
    assert torch.equal(a["eval_tokens"], b["eval_tokens"])
    assert b["config"]["train_tokens"] == 2 * a["config"]["train_tokens"] and b["config"]["more_text_tokens"] > 0
    assert b["config"]["train_seqs"] == 32 and a["config"]["train_seqs"] == 16
    held = {tuple(row) for row in b["eval_tokens"].tolist()}
    assert len(b["train_tokens"]) == 32 and torch.equal(b["train_tokens"][:16], a["train_tokens"])
    assert not held & {tuple(row) for row in b["train_tokens"].tolist()}  # disjoint
    layers = b["compare_layers"]
    assert np.allclose(layers.ev_compared, a["layers"].explained_variance, atol=1e-6)
    assert np.allclose(layers.ev_this, b["layers"].explained_variance, atol=1e-6)
    seq = b["sequences"]
    assert abs(seq.spliced_compared.mean() - a["loss"]["ce_loss_spliced"]) < 1e-4
    assert abs(seq.spliced_this.mean() - b["loss"]["ce_loss_spliced"]) < 1e-4
    assert abs(seq.clean.mean() - b["loss"]["ce_loss_clean"]) < 1e-4
    ioi_a, ioi_b = a["ioi"], b["ioi"]
    assert list(ioi_a.text) == list(ioi_b[ioi_b.set == "this"].text)
    assert np.allclose(ioi_b[ioi_b.set == "compared"].replacement, ioi_a.replacement, atol=1e-5)
    compare = b["compare"].set_index("measure")
    diff = ioi_b[ioi_b.set == "this"].completeness.to_numpy() - ioi_b[ioi_b.set == "compared"].completeness.to_numpy()
    row = compare.loc["IOI graph completeness"]
    assert abs(row.diff_mean - diff.mean()) < 1e-9 and row.diff_low <= row.diff_mean <= row.diff_high
    assert abs(compare.loc["loss, all MLPs spliced, no error terms"].diff_mean
               - (seq.spliced_this - seq.spliced_compared).mean()) < 1e-9
    with pytest.raises(SystemExit, match="--compare: .* does not hold a transcoder this script wrote"):
        module.main(first + ["--out", str(tmp_path / "c"), "--run-dir", str(tmp_path / "rc"), "--compare", str(tmp_path)])
    with pytest.raises(SystemExit, match="--ioi-prompts"):
        module.parse(["--quick", "--ioi-prompts", "1"])


def test_real_transcoders_more_text_adds_sequences_the_first_text_does_not_have():
    """--more-text: past the 24-module text's own training sequences come the MORE_MODULES docstrings'
    (not the first text's sequences); without it that many sequences are refused."""
    from real_lenses import tiny_model

    module = importlib.import_module("real_transcoders")
    model = tiny_model(0)
    base, info = module.text_sequences(model, module.parse(["--quick"]))
    n = (info["sequences_available"] - 8) // 8 * 8 + 40  # (multiples of the 8 held out) the first text's and 40 more
    with pytest.raises(SystemExit, match="--more-text adds more"):
        module.text_sequences(model, module.parse(["--quick", "--train-seqs", str(n)]))
    more, info = module.text_sequences(model, module.parse(["--quick", "--more-text", "--train-seqs", str(n)]))
    assert torch.equal(more[-8:], base[-8:]) and torch.equal(more[:16], base[:16])  # held out; the first training rows
    from real_lenses import tokenize

    from workbench.data.stdlib import TEXT_MODULES, stdlib_text

    first = {tuple(r) for r in module.cut(tokenize(model, stdlib_text(TEXT_MODULES[:2]), True), 16, 0).tolist()}
    added = {tuple(r) for r in more[info["sequences_available"] - 8: n].tolist()}
    assert info["more_text_tokens"] > 0 and len(added - first) >= 0.9 * len(added)  # (16 bytes may recur by chance)


def test_real_transcoders_page_folder_is_the_model_with_another_set_by_links_only(tmp_path):
    """--page-check's checkpoint folder: the model folder's entries linked, its saes replaced by a
    link to the other set's; the model folder is left as it was."""
    module = importlib.import_module("real_transcoders")
    model_folder, out = tmp_path / "model", tmp_path / "new"
    (model_folder / "saes" / "transcoders" / "layer0").mkdir(parents=True)
    (out / "saes" / "transcoders" / "layer0").mkdir(parents=True)
    for name, text in (("config.json", "{}"), ("model.safetensors", "w"), ("tokenizer.json", "t")):
        (model_folder / name).write_text(text)
    (out / "saes" / "transcoders" / "layer0" / "cfg.json").write_text("new")
    (model_folder / "saes" / "transcoders" / "layer0" / "cfg.json").write_text("old")
    folder = module.page_folder(tmp_path / "ckpts" / "m", model_folder, out)
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors", "saes", "tokenizer.json"]
    assert all(p.is_symlink() for p in folder.iterdir())
    assert (folder / "model.safetensors").read_text() == "w"
    assert (folder / "saes" / "transcoders" / "layer0" / "cfg.json").read_text() == "new"
    assert (model_folder / "saes" / "transcoders" / "layer0" / "cfg.json").read_text() == "old"
