"""scripts/gpu_check.sh: its CPU mode runs every section to the end here, a section that fails or overruns
its time box is recorded while the others still run, and the wheels that travel to the GPU machine are
the ones this project pins."""

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
WHEELS = REPO / "scripts" / "gpu_wheels"


def load_check():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gpu_check", module)  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # the whole script on tiny shapes: a nested pytest, fresh import processes, the app (1-2 min)
def test_the_quick_cpu_run_ends_every_section_with_its_numbers(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    env.pop("OUT", None)
    started = time.time()
    run = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--device", "cpu", "--quick", "--out", str(out),
                          "--work-dir", str(tmp_path / "work"),
                          # boxes for a loaded 2-core machine: an overrun here would be the load, not the code
                          "--budget-scale", "3", "--budget", "1200"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=1500)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    sections = results["sections"]
    assert list(sections) == load_check().ORDER
    # a CPU has no device to hold against the CPU, and no CUDA graphs: those say so and are skipped
    cuda_only = {"parity", "compiled_ours", "compiled_transformers"}
    bad = {name: (rec["status"], rec["summary"], rec.get("error", "")[-800:]) for name, rec in sections.items()
           if rec["status"] != ("skipped" if name in cuda_only else "ok")}
    assert not bad, bad
    assert all(sections[name]["summary"] for name in cuda_only)
    assert sorted(p.name for p in out.iterdir()) == sorted(load_check().OUT_FILES)  # what travels back: few, known
    assert len(load_check().OUT_FILES) <= 8
    assert results["seconds"] <= time.time() - started
    data = {name: rec["data"] for name, rec in sections.items()}
    assert data["environment"]["info"]["torch"] and data["environment"]["bf16_placement_check"] == "passed"
    assert data["tests"]["counts"]["passed"] == data["tests"]["collected"] > 0 and not data["tests"]["failures"]
    assert data["tests"]["counts_source"] == "pytest summary line"
    assert data["tests"]["counts_stream"]["passed"] == data["tests"]["counts"]["passed"]
    assert "passed" in (out / "tests-tail.txt").read_text()
    assert {(r["size"], r["contender"]) for r in data["import"]["rows"]} == {("tiny", "ours"), ("tiny", "transformers")}
    assert {(r["contender"], r["batch"]) for r in data["decode"]["rows"]} == {
        (who, b) for who in ("ours", "transformers") for b in (1, 32)}
    assert all(r["ms_per_token"] > 0 and r["floor_ms"] > 0 for r in data["decode"]["rows"])
    assert {r["task"] for r in data["contenders"]["rows"]} == {"forward", "cache", "patch heads"}
    assert min(data["dictionary"]["tokens_per_s"]["train_sae"]) > 0
    assert data["training"]["rows"][0]["last_loss"] == data["training"]["rows"][0]["last_loss"]  # finite, not NaN
    assert [r["tokens"] for r in data["circuits"]["rows"] if r["method"] == "eap"] == [32, 64]
    assert data["app"]["figures"] > 0 and "`cpu`" in data["app"]["sidebar"]
    md = (out / "results.md").read_text()
    for name in sections:
        assert re.search(rf"^\| {name} \| {'skipped' if name in cuda_only else 'ok'} \| \d+ \|", md, re.M), name
    assert (out / "log.txt").stat().st_size > 0
    assert not (tmp_path / "work").exists() or not any((tmp_path / "work").iterdir())  # models removed


def test_a_failing_or_overrunning_section_is_recorded_and_the_next_one_runs(tmp_path, monkeypatch):
    check = load_check()
    args = check.parse_args(["--device", "cpu", "--quick"])

    def raises(sec):
        sec.put("before", 1)
        raise RuntimeError("planted failure")

    def hangs(sec):
        sec.put("measured", 2.5)
        time.sleep(60)

    def skips(sec):
        raise check.Skip("nothing to do here")

    def works(sec):
        sec.note("measured")
        sec.summary = "fine"

    # (sections are forked from this process: they stay off torch, whose CPU thread pool pytest has started)
    for name, fn in (("raises", raises), ("hangs", hangs), ("skips", skips), ("works", works)):
        monkeypatch.setitem(check.SECTIONS, name, fn)
    records = {}
    for name, box in (("raises", 20), ("hangs", 2), ("skips", 20), ("works", 20)):
        sec = check.Section(name, "cpu", True, tmp_path, tmp_path / f"{name}.json", time.time() + box, args)
        started = time.time()
        records[name] = check.run_section(name, sec, box)
        assert time.time() - started < box + 15
    assert records["raises"]["status"] == "failed" and "planted failure" in records["raises"]["error"]
    assert records["raises"]["data"] == {"before": 1}
    assert records["hangs"]["status"] == "timeout" and records["hangs"]["data"] == {"measured": 2.5}
    assert records["skips"]["status"] == "skipped" and records["skips"]["summary"] == "nothing to do here"
    assert records["works"]["status"] == "ok" and records["works"]["messages"] == ["measured"]
    md = check.markdown({"started": "now", "device": "cpu", "quick": True, "command": "x", "seconds": 1.0,
                         "sections": records})
    assert "| hangs | timeout |" in md and "| raises | failed |" in md and "planted failure" in md


def test_the_budget_plan_keeps_the_first_sections_and_skips_from_the_end():
    check = load_check()
    args = check.parse_args(["--device", "cuda", "--budget", "200"])
    mins = {name: check.PLAN[name][1] for name in check.ORDER}
    planned, skipped = check.plan(check.ORDER, args, 200)
    # the longest prefix of ORDER whose minimums fit, then whatever later section still fits
    assert planned[:3] == ["tests", "environment", "parity"] and sum(mins[n] for n in planned) <= 200
    assert all(sum(mins[n] for n in planned) + mins[n] > 200 for n in skipped)
    assert set(planned) | set(skipped) == set(check.ORDER) and not set(planned) & set(skipped)
    assert all(why.startswith("skipped: budget") for why in skipped.values())
    # a box never eats a later planned section's minimum, and never exceeds the section's own box
    box = check.section_timeout("tests", time.time(), args, planned[1:])
    assert abs(box - min(check.PLAN["tests"][0], 200 - check.END_RESERVE_S - sum(mins[n] for n in planned[1:]))) < 1
    big = check.parse_args(["--device", "cuda", "--budget", "5000"])
    assert check.plan(check.ORDER, big, 5000) == (check.ORDER, {})
    assert check.section_timeout("tests", time.time(), big, check.ORDER[1:]) == check.PLAN["tests"][0]


def test_test_counts_agree_with_pytests_own_summary(tmp_path):
    check = load_check()
    # pytest's summary line of the first GPU run, and a stream where one test fails and then errors in teardown
    assert check.pytest_summary(["x", "661 failed, 385 passed, 3 skipped, 77 errors in 117.91s (0:01:57)"]) == {
        "passed": 385, "failed": 661, "error": 77, "skipped": 3, "xfailed": 0, "xpassed": 0}
    assert check.pytest_summary(["FAILED t::a - boom", "no summary here"]) is None
    log = tmp_path / "tests.jsonl"
    events = [{"collected": 3}, {"nodeid": "t::a", "when": "call", "outcome": "failed", "message": "boom"},
              {"nodeid": "t::a", "when": "teardown", "outcome": "error", "message": "late"},
              {"nodeid": "t::b", "when": "call", "outcome": "passed"},
              {"nodeid": "t::c", "when": "setup", "outcome": "skipped"},
              {"nodeid": "t_broken.py", "when": "collect", "outcome": "error", "message": "ImportError"}]
    log.write_text("".join(json.dumps(e) + "\n" for e in events))
    counts, failures, collected = check.read_test_log(log)
    assert counts == {"passed": 1, "failed": 1, "error": 2, "skipped": 1, "xfailed": 0, "xpassed": 0}
    assert collected == 3 and [f["test"] for f in failures] == ["t::a", "t::a", "t_broken.py"]
    junit = tmp_path / "j.xml"
    junit.write_text('<testsuites><testsuite tests="5" failures="1" errors="2" skipped="1"/></testsuites>')
    assert check.junit_counts(junit) == {"passed": 1, "failed": 1, "error": 2, "skipped": 1, "xfailed": 0, "xpassed": 0}
    assert check.junit_counts(tmp_path / "missing.xml") is None


def test_a_long_log_is_cut_to_its_cap(tmp_path):
    check = load_check()
    log = tmp_path / "log.txt"
    log.write_bytes(b"first line\n" + b"x" * 10_000 + b"\nlast line\n")
    check.cap_log(log, cap=1000)
    text = log.read_text()
    assert log.stat().st_size < 1100 and text.startswith("first line") and text.endswith("last line\n") and "cut here" in text


def test_the_travelling_wheels_are_the_pinned_versions_and_fit_python_3_12():
    lines = [line for line in (WHEELS / "requirements.txt").read_text().splitlines() if line.split("#")[0].strip()]
    wanted = dict(line.split("#")[0].strip().split("==") for line in lines)
    # the wheels over 5 MiB are not in git: fetch.sh puts them there and a device run carries them
    untracked = {line.split("==")[0] for line in lines if "(untracked:" in line}
    assert untracked == {"plotly", "streamlit"}
    pins = dict(re.match(r"([A-Za-z0-9_.-]+)==(\S+)", line).groups() for line in (REPO / "requirements.txt").read_text()
                .splitlines() if re.match(r"[A-Za-z0-9_.-]+==", line))
    assert wanted["transformer-lens"] == pins["transformer-lens"]
    wheels = list(WHEELS.glob("*.whl"))
    norm = lambda name: re.sub(r"[-_.]+", "_", name).lower()
    for name, version in wanted.items():
        mine = [w for w in wheels if norm(w.name.split("-")[0]) == norm(name) and w.name.split("-")[1] == version]
        tags = {w.name.split("-")[2] for w in mine}
        if name in untracked and not mine:
            continue  # a fresh checkout: fetched before a device run
        assert tags & {"py3", "py312"}, f"no wheel of {name}=={version} for the GPU machine's Python 3.12 in {WHEELS}"
        for w in mine:  # pure Python only: anything else would be built for one machine
            assert w.name.endswith("-none-any.whl"), w.name
            with zipfile.ZipFile(w) as z:
                assert not [n for n in z.namelist() if n.endswith((".so", ".pyd"))], w.name
    tracked = [w for w in wheels if norm(w.name.split("-")[0]) not in {norm(n) for n in untracked}]
    assert all(w.stat().st_size < 5 * 2**20 for w in tracked)  # they travel with the repo
