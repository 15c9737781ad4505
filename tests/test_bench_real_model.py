"""benchmarks/real_model.py's machinery on its --quick model (a tiny random Llama written with wb.to_hf): every
contender computes the same thing (logits, caches, the per-head ablation numbers) before a time is read; and the
benchmarks' peak-memory reading is the measured process's own, not the parent's it was started from."""

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))


def test_quick_run_times_contenders_that_agree(tmp_path, capsys):
    bench = importlib.import_module("real_model")
    # circuit-tracer's venv is not in CI: the graph task runs our side alone and says so
    results = bench.main(["--quick", "--tasks", "forward,cache,sweep,graph", "--repeats", "1", "--sweep-repeats", "1",
                          "--graph-contexts", "16", "--ct-python", str(tmp_path / "no-python"), "--out", str(tmp_path)])
    timed = {(r["task"], r["contender"]) for r in results["timings"]}
    assert {("forward", "ours"), ("forward", "transformers"), ("forward", "bridge"), ("cache", "bridge"),
            ("sweep", "ours"), ("sweep", "transformers"), ("sweep", "bridge")} <= timed
    parity = results["parity"]
    # main raises when they disagree; the numbers themselves, against transformers' own model
    assert parity["forward ours"] < 1e-5 and parity["forward bridge"] < 1e-4
    assert parity["cache ours resid_post"] < 1e-5 and parity["sweep ours"] < 1e-5 and parity["sweep bridge"] < 1e-4
    assert parity["sweep ours run_with_hooks"] < 1e-5
    assert any("sweep: 8 heads" in line for line in results["lines"])  # 2 layers x 4 heads, each ablated once
    (graph,) = results["graph"]
    assert graph["ours_nodes"] > 16 and "ct_s" not in graph
    assert any("circuit-tracer's venv" in line and "missing" in line for line in results["lines"])
    assert json.loads((tmp_path / "results.json").read_text())["parity"] == parity
    assert "forward ours" in capsys.readouterr().out


def test_hf_sweep_zeroes_the_heads_slice(tmp_path):
    """transformers' side of the sweep (a pre-hook on o_proj) against zeroing the slice by hand, and against ours."""
    import torch
    import transformers

    import workbench as wb
    bench = importlib.import_module("real_model")
    from workbench.analysis.common import logit_diff_metric

    torch.manual_seed(0)
    cfg = wb.ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_mlp=64, d_vocab=50, n_ctx=16,
                         norm="rmsnorm", positional="rope", ffn="swiglu", bias=False, tie_embeddings=False, seed=0)
    ours = wb.HookedDecoder(cfg).eval()
    wb.to_hf(ours, tmp_path / "m")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32).eval()
    tokens = torch.randint(0, 50, (2, 7))
    metric = logit_diff_metric(1, 2)
    with torch.no_grad():
        got = bench.hf_sweep(hf, tokens, metric, 4)
        o_proj = hf.model.layers[1].self_attn.o_proj
        weight = o_proj.weight.clone()
        o_proj.weight[:, 2 * 8:3 * 8] = 0  # head 2 of layer 1 zeroed: its columns of W_O
        by_hand = float(metric(hf(tokens).logits))
        o_proj.weight.copy_(weight)
        mine = bench.ours_sweep(ours, tokens, metric)
    assert abs(got[4 + 2] - by_hand) < 1e-5
    assert max(abs(a - b) for a, b in zip(got, mine)) < 1e-5 and len(got) == 8


def test_peak_memory_is_the_child_processs_own():
    """Linux keeps ru_maxrss across exec, so a child started from a large process reported that process's peak;
    the benchmarks read VmHWM, which the exec starts afresh."""
    import torch  # noqa: F401  (what the children import is in the parent too: run alone, the parent had none of it)

    import workbench  # noqa: F401

    ballast = bytearray(400 * 2**20)  # 400 MiB touched in this (the parent) process
    ballast[::4096] = b"x" * len(ballast[::4096])
    parent = next(int(line.split()[1]) / 1024 for line in open("/proc/self/status") if line.startswith("VmRSS:"))
    for script in ("_ct_side", "real_model", "graphs", "graphs_ct", "dataset_lens"):
        code = f"import sys; sys.path.insert(0, {str(REPO / 'benchmarks')!r}); from {script} import peak_mb; print(peak_mb())"
        child = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                     cwd=REPO).stdout.split()[-1])
        assert child < parent - 300, (script, child, parent)  # the child imports torch, not the ballast
    # graphs.py's own child run (its baseline: the model and transcoders, no graph), as the benchmark starts it
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "graphs.py"), "--child", "--baseline", "--context",
                          "8", "--d-sae", "16", "--k", "2"], capture_output=True, text=True, check=True, cwd=REPO)
    row = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))[len("RESULT "):])
    assert row["peak_mb"] < parent - 300, (row, parent)
    del ballast


def test_a_graph_child_past_the_memory_cap_is_stopped_and_named(tmp_path):
    # circuit-tracer's 1,024-token graph grows past what the machine has; the runner stops it at the cap
    # and says how high it got, instead of leaving the kernel's OOM killer to pick a process
    bench = importlib.import_module("real_model")
    grow = ("import time\nblocks = []\nfor _ in range(40):\n    blocks.append(bytearray(25 << 20))\n"
            "    time.sleep(0.05)\ntime.sleep(5)\nprint('{}')")
    with pytest.raises(bench.MemoryCapExceeded, match=r"stopped at [\d,]+ MB resident after \d+ s"):
        bench.run_child([sys.executable, "-c", grow], timeout=60, memory_cap_mb=300)
    ok = bench.run_child([sys.executable, "-c", "print('{\"seconds\": 1}')"], timeout=60, memory_cap_mb=300)
    assert ok == {"seconds": 1}
    with pytest.raises(subprocess.TimeoutExpired):
        bench.run_child([sys.executable, "-c", "import time; time.sleep(30)"], timeout=1)
    with pytest.raises(RuntimeError, match="failed \\(3\\)"):
        bench.run_child([sys.executable, "-c", "import sys; sys.exit(3)"], timeout=60)


def test_one_path_to_circuit_tracers_venv():
    """graphs_ct.py named /work/venv-ct and real_model.py /work/ctvenv (the one that exists): one constant now."""
    import graphs_ct

    import real_model as bench

    assert bench.DEFAULT_CT_PYTHON is graphs_ct.DEFAULT_CT_PYTHON == f"{graphs_ct.CT_VENV}/bin/python"
    for script in ("graphs_ct.py", "real_model.py", "_ct_side.py"):
        assert "venv-ct" not in (REPO / "benchmarks" / script).read_text(), script
