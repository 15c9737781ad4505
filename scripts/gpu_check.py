"""One prepared run that proves the CUDA paths and measures us against the peers on a GPU.

    bash scripts/gpu_check.sh --budget 480            # on a GPU machine: planned to fit 480 s
    bash scripts/gpu_check.sh --device cpu --quick    # here and in CI: the same code on tiny shapes
    python scripts/gpu_check.py --sections decode,app --budget 200 --out DIR

Results go to ``--out`` (default ``$OUT``, else ``./gpu-check-out``), never more than the files in
OUT_FILES: ``results.json`` (every section with a status: ok, failed, skipped, timeout, crashed or not
run; its seconds, messages and numbers), ``results.md`` (the same as tables), rewritten after every
section so a run that is cut off still leaves what it measured; ``log.txt`` (everything printed, cut to
2 MiB) and ``tests-tail.txt`` (the last 400 lines of the nested pytest).

Sections, in the order they run, which is the order of what matters (each in a forked process of its
own with a time box; a failure, a crash or a timeout in one is recorded and the next one starts;
``--budget`` skips sections from the end, each with a "skipped: budget" line, rather than overrun):

    tests        pytest on tests/test_device_guard, test_graphs, test_core_*, test_interop*, test_analysis_*, test_padding* with
                 ``--device cuda``: passed/failed/errors/skipped from pytest's own summary line (its JUnit
                 file, or the per-report stream where pytest was cut), the first failures
    environment  torch, CUDA, the device, package versions, disk; the bf16 capability check
                 (``check_placement``); device copy bandwidth and a bf16 matmul rate
    parity       the real model (``workbench.open_pretrained``, skipped until it exists) on the device
                 against the CPU: fp32 logits to 1e-4, bf16 within two roundings; its forward and decode speed
    decode       eager greedy decode ms/token at batch 1 and 32: ours, transformers' ``generate`` and the
                 HBM floor (model bytes / measured copy bandwidth)
    compiled_ours  ours compiled (``mode="reduce-overhead"``: CUDA graphs, static cache), a section of its
                 own so its compilation has its own box
    contenders   benchmarks/contenders.py at 1B in bf16 on the device (forward, cache every
                 activation, per-head patching: ours, transformers, the TL bridge, nnsight if present)
    circuits     EAP over every edge, and the attribution graph where ``workbench.analysis.graphs`` exists,
                 at 1k and 4k tokens: seconds and peak memory
    training     ``train`` with bf16 autocast against fp32 (tokens/s, finite loss)
    compiled_transformers  transformers' compiled static cache (its documented recipe), its own box
    import       a random Llama-shaped model of ~1B and ~8B parameters written with ``wb.to_hf``
                 (bf16), imported by ``wb.from_hf`` and by transformers in fresh processes: seconds,
                 peak GPU memory / model bytes (benchmarks/interop.py's child)
    dictionary   TopK training tokens/s, d_sae 16k on 2048-wide rows: ``train_sae`` vs a plain loop
    app          Streamlit's AppTest of the Inspect page with ``WORKBENCH_DEVICE`` set to the device

Packages the GPU machine lacks travel as wheels in ``scripts/gpu_wheels`` (listed, pinned, in its
``requirements.txt``); those missing from this interpreter are installed with ``--no-deps`` into
a temporary folder put first on the path; nothing is installed where they are already present.
Nothing here downloads anything. docs/reference/gpu.md says what each number means.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

REPO = Path(__file__).resolve().parents[1]
WHEELS = REPO / "scripts" / "gpu_wheels"
# The order of what matters: is the library correct on CUDA (its tests, the real model against the CPU),
# then the speed targets (decode, compiled decode, forward, EAP memory, training), then what already held
# in the first GPU run (import, dictionary training, the app). ``--budget`` drops sections from the end.
ORDER = ["tests", "environment", "parity", "decode", "compiled_ours", "contenders", "circuits", "training",
         "compiled_transformers", "import", "dictionary", "app"]
# Per section: (its box on a GPU, the least time worth starting it with on a GPU, its box with --quick).
# The planner (``plan`` and ``section_timeout``) gives each section, in ORDER, the smaller of its box and
# what the budget leaves once every later planned section has its minimum; sections whose minimum does not
# fit are "skipped: budget" up front, from the end of ORDER. Time a section leaves unused flows on.
PLAN = {"tests": (240, 60, 120), "environment": (45, 15, 40), "parity": (120, 30, 60), "decode": (120, 45, 60),
        "compiled_ours": (120, 40, 30), "contenders": (75, 30, 60), "circuits": (70, 25, 40), "training": (40, 20, 40),
        "compiled_transformers": (120, 40, 30), "import": (150, 40, 90), "dictionary": (40, 15, 40),
        "app": (60, 20, 120)}
MIN_SECTION_S = 10  # a section's minimum with --quick
END_RESERVE_S = 5  # the last results written, the work folder removed
# What comes back in --out: never more than these (the device tool brings back at most 8 small files).
OUT_FILES = ("results.json", "results.md", "log.txt", "tests-tail.txt")
LOG_CAP_BYTES = 2 << 20
TEST_FILES = ["tests/test_device_guard.py", "tests/test_graphs.py", "tests/test_core_*.py", "tests/test_interop*.py",
              "tests/test_analysis_*.py", "tests/test_padding*.py"]
QUICK_TEST_FILES = ["tests/test_core_config.py"]
PACKAGES = ["torch", "transformers", "tokenizers", "safetensors", "huggingface_hub", "numpy", "pandas", "einops",
            "jaxtyping", "beartype", "transformer-lens", "datasets", "plotly", "streamlit", "pytest", "pytest-xdist",
            "pytest-timeout", "pyarrow", "accelerate", "triton", "nnsight"]


class Skip(Exception):
    """A section that cannot run here says why (missing package, no disk, no time)."""


@dataclass
class Section:
    """One section's record, rewritten to its JSON file after every change so a killed process leaves it."""

    name: str
    device: str
    quick: bool
    work: Path
    path: Path
    deadline: float
    args: argparse.Namespace
    status: str = "ok"
    summary: str = ""
    messages: list = field(default_factory=list)
    data: dict = field(default_factory=dict)
    error: str = ""

    def note(self, message: str) -> None:
        print(f"[{self.name}] {message}", flush=True)
        self.messages.append(message)
        self.flush()

    def put(self, key: str, value: Any) -> None:
        self.data[key] = value
        self.flush()

    def left(self) -> float:
        return self.deadline - time.time()

    def record(self) -> dict:
        return {"status": self.status, "summary": self.summary, "messages": self.messages, "data": self.data,
                "error": self.error}

    def flush(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.record(), indent=1, default=str))
        os.replace(tmp, self.path)

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def reset_peak(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def peak_gib(self) -> Optional[float]:
        """Peak GPU memory allocated since ``reset_peak`` (None on the CPU, where the allocator keeps no peak)."""
        if not self.cuda:
            return None
        import torch

        return torch.cuda.max_memory_allocated() / 2**30


# ---- shared helpers ---------------------------------------------------------------------------------------
def _bench():
    """The benchmark modules (benchmarks/ is a folder of scripts, not a package)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import interop

    return interop


def random_llama(size: str, device: str, n_ctx: Optional[int] = None):
    """A random Llama-shaped HookedDecoder of ``size`` (benchmarks/interop.py's shapes), built on ``device``
    in fp32 with its weights drawn there. The library draws a seeded model's weights on the CPU (one seed,
    one model, on any device), which for 8B parameters takes minutes; a random model to time needs no seed."""
    import torch

    import workbench as wb

    interop = _bench()

    class DrawnOnDevice(wb.HookedDecoder):
        @torch.no_grad()
        def init_weights(self, seed=None):
            gen = torch.Generator(device=self.device).manual_seed(0)
            for name, p in self.named_parameters():
                if p.ndim < 2:
                    p.fill_(1.0 if name.endswith(".w") else 0.0)
                else:
                    p.normal_(0.0, self.cfg.init_std, generator=gen)

    shape = {**interop.LLAMA, **({"n_ctx": n_ctx} if n_ctx else {})}
    cfg = wb.ModelConfig(**interop.SIZES[size], **shape)
    with torch.device(device):
        return DrawnOnDevice(cfg).eval()


def ensure_llama(sec: Section, size: str) -> Path:
    """``work/llama-SIZE``: a random bf16 Llama-shaped model written once by ``wb.to_hf`` (later sections reuse it)."""
    import torch

    import workbench as wb

    path = sec.work / f"llama-{size}"
    if (path / "config.json").exists():
        return path
    started = time.perf_counter()
    model = random_llama(size, sec.device).to(torch.bfloat16)
    built = time.perf_counter() - started
    wb.to_hf(model, path, max_shard_size="2GB")
    n_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    del model
    if sec.cuda:
        torch.cuda.empty_cache()
    seconds = time.perf_counter() - started - built
    sec.note(f"wrote llama-{size} ({n_bytes / 2**30:.2f} GiB bf16) with wb.to_hf in {seconds:.1f} s "
             f"({n_bytes / max(seconds, 1e-9) / 2**30:.2f} GiB/s; built in {built:.1f} s)")
    sec.data.setdefault("writes", []).append({"size": size, "gib": n_bytes / 2**30, "build_s": built, "write_s": seconds})
    sec.flush()
    return path


def copy_bandwidth(device: str, n_bytes: int) -> float:
    """Bytes read plus bytes written per second by a device-to-device copy (median of 10 after 3 warm-ups)."""
    import torch

    src = torch.empty(n_bytes // 2, dtype=torch.bfloat16, device=device).fill_(1)
    dst = torch.empty_like(src)
    times = []
    for i in range(13):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        if i >= 3:
            times.append(time.perf_counter() - start)
    return 2 * n_bytes / sorted(times)[len(times) // 2]


def _dynamo_counts() -> dict:
    """Graphs compiled and graph breaks so far (dynamo's own counters; empty where they are not found)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return {}
    return {"unique_graphs": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": int(sum(counters["graph_break"].values()))}


def model_bytes(model) -> int:
    params = {id(p): p for p in model.parameters()}.values()
    return sum(p.numel() * p.element_size() for p in params)


def median_time(fn: Callable[[], Any], repeats: int, sync: Callable[[], None]) -> float:
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


# ---- sections ---------------------------------------------------------------------------------------------
def section_environment(sec: Section) -> None:
    import importlib.metadata as md

    import torch

    info: dict[str, Any] = {"python": sys.version.split()[0], "executable": sys.executable,
                            "platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                            "torch_cuda_build": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    try:
        info["ram_gib"] = int(next(line for line in open("/proc/meminfo") if line.startswith("MemTotal")).split()[1]) / 2**20
    except (OSError, StopIteration):
        pass
    for where in {str(sec.work), tempfile.gettempdir(), str(REPO)}:
        info[f"disk_free_gib {where}"] = shutil.disk_usage(where).free / 2**30
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = md.version(name)
        except md.PackageNotFoundError:
            versions[name] = None
    info["packages"] = versions
    if sec.cuda:
        if not torch.cuda.is_available():
            raise RuntimeError(f"--device {sec.device} but torch.cuda.is_available() is False")
        props = torch.cuda.get_device_properties(sec.device)
        info.update(device_name=props.name, capability=f"{props.major}.{props.minor}",
                    gpu_memory_gib=props.total_memory / 2**30, multiprocessors=props.multi_processor_count,
                    bf16_supported=torch.cuda.is_bf16_supported())
        if shutil.which("nvidia-smi"):
            smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                                  "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
            info["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    sec.put("info", info)
    sec.note(f"python {info['python']}, torch {torch.__version__} (CUDA build {torch.version.cuda}), "
             f"device {info.get('device_name', sec.device)} {info.get('capability', '')}")

    # The placement check every loader runs: bf16 on a device that supports it passes, and says why when not.
    from workbench.interop.streaming import check_placement

    try:
        check_placement(sec.device, torch.bfloat16)
        sec.put("bf16_placement_check", "passed")
    except Exception as err:  # recorded: it is what a user on this device would be told
        sec.put("bf16_placement_check", f"refused: {err}")
    sec.note(f"check_placement({sec.device!r}, bfloat16): {sec.data['bf16_placement_check']}")

    n_bytes = (2 << 30) if sec.cuda else (64 << 20)
    bandwidth = copy_bandwidth(sec.device, n_bytes)
    n = 8192 if sec.cuda else 512
    a = torch.randn(n, n, device=sec.device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=sec.device, dtype=torch.bfloat16)
    a @ b
    seconds = median_time(lambda: a @ b, 10, sec.sync)
    sec.put("copy_bandwidth_gb_s", bandwidth / 1e9)
    sec.put("bf16_matmul_tflops", 2 * n**3 / seconds / 1e12)
    sec.summary = (f"{info.get('device_name', sec.device)}, torch {torch.__version__}; copy {bandwidth / 1e9:.0f} GB/s "
                   f"(read + write), bf16 {n}^3 matmul {2 * n**3 / seconds / 1e12:.1f} TFLOP/s")
    sec.note(sec.summary)


def section_tests(sec: Section) -> None:
    import glob

    # in TEST_FILES' order (the device guard and the graphs first), each file once
    files = QUICK_TEST_FILES if sec.quick else list(dict.fromkeys(
        f for pattern in TEST_FILES for f in sorted(glob.glob(str(REPO / pattern)))))
    files = [str(Path(f).relative_to(REPO)) if Path(f).is_absolute() else f for f in files]
    log = sec.work / "tests.jsonl"
    log.unlink(missing_ok=True)
    junit_path = sec.work / "tests-junit.xml"
    junit_path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", *files, "--device", sec.device, "-q", "-p", "gpu_check_pytest",
           "-o", "console_output_style=classic", "--junitxml", str(junit_path), "-o", "junit_logging=no"]
    if sec.quick:  # CI checks the mechanics here; the jaxtyping instrumentation of every module costs half a minute
        cmd += ["-o", "addopts=-p no:cacheprovider"]
    have = lambda module: subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True).returncode == 0
    workers = 0 if sec.quick else min(8, max(1, (os.cpu_count() or 2) // 2))
    if workers > 1 and have("xdist"):
        cmd += ["-n", str(workers)]  # one GPU shared by several processes: each test is tiny
    if have("pytest_timeout"):
        cmd += ["--timeout", "120"]
    box = max(5.0, sec.left() - 8)
    sec.put("command", " ".join(cmd))
    sec.put("files", len(files))
    sec.note(f"pytest on {len(files)} files, {box:.0f} s box: {' '.join(cmd[3:])}")
    # Not an xdist worker's variables (this check may itself run inside one, as the suite runs it): the
    # nested pytest would take itself for a worker and its plugin would record nothing.
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST_")}, "GPU_CHECK_TEST_LOG": str(log),
           "PYTHONPATH": os.pathsep.join([str(REPO / "scripts"), *filter(None, [os.environ.get("PYTHONPATH")])])}
    # A session of its own, so the box kills pytest and its xdist workers together; its id is recorded
    # so the orchestrator sweeps them too if this whole section is cut off.
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    sec.put("process_groups", [proc.pid])
    tail: list[str] = []
    reader = pump(proc, "[tests] ", tail)  # the output goes on to the log as it comes, whether or not pytest ends
    try:
        proc.wait(timeout=box)
        timed_out = False
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    reader.join(5)
    stream, failures, collected = read_test_log(log)
    summary = pytest_summary(tail)
    junit = junit_counts(junit_path)
    # The counts to trust: pytest's own summary line where pytest ended, else its JUnit file, else (a run cut
    # at its box) the per-report stream, which holds every test that finished. All three are kept.
    counts, source = ((summary, "pytest summary line") if summary else (junit, "junit xml") if junit
                      else (stream, "per-report stream (pytest was cut before its summary)"))
    sec.put("counts", counts)
    sec.put("counts_source", source)
    sec.put("counts_stream", stream)
    if summary and {k: v for k, v in stream.items() if v} != {k: v for k, v in summary.items() if v}:
        sec.note(f"the per-report stream counted {stream}, pytest's summary {summary}; the summary is reported")
    sec.put("collected", collected)
    sec.put("failures", failures)
    sec.put("returncode", proc.returncode)
    sec.put("tail", tail[-12:])
    (sec.work / "tests-tail.txt").write_text("\n".join(tail[-400:]) + "\n")
    ran = sum(counts.values())
    sec.summary = (", ".join(f"{n} {k}" for k, n in counts.items() if n) or "nothing ran") + \
        (f" of {collected} collected" if collected else "") + (f"; cut at {box:.0f} s" if timed_out else "")
    sec.note(sec.summary)
    if counts["failed"] or counts["error"] or (not timed_out and proc.returncode not in (0, 5)) or not ran:
        sec.status = "failed"


COUNT_KEYS = ("passed", "failed", "error", "skipped", "xfailed", "xpassed")


def read_test_log(log: Path) -> tuple[dict, list, Optional[int]]:
    """Counts from gpu_check_pytest's JSON lines: one per report pytest counts, keyed by test and phase, so a
    test that fails and then errors in teardown counts once in each, as pytest's summary does."""
    reports: dict[tuple, str] = {}
    failures: list[dict] = []
    collected = None
    if log.exists():
        for line in log.read_text().splitlines():
            event = json.loads(line)
            if "collected" in event:
                collected = event["collected"]
                continue
            reports[event["nodeid"], event.get("when", "call")] = event["outcome"]
            if event["outcome"] in ("failed", "error") and len(failures) < 25:
                failures.append({"test": event["nodeid"], "message": event.get("message", "")})
    counts = {k: sum(1 for v in reports.values() if v == k) for k in COUNT_KEYS}
    return counts, failures, collected


def pytest_summary(lines: list[str]) -> Optional[dict]:
    """pytest's last line, e.g. ``661 failed, 385 passed, 3 skipped, 77 errors in 117.91s``, as counts."""
    import re

    for line in reversed(lines[-30:]):
        if re.search(r"\bin [\d.]+s\b", line) and re.search(r"\d+ (passed|failed|errors?|skipped|deselected|no tests)", line):
            counts = dict.fromkeys(COUNT_KEYS, 0)
            for n, word in re.findall(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed)", line):
                counts["error" if word.startswith("error") else word] = int(n)
            return counts
    return None


def junit_counts(path: Path) -> Optional[dict]:
    """Counts from pytest's ``--junitxml`` file (written when pytest ends; None where it did not)."""
    import xml.etree.ElementTree as ET

    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    total = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    return {"passed": total["tests"] - total["failures"] - total["errors"] - total["skipped"],
            "failed": total["failures"], "error": total["errors"], "skipped": total["skipped"], "xfailed": 0, "xpassed": 0}


def section_import(sec: Section) -> None:
    import workbench as wb

    interop = _bench()
    sizes = sec.args.import_sizes.split(",")
    repeats = sec.args.import_repeats
    warm = sec.work / "llama-warm"
    if not (warm / "config.json").exists():
        interop._write_llama(warm, "tiny", "2GB")
    rows: list[dict] = []
    estimate = None  # seconds a size of n bytes will take, from the last size: fixed process costs + a per-byte rate
    for size in sizes:
        cfg = wb.ModelConfig(**interop.SIZES[size], **interop.LLAMA)
        n_bytes = 2 * wb.count_params(cfg)["total"]
        free = shutil.disk_usage(sec.work).free
        if free < 1.1 * n_bytes + (2 << 30):
            sec.note(f"{size}: skipped, {n_bytes / 2**30:.1f} GiB to write and {free / 2**30:.1f} GiB free in {sec.work}")
            continue
        if estimate is not None and estimate(n_bytes) > sec.left() - 5:
            sec.note(f"{size}: skipped, about {estimate(n_bytes):.0f} s needed (from the last size's times) "
                     f"and {sec.left():.0f} s left in this section's box")
            continue
        started = time.perf_counter()
        path = ensure_llama(sec, size)
        for f in path.glob("*.safetensors"):  # into the page cache, for both contenders alike
            with open(f, "rb") as fh:
                while fh.read(1 << 24):
                    pass
        written = time.perf_counter() - started
        wall = work = 0.0
        for repeat in range(repeats):
            for who in ("ours", "transformers"):
                began = time.perf_counter()
                r = interop._run_child(who, warm, path, sec.device, "bfloat16")
                wall += time.perf_counter() - began
                work += r["seconds"] + r["forward_seconds"]
                row = {"size": size, "contender": who, "repeat": repeat, "model_gib": r["model_bytes"] / 2**30,
                       "seconds": r["seconds"], "first_forward_s": r["forward_seconds"],
                       "gpu_peak_over_model": r["gpu_peak"] / r["model_bytes"] if sec.cuda else None,
                       "rss_rise_over_model": (r["peak_import"] - r["before"]) / r["model_bytes"]}
                rows.append(row)
                sec.put("rows", rows)
                sec.note(f"{size} {who}: {r['seconds']:.2f} s, first forward {r['forward_seconds']:.2f} s, "
                         + (f"GPU peak {row['gpu_peak_over_model']:.3f}x the model's bytes, " if sec.cuda else "")
                         + f"RSS rise {row['rss_rise_over_model']:.2f}x")
        # A process's start does not grow with the model; below a GiB the rest is fixed costs too (no rate to scale).
        fixed, per_byte = wall - work, (written + work) / n_bytes
        estimate = (lambda n, fixed=fixed, per_byte=per_byte: fixed + per_byte * n) if n_bytes >= 2**30 else None
        if size != sec.args.model_size:  # 16 GB back to the disk before the next size or section
            shutil.rmtree(path, ignore_errors=True)
    if not rows:
        raise Skip("no size could be written here")
    summary = []
    for size in dict.fromkeys(r["size"] for r in rows):
        mine = [r for r in rows if r["size"] == size]
        best = {who: min(r["seconds"] for r in mine if r["contender"] == who) for who in ("ours", "transformers")}
        peak = {who: min((r["gpu_peak_over_model"] or r["rss_rise_over_model"]) for r in mine if r["contender"] == who)
                for who in ("ours", "transformers")}
        summary.append(f"{size}: ours {best['ours']:.1f} s vs {best['transformers']:.1f} s "
                       f"({best['ours'] / best['transformers']:.2f}x), peak/model {peak['ours']:.2f} vs {peak['transformers']:.2f}")
    sec.summary = "; ".join(summary)
    sec.note(sec.summary)


class _Decode:
    """What the decode sections share: the two models loaded in bf16, the prompts at batch 1 and 32, the
    eager prefill times, the floor, and the per-token timing."""

    def __init__(self, sec: Section):
        import torch
        import transformers

        import workbench as wb

        self.sec, self.torch, self.wb = sec, torch, wb
        path = ensure_llama(sec, sec.args.model_size)
        self.ours = wb.from_hf(path, dtype=torch.bfloat16, device=sec.device).eval()
        self.hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(sec.device).eval()
        self.weights = model_bytes(self.ours)
        self.bandwidth = copy_bandwidth(sec.device, (2 << 30) if sec.cuda else (64 << 20))
        self.prompt_len, self.new = (128, 64) if not sec.quick else (16, 6)
        self.repeats = 3 if not sec.quick else 1
        sec.put("setup", {"model": f"llama-{sec.args.model_size}", "model_gib": self.weights / 2**30,
                          "prompt": self.prompt_len, "new_tokens": self.new, "copy_bandwidth_gb_s": self.bandwidth / 1e9,
                          "per_token": f"(t(generate {self.new} new) - t(eager forward of the prompt)) / {self.new - 1}, "
                                       f"medians of {self.repeats}"})
        self.rows: list[dict] = []
        gen = torch.Generator().manual_seed(0)
        self.prompts = {b: torch.randint(3, self.ours.cfg.d_vocab, (b, self.prompt_len), generator=gen).to(sec.device)
                        for b in (1, 32)}
        # generate(new) is one prefill and new - 1 decode steps. The prefill is timed as an eager forward of the
        # prompt, so every generate call has one length: a static cache (and its compiled graphs) is built once.
        with torch.no_grad():
            self.prefill = {(name, b): median_time(lambda m=m, t=t: m(t), self.repeats + 1, sec.sync)
                            for b, t in self.prompts.items() for name, m in (("ours", self.ours), ("transformers", self.hf))}

    def ours_gen(self, tokens, n, **kw):
        return self.ours.generate(tokens, max_new_tokens=n, use_kv_cache=True, **kw)

    def hf_gen(self, tokens, n, **kw):
        return self.hf.generate(tokens, attention_mask=self.torch.ones_like(tokens), max_new_tokens=n, min_new_tokens=n,
                                do_sample=False, pad_token_id=0, **kw)

    def per_token(self, fn, tokens, contender: str) -> float:
        new, sec = self.new, self.sec
        out = fn(tokens, new)  # the warm-up (the compilation, when compiled)
        if out.shape[1] != tokens.shape[1] + new:
            raise RuntimeError(f"asked for {new} new tokens, got {out.shape[1] - tokens.shape[1]}")
        t_new = median_time(lambda: fn(tokens, new), self.repeats, sec.sync)
        decode = t_new - self.prefill[contender, tokens.shape[0]]
        if decode <= 0:  # tiny shapes under load: the prefill's own timing noise is larger than the decode
            sec.note(f"{contender}, batch {tokens.shape[0]}: generate took no longer than the prefill alone; "
                     f"per token is the whole generate / {new} (an upper bound)")
            return 1e3 * t_new / new
        return 1e3 * decode / (new - 1)

    def add(self, mode: str, contender: str, batch: int, ms: float) -> None:
        kv = self.wb.kv_cache_bytes(self.ours.cfg, context=self.prompt_len + self.new // 2, batch=batch)
        floor = 1e3 * (self.weights + kv) / self.bandwidth
        self.rows.append({"mode": mode, "contender": contender, "batch": batch, "ms_per_token": ms,
                          "floor_ms": floor, "over_floor": ms / floor})
        self.sec.put("rows", self.rows)
        self.sec.note(f"{mode} {contender} batch {batch}: {ms:.2f} ms/token, {ms / floor:.1f}x the floor of {floor:.3f} ms")


def section_decode(sec: Section) -> None:
    d = _Decode(sec)
    with d.torch.no_grad():
        for batch, tokens in d.prompts.items():
            d.add("eager", "ours", batch, d.per_token(d.ours_gen, tokens, "ours"))
            d.add("eager", "transformers", batch, d.per_token(d.hf_gen, tokens, "transformers"))
        a, b = d.ours_gen(d.prompts[1], 16)[0, d.prompt_len:], d.hf_gen(d.prompts[1], 16)[0, d.prompt_len:]
        sec.put("greedy_agreement_16", float((a == b).float().mean()))  # bf16 on a random model: ties flip, a reading only
    eager = {(r["contender"], r["batch"]): r["ms_per_token"] for r in d.rows}
    sec.summary = ", ".join(f"batch {b}: ours {eager['ours', b]:.2f} vs transformers {eager['transformers', b]:.2f} ms/token"
                            for b in (1, 32)) + f" (floor {d.rows[0]['floor_ms']:.3f} ms at batch 1)"
    sec.note(sec.summary)


def _compiled_decode(sec: Section, contender: str) -> None:
    """Compiled static-cache decode (``mode="reduce-overhead"``: CUDA graphs) of one contender. Each contender
    is a section of its own, so its compilation has its own box: a compile that runs long is cut there, and
    neither the eager decode nor the other contender loses a second to it (in the first GPU run,
    transformers' compilation used the whole decode box)."""
    if not sec.cuda:
        raise Skip("mode='reduce-overhead' is CUDA graphs; on the CPU it compiles for minutes")
    d = _Decode(sec)
    graphs_before = _dynamo_counts()
    started = time.perf_counter()
    with d.torch.no_grad():
        if contender == "transformers":  # HF's documented recipe: a static cache and a compiled forward
            d.hf.forward = d.torch.compile(d.hf.forward, mode="reduce-overhead")
            fn = lambda t, n: d.hf_gen(t, n, cache_implementation="static")
        else:
            d.ours.compile(mode="reduce-overhead")  # CUDA graphs over the static cache's one decode graph
            fn = lambda t, n: d.ours_gen(t, n, static_cache=True)
        for batch, tokens in d.prompts.items():  # batch 1 first: the target; batch 32 if the box allows
            d.add("compiled", contender, batch, d.per_token(fn, tokens, contender))
            after = _dynamo_counts()
            # a decode split into many graphs (graph breaks, recompiles for each cache length) replays
            # many small CUDA graphs, or falls back to eager past dynamo's cache limit
            sec.put("dynamo", {k: after[k] - graphs_before.get(k, 0) for k in after})
    sec.summary = ", ".join(f"batch {r['batch']}: {r['ms_per_token']:.2f} ms/token ({r['over_floor']:.1f}x the floor)"
                            for r in d.rows) + f"; {time.perf_counter() - started:.0f} s with compilation"
    sec.note(sec.summary)


def section_compiled_ours(sec: Section) -> None:
    _compiled_decode(sec, "ours")


def section_compiled_transformers(sec: Section) -> None:
    _compiled_decode(sec, "transformers")


def _open_real(device: str, dtype):
    """The real pretrained model (issue 35's SmolLM2-135M) through ``workbench.open_pretrained``, or Skip
    where that call has not landed or its model is not installed. Only the arguments it takes are passed."""
    import inspect

    import workbench as wb

    opener = getattr(wb, "open_pretrained", None)
    if opener is None:
        raise Skip("workbench.open_pretrained does not exist yet: the real model's parity and speed wait for it")
    accepted = inspect.signature(opener).parameters
    kwargs = {k: v for k, v in (("device", device), ("dtype", dtype)) if k in accepted}
    try:
        opened = opener(**kwargs)
    except (ImportError, FileNotFoundError, getattr(wb, "GGUFImportError", ImportError)) as err:
        raise Skip(f"workbench.open_pretrained: {type(err).__name__}: {str(err)[:200]}") from err
    model = opened[0] if isinstance(opened, tuple) else opened
    return model.to(device=device, dtype=dtype).eval()


def _real_speed(sec: Section, model, gen) -> dict:
    """The device's speed on the real model: a forward of 4 x 256 tokens and greedy decode at batch 1."""
    import torch

    long = torch.randint(3, model.cfg.d_vocab, (4, 256), generator=gen).to(sec.device)
    one = long[:1, :128]
    with torch.no_grad():
        model(long)
        fwd = median_time(lambda: model(long), 5, sec.sync)
        model.generate(one, max_new_tokens=4, use_kv_cache=True)
        t = median_time(lambda: model.generate(one, max_new_tokens=33, use_kv_cache=True), 3, sec.sync)
        pre = median_time(lambda: model(one), 3, sec.sync)
    return {"forward_4x256_ms": 1e3 * fwd, "decode_ms_per_token": 1e3 * max(t - pre, 0.0) / 32}


def section_parity(sec: Section) -> None:
    """The real model on the device against the same model on the CPU: fp32 logits to 1e-4, bf16 within two
    bf16 roundings of the CPU's bf16 logits; then its forward and decode speed on the device."""
    import torch

    if not sec.cuda:
        raise Skip("a device against the CPU: nothing to compare on a CPU-only run")
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 parity means fp32 matmuls, not TF32's 10-bit mantissa
    torch.backends.cudnn.allow_tf32 = False
    gen = torch.Generator().manual_seed(0)
    rows = []
    import copy

    base = _open_real("cpu", torch.float32)  # opened once (its first open converts the file), copied per dtype
    for dtype in (torch.float32, torch.bfloat16):
        cpu = copy.deepcopy(base).to(dtype=dtype)
        tokens = torch.randint(3, cpu.cfg.d_vocab, (2, 64), generator=gen)
        with torch.no_grad():
            ref = cpu(tokens).float()
        dev = cpu.to(sec.device)
        with torch.no_grad():
            got = dev(tokens.to(sec.device)).float().cpu()
        diff = (got - ref).abs()
        if dtype == torch.float32:
            ok = bool(diff.max() <= 1e-4)
            bound = "1e-4"
        else:
            # two roundings: 2 x bf16's half-ulp-to-ulp spacing at each logit's magnitude (eps 2^-7 relative)
            spacing = torch.finfo(torch.bfloat16).eps * torch.maximum(got.abs(), ref.abs()).clamp_min(2.0**-126)
            ok = bool((diff <= 2 * spacing).all())
            bound = "2 bf16 roundings"
        rows.append({"dtype": str(dtype).replace("torch.", ""), "max_abs_diff": float(diff.max()),
                     "mean_abs_diff": float(diff.mean()), "bound": bound, "within": ok})
        sec.put("parity", rows)
        if not ok:
            sec.status = "failed"
        rows[-1].update(_real_speed(sec, dev, gen))
        sec.put("parity", rows)
        del cpu, dev
        torch.cuda.empty_cache()
    sec.summary = "; ".join(f"{r['dtype']}: max |diff| {r['max_abs_diff']:.2e} ({'within' if r['within'] else 'BEYOND'} "
                            f"{r['bound']}), forward {r['forward_4x256_ms']:.1f} ms, decode {r['decode_ms_per_token']:.2f} "
                            "ms/token" for r in rows)
    sec.note(sec.summary)


def section_contenders(sec: Section) -> None:
    sys.path.insert(0, str(REPO / "benchmarks"))
    import contenders

    size = sec.args.model_size
    ensure_llama(sec, size)
    argv = ["--size", size, "--dtype", "bfloat16", "--device", sec.device, "--dir", str(sec.work),
            "--threads", str(sec.args.threads or min(8, os.cpu_count() or 1))]
    argv += ["--batch", "2", "--pos", "16", "--repeats", "1"] if sec.quick else ["--batch", "4", "--pos", "256", "--repeats", "3"]
    sec.put("argv", argv)
    rows: list = []
    try:
        table = contenders.main(argv, rows=rows)
    finally:  # the timings stand even when the patching numbers disagree (which fails the section)
        sec.put("rows", rows)
    sec.put("rows", table.to_dict("records"))
    ours_of = {"forward": "ours", "cache": "ours run_with_cache", "patch heads": "ours"}
    parts = []
    for task, group in table.groupby("task", sort=False):
        others = group[~group.contender.str.startswith("ours") & (group.contender != "transformers hidden_states")]
        mine = group[group.contender == ours_of[task]].median_s.iloc[0]
        parts.append(f"{task}: ours {mine * 1e3:.1f} ms" + "".join(
            f", {r.contender} {r.median_s / mine:.2f}x" for r in others.itertuples()))
    sec.summary = "; ".join(parts)


def section_dictionary(sec: Section) -> None:
    import torch

    sys.path.insert(0, str(REPO / "benchmarks"))
    import dictionaries

    d_in, d_sae, k, batch, steps, rows = (64, 512, 8, 256, 6, 4096) if sec.quick else (2048, 16384, 32, 4096, 30, 65536)
    # Rows with a random covariance, x = z M (z ~ N(0, I)): the training speed does not depend on what they hold.
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, d_in, generator=gen) @ (torch.randn(d_in, d_in, generator=gen) / d_in**0.5)
    sec.put("setup", {"d_in": d_in, "d_sae": d_sae, "k": k, "batch": batch, "steps": steps, "rows": rows,
                      "data": "x = z M, z ~ N(0, I), rows in CPU memory, each batch moved to the device"})
    plain, ours = [], []
    for _ in range(1 if sec.quick else 2):  # in turns, so both see the same device state
        plain.append(dictionaries.plain_topk_loop(x, d_sae, k, batch, steps, 1e-4, device=sec.device))
        ours.append(dictionaries.ours_topk(x, d_sae, k, batch, steps, 1e-4, device=sec.device))
        sec.put("tokens_per_s", {"plain": plain, "train_sae": ours})
    p, o = max(plain), max(ours)
    sec.summary = f"train_sae {o:,.0f} tokens/s vs plain loop {p:,.0f} ({o / p:.2f}x), TopK d_in {d_in} d_sae {d_sae} k {k}"
    sec.note(sec.summary)


def section_training(sec: Section) -> None:
    import workbench as wb
    from workbench.training import TrainConfig, train

    steps = 4 if sec.quick else 40
    cfg = (wb.ModelConfig(d_model=32, n_layers=2, n_heads=2, d_vocab=64, n_ctx=32, seed=0) if sec.quick else
           wb.ModelConfig(d_model=768, n_layers=12, n_heads=12, d_vocab=64, n_ctx=256, seed=0))
    rows = []
    for autocast in (["bf16", "none"] if sec.cuda else ["none"]):
        tc = TrainConfig(task="induction", steps=steps, batch_size=32, seq_len=cfg.n_ctx, warmup_steps=0,
                         log_every=max(1, steps // 4), eval_every=0, eval_batches=1, device=sec.device,
                         autocast=autocast, save_train_state=False, seed=0)
        history = train(tc, cfg, progress=False).history
        rates = history["tokens_per_s"].tolist()
        rates = rates[1:] or rates  # the first window holds the warm-up step
        rows.append({"autocast": autocast, "tokens_per_s": sorted(rates)[len(rates) // 2],
                     "first_loss": float(history["train_loss"].iloc[0]), "last_loss": float(history["train_loss"].iloc[-1])})
        sec.put("rows", rows)
        sec.note(f"autocast {autocast}: {rows[-1]['tokens_per_s']:,.0f} tokens/s, loss {rows[-1]['first_loss']:.3f} -> "
                 f"{rows[-1]['last_loss']:.3f}")
    if any(not (r["last_loss"] == r["last_loss"]) for r in rows):
        raise RuntimeError("a training loss is NaN")
    sec.summary = ", ".join(f"{r['autocast']} {r['tokens_per_s']:,.0f} tokens/s" for r in rows) + \
        f" ({cfg.n_layers} layers x d_model {cfg.d_model}, {steps} steps)"
    if not sec.cuda:
        sec.summary += "; bf16 autocast is CUDA-only ('auto'), so only fp32 ran"


def section_circuits(sec: Section) -> None:
    import torch

    from workbench.analysis.circuits import edge_attribution
    from workbench.analysis.common import logit_diff_metric

    contexts = [int(c) for c in sec.args.circuit_contexts.split(",")]
    size = "tiny" if sec.quick else "300m"
    model = random_llama(size, sec.device, n_ctx=max(contexts))
    metric = logit_diff_metric(1, 2)
    sec.put("model", f"random Llama-shaped {size}, fp32, n_ctx {max(contexts)}")
    rows: list[dict] = []
    try:
        from workbench.analysis import graphs
    except ImportError as err:
        graphs = None
        sec.note(f"attribution graph: skipped, workbench.analysis.graphs is not here ({err}); EAP runs alone")
    gen = torch.Generator().manual_seed(0)
    pair = lambda n: tuple(torch.randint(3, model.cfg.d_vocab, (1, n), generator=gen).to(sec.device) for _ in range(2))
    edge_attribution(model, pair(16), metric, "eap")  # the device's first kernels are not the method's time
    for ctx in contexts:
        clean, corrupted = pair(ctx)
        sec.reset_peak()
        started = time.perf_counter()
        try:
            table = edge_attribution(model, (clean, corrupted), metric, "eap")
            sec.sync()
        except torch.OutOfMemoryError as err:  # a finding, not a broken check: how far the method goes here
            rows.append({"method": "eap", "tokens": ctx, "seconds": time.perf_counter() - started,
                         "peak_gib": sec.peak_gib(), "edges": None, "note": "out of memory"})
            sec.note(f"EAP at {ctx} tokens: out of memory ({str(err)[:200]})")
            torch.cuda.empty_cache()
            continue
        rows.append({"method": "eap", "tokens": ctx, "seconds": time.perf_counter() - started,
                     "peak_gib": sec.peak_gib(), "edges": len(table)})
        sec.put("rows", rows)
        sec.note(f"EAP over {len(table)} edges at {ctx} tokens: {rows[-1]['seconds']:.2f} s"
                 + (f", peak {rows[-1]['peak_gib']:.2f} GiB" if sec.cuda else ""))
        del table
        if graphs is not None and sec.left() > 30:
            try:
                rows.append(_graph_row(sec, graphs, ctx))
                sec.put("rows", rows)
            except Exception as err:  # the graph module's API is young: say what failed and go on
                sec.note(f"attribution graph at {ctx} tokens: {type(err).__name__}: {str(err)[:300]}")
    sec.summary = "; ".join(f"{r['method']} {r['tokens']} tokens {r['seconds']:.2f} s"
                            + (f" {r['peak_gib']:.2f} GiB" if r.get("peak_gib") is not None else "") for r in rows)


def _graph_row(sec: Section, graphs, ctx: int) -> dict:
    """One attribution graph at ``ctx`` tokens, on benchmarks/graphs.py's setup (a stories-size random model
    with TopK-16 skip transcoders of 512 features per layer) and with its settings, on this device."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import graphs as bench  # benchmarks/graphs.py, which lands with the graph module

    model, transcoders, tokens = bench.build(ctx, 512, 16)
    model, tokens = model.to(sec.device), tokens.to(sec.device)
    transcoders = [tc.to(sec.device) for tc in transcoders]
    sec.reset_peak()
    started = time.perf_counter()
    graph = graphs.attribution_graph(model, transcoders, tokens, max_feature_nodes=128, batch_size=16, edge_mass=0.999,
                                     max_edges_per_node=2048, max_n_logits=10)
    sec.sync()
    row = {"method": "attribution graph (stories-size, 512 TopK-16 skip transcoders)", "tokens": ctx,
           "seconds": time.perf_counter() - started, "peak_gib": sec.peak_gib(),
           "edges": getattr(graph, "n_edges", None),
           "active_features": getattr(graph, "meta", {}).get("n_active_features")}
    sec.note(f"attribution graph at {ctx} tokens: {row['seconds']:.2f} s" + (f", peak {row['peak_gib']:.2f} GiB" if sec.cuda else "")
             + f", {row['active_features']} active features, {row['edges']} edges")
    return row


def section_app(sec: Section) -> None:
    try:
        from streamlit.testing.v1 import AppTest
    except ImportError as err:
        raise Skip(f"streamlit cannot be imported here ({err}); its wheel travels in scripts/gpu_wheels") from None
    os.environ["WORKBENCH_DEVICE"] = sec.device
    os.environ.setdefault("WORKBENCH_CHECKPOINTS", str(REPO / "checkpoints"))
    sys.path.insert(0, str(REPO))  # `import ui`, as streamlit running app.py does
    sec.reset_peak()
    started = time.perf_counter()
    at = AppTest.from_file(str(REPO / "app.py"), default_timeout=max(10.0, sec.left() - 10))
    at.run()
    first = time.perf_counter() - started
    if at.exception:
        raise RuntimeError(f"the Inspect page raised: {[e.value for e in at.exception][:3]}")
    captions = [c.value for c in at.sidebar.caption]
    where = next((c for c in captions if "Runs on" in c), "")
    n_figures = len(at.get("plotly_chart"))
    sec.put("first_run_s", first)
    sec.put("sidebar", where)
    sec.put("figures", n_figures)
    sec.note(f"Inspect opened in {first:.1f} s: {n_figures} figures, sidebar says {where!r}")
    started = time.perf_counter()
    at.text_area(key="prompt").input("Once upon a time there was a little dog who liked to run.").run()
    rerun = time.perf_counter() - started
    if at.exception:
        raise RuntimeError(f"a new prompt raised: {[e.value for e in at.exception][:3]}")
    sec.put("new_prompt_s", rerun)
    sec.put("peak_gib", sec.peak_gib())
    if f"`{sec.device}" not in where:
        raise RuntimeError(f"the page ran, but not on {sec.device}: the sidebar says {where!r}")
    sec.summary = f"Inspect on {sec.device}: first run {first:.1f} s, new prompt {rerun:.2f} s, {n_figures} figures"


SECTIONS: dict[str, Callable[[Section], None]] = {name: globals()[f"section_{name}"] for name in ORDER}


# ---- the orchestrator -------------------------------------------------------------------------------------
class Tee:
    """Everything printed goes to the terminal and to log.txt (forked sections inherit it)."""

    def __init__(self, stream, log):
        self.stream, self.log = stream, log

    def write(self, text: str) -> int:
        self.stream.write(text)
        self.log.write(text)
        return len(text)

    def flush(self) -> None:
        self.stream.flush()
        self.log.flush()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self.stream.fileno()


def install_wheels(site: Path) -> dict:
    """Install the pinned wheels this interpreter lacks into ``site`` (--no-deps, from the folder only)."""
    import importlib.metadata as md

    wanted = [line.split("#")[0].strip() for line in (WHEELS / "requirements.txt").read_text().splitlines()]
    wanted = [w for w in wanted if w]
    present, missing = {}, []
    for requirement in wanted:
        name = requirement.split("==")[0]
        try:
            present[name] = md.version(name)
        except md.PackageNotFoundError:
            missing.append(requirement)
    report: dict[str, Any] = {"present": present, "installed": [], "failed": {}}
    if missing:
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
               "--disable-pip-version-check", "--target", str(site), "--find-links", str(WHEELS)]
        run = subprocess.run(cmd + missing, capture_output=True, text=True)
        if run.returncode == 0:
            report["installed"] = missing
        else:  # one bad wheel must not keep the others out
            for requirement in missing:
                one = subprocess.run(cmd + [requirement], capture_output=True, text=True)
                if one.returncode == 0:
                    report["installed"].append(requirement)
                else:
                    why = (one.stderr or one.stdout).strip()[-500:]
                    if not list(WHEELS.glob(f"{requirement.split('==')[0]}-*.whl")):
                        why = (f"no wheel of {requirement} in {WHEELS}: it is not in git (over 5 MiB); run "
                               "scripts/gpu_wheels/fetch.sh where PyPI is reachable and carry the wheel. " + why)
                    report["failed"][requirement] = why
    return report


def section_min(name: str, args) -> float:
    return MIN_SECTION_S if args.quick else PLAN[name][1]


def plan(chosen: list[str], args, available: float) -> tuple[list[str], dict[str, str]]:
    """The sections that fit ``available`` seconds at their minimums, in ORDER; the rest, from the end,
    with the reason each is skipped."""
    planned, skipped, need = [], {}, 0.0
    for name in chosen:
        if need + section_min(name, args) <= available:
            planned.append(name)
            need += section_min(name, args)
        else:
            skipped[name] = (f"skipped: budget (needs at least {section_min(name, args):.0f} s; "
                             f"{max(available - need, 0):.0f} s of the {args.budget:.0f} s budget left after the sections before it)")
    return planned, skipped


def section_timeout(name: str, started: float, args, remaining: list[str]) -> float:
    """This section's box: its own, or less where the budget must keep every later planned section's minimum."""
    box = PLAN[name][2 if args.quick else 0] * args.budget_scale
    left = args.budget - (time.time() - started) - END_RESERVE_S
    return min(box, left - sum(section_min(n, args) for n in remaining))


def section_body(name: str, sec: Section) -> None:
    """What runs in a section's process: the section, its outcome recorded whatever happens."""
    try:
        SECTIONS[name](sec)
    except Skip as why:
        sec.status, sec.summary = "skipped", str(why)
        print(f"[{name}] skipped: {why}", flush=True)
    except BaseException as err:
        sec.status = "failed"
        sec.error = traceback.format_exc()[-4000:]
        sec.summary = sec.summary or f"{type(err).__name__}: {str(err)[:300]}"
        print(f"[{name}] FAILED: {sec.error}", flush=True)
    sec.flush()


def pump(proc: subprocess.Popen, prefix: str, tail: list) -> threading.Thread:
    """Copy a child's output to ours (and so to log.txt) line by line as it comes, keeping the lines in ``tail``."""
    def copy() -> None:
        for line in proc.stdout:
            print(f"{prefix}{line}", end="", flush=True)
            tail.append(line.rstrip())

    thread = threading.Thread(target=copy, daemon=True)
    thread.start()
    return thread


def run_section(name: str, sec: Section, timeout: float, fresh: bool = False) -> dict:
    """Run one section in a process of its own and kill its process group at the time box: forked from
    this one (the libraries already imported; this process never touches CUDA, so the child may), or
    with ``fresh`` a new interpreter (``--fresh-processes``: slower to start, immune to anything a fork
    inherits)."""
    sec.flush()
    started = time.time()
    if fresh:
        cmd = [sys.executable, str(Path(__file__).resolve()), *sec.args.argv, "--device", sec.device,
               "--child", name, "--child-work", str(sec.work), "--child-deadline", repr(sec.deadline)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        reader = pump(proc, "", [])
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        pid, alive = proc.pid, lambda: proc.poll() is None
    else:
        def child() -> None:
            os.setpgid(0, 0)  # its subprocesses (pytest, import children) go with it at a timeout
            section_body(name, sec)

        proc = multiprocessing.get_context("fork").Process(target=child, name=f"gpu-check-{name}")
        proc.start()
        proc.join(timeout)
        pid, alive, reader = proc.pid, proc.is_alive, None
    timed_out = alive()
    if timed_out:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(pid, sig)
            except ProcessLookupError:
                break
            time.sleep(0.5)
            deadline = time.time() + 5
            while alive() and time.time() < deadline:
                time.sleep(0.2)
            if not alive():
                break
    if reader is not None:
        reader.join(5)
    exitcode = proc.returncode if fresh else proc.exitcode
    record = json.loads(sec.path.read_text())
    # Whatever the section left running (its own group: import children; the groups it recorded: pytest's)
    for group in [pid, *record["data"].get("process_groups", [])]:
        try:
            os.killpg(group, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if timed_out:
        record["status"] = "timeout"
        record["summary"] = f"cut at its {timeout:.0f} s box; " + (record["summary"] or "what it measured is kept")
    elif exitcode != 0 and record["status"] == "ok":
        record["status"] = "crashed"
        record["summary"] = f"the process died (exit code {exitcode}); " + record["summary"]
    record["seconds"] = time.time() - started
    record["box_s"] = timeout
    return record


def write_results(out: Path, results: dict) -> None:
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "results.md").write_text(markdown(results))


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def _table(rows: list[dict]) -> list[str]:
    columns = list(dict.fromkeys(k for row in rows for k in row))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(c, "")) for c in columns) + " |" for row in rows]
    return lines


def markdown(results: dict) -> str:
    env = results["sections"].get("environment", {}).get("data", {}).get("info", {})
    lines = [f"# GPU check: {env.get('device_name', results['device'])}", "",
             f"Started {results['started']} (UTC), {results.get('seconds', 0):.0f} s in all; device `{results['device']}`"
             f"{' (quick)' if results['quick'] else ''}; python {env.get('python', '?')}, torch {env.get('torch', '?')}; "
             f"command: `{results['command']}`", "",
             f"Wheels installed for this run: {', '.join(results.get('wheels', {}).get('installed', [])) or 'none needed'}"
             + "".join(f"; FAILED {k}: {_cell(v)}" for k, v in results.get("wheels", {}).get("failed", {}).items()), ""]
    if results.get("preload_error"):
        lines += ["Importing the libraries failed before any section ran:", "", "```", results["preload_error"], "```", ""]
    lines += ["| section | status | seconds | summary |", "|---|---|---|---|"]
    for name, rec in results["sections"].items():
        lines.append(f"| {name} | {rec['status']} | {rec.get('seconds', 0):.0f} | {_cell(rec.get('summary', ''))} |")
    for name, rec in results["sections"].items():
        lines += ["", f"## {name}: {rec['status']}", ""]
        for key, value in rec.get("data", {}).items():
            if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
                lines += [f"{key}:", "", *_table(value), ""]
            elif isinstance(value, dict) and key != "info":
                lines.append(f"- {key}: " + ", ".join(f"{k} {_cell(v)}" for k, v in value.items()))
            elif key != "info":
                lines.append(f"- {key}: {_cell(value)}")
        lines += [f"- {m}" for m in rec.get("messages", [])[-8:]]
        if rec.get("error"):
            lines += ["", "```", rec["error"][-1500:], "```"]
    if env:
        lines += ["", "## environment details", "", *[f"- {k}: {_cell(v)}" for k, v in env.items()]]
    return "\n".join(lines) + "\n"


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default=None, help="cuda (default where torch sees one), cpu, cuda:1, ...")
    parser.add_argument("--quick", action="store_true", help="tiny shapes and short boxes: the CI run (about a minute)")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default $OUT, else ./gpu-check-out)")
    parser.add_argument("--sections", default=",".join(ORDER), help=f"comma-separated subset of {','.join(ORDER)}")
    parser.add_argument("--budget", "--deadline", dest="budget", type=float, default=None,
                        help="seconds for the whole run, planned section by section in ORDER (default 540 on a GPU, "
                             "400 with --quick); sections that do not fit are 'skipped: budget'")
    parser.add_argument("--budget-scale", type=float, default=1.0, help="multiply every section's time box")
    parser.add_argument("--import-sizes", default=None, help="model sizes for the import section (default 1b,8b; quick tiny,small)")
    parser.add_argument("--import-repeats", type=int, default=None, help="fresh-process imports per contender (default 1)")
    parser.add_argument("--model-size", default=None, help="the model of decode and contenders (default 1b; quick tiny)")
    parser.add_argument("--circuit-contexts", default=None, help="token counts of the circuit runs (default 1024,4096)")
    parser.add_argument("--work-dir", type=Path, default=None, help="where models are written (default: the temp "
                        "folder with the most free space); removed at the end unless --keep")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (models written)")
    parser.add_argument("--fresh-processes", action="store_true",
                        help="start each section in a new interpreter instead of a fork of this one")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # a section's process (--fresh-processes)
    parser.add_argument("--child-work", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-deadline", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's own; 1 with --quick, where tiny ops on a shared "
                             "machine run slower on two threads than on one)")
    args = parser.parse_args(argv)
    args.argv = [a for a in (sys.argv[1:] if argv is None else argv)]
    unknown = set(args.sections.split(",")) - set(ORDER)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; the sections are {','.join(ORDER)}")
    args.budget = args.budget or (400.0 if args.quick else 540.0)
    args.import_sizes = args.import_sizes or ("tiny" if args.quick else "1b,8b")
    args.import_repeats = args.import_repeats or 1
    args.model_size = args.model_size or ("tiny" if args.quick else "1b")
    if args.threads is None:
        args.threads = 1 if args.quick else 0
    args.circuit_contexts = args.circuit_contexts or ("32,64" if args.quick else "1024,4096")
    return args


def work_root(given: Optional[Path]) -> Path:
    """The temp folder with the most free space (an 8B model is 16 GB), unless one is given."""
    if given:
        given.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix="gpu-check-", dir=given))
    inside = REPO / ".gpu-check-work"  # ignored by git: the repo's own disk, where /tmp is a small RAM disk
    inside.mkdir(exist_ok=True)
    candidates = [p for p in {os.environ.get("TMPDIR"), tempfile.gettempdir(), "/var/tmp", str(inside)} if p]
    best = max((p for p in candidates if os.access(p, os.W_OK)), key=lambda p: shutil.disk_usage(p).free)
    if Path(best) != inside and not any(inside.iterdir()):
        inside.rmdir()
    return Path(tempfile.mkdtemp(prefix="gpu-check-", dir=best))


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.child:  # one section in a fresh interpreter; the parent reads its JSON
        sys.path.insert(0, str(REPO))
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        work = args.child_work
        section_body(args.child, Section(args.child, args.device, args.quick, work, work / f"{args.child}.json",
                                         args.child_deadline, args))
        return 0
    out = (args.out or Path(os.environ.get("OUT") or REPO / "gpu-check-out")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "log.txt", "a", buffering=1)
    sys.stdout, sys.stderr = Tee(sys.__stdout__, log), Tee(sys.__stderr__, log)
    started = time.time()
    work = work_root(args.work_dir)
    print(f"gpu check: results in {out}, models in {work}, budget {args.budget:.0f} s", flush=True)

    wheels = install_wheels(work / "site")
    if wheels["installed"]:
        sys.path.insert(0, str(work / "site"))
        os.environ["PYTHONPATH"] = os.pathsep.join([str(work / "site"), *filter(None, [os.environ.get("PYTHONPATH")])])
    print(f"wheels installed: {wheels['installed'] or 'none needed'}; failed: {list(wheels['failed']) or 'none'}", flush=True)
    # Asking whether CUDA exists through NVML leaves the driver untouched, so forked sections can use it.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        os.environ.setdefault(name, "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.path.insert(0, str(REPO))
    preload_error = ""
    try:  # imported once here, before any fork: each section starts with the libraries loaded
        import torch
        import transformers  # noqa: F401

        import workbench  # noqa: F401
        import workbench.analysis.circuits  # noqa: F401
        import workbench.analysis.dictionaries  # noqa: F401

        if args.threads:
            torch.set_num_threads(args.threads)
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    except Exception:
        preload_error = traceback.format_exc()[-3000:]
        print(f"importing the libraries failed; every section will say so:\n{preload_error}", flush=True)
        device = args.device or "cuda"

    results: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(started)), "device": device,
                               "quick": args.quick, "command": " ".join(["scripts/gpu_check.py", *(argv or sys.argv[1:])]),
                               "budget_s": args.budget, "wheels": wheels, "preload_error": preload_error,
                               "sections": {}}
    chosen = [name for name in ORDER if name in args.sections.split(",")]
    planned, budget_skips = plan(chosen, args, args.budget - (time.time() - started) - END_RESERVE_S)
    results["plan"] = {"budget_s": args.budget, "planned": planned, "skipped": list(budget_skips)}
    for name in chosen:
        results["sections"][name] = {"status": "not run", "summary": "", "messages": [], "data": {}}
    for name, why in budget_skips.items():
        results["sections"][name] = {"status": "skipped", "summary": why, "messages": [], "data": {}, "seconds": 0}
        print(f"== {name}: {why}", flush=True)
    for i, name in enumerate(planned):
        timeout = section_timeout(name, started, args, planned[i + 1:])
        if timeout < section_min(name, args):
            why = (f"skipped: budget ({max(timeout, 0):.0f} s left for it, at least {section_min(name, args):.0f} s "
                   "needed; the sections before it overran)")
            results["sections"][name] = {"status": "skipped", "summary": why, "messages": [], "data": {}, "seconds": 0}
            print(f"== {name}: {why}", flush=True)
            continue
        print(f"\n== {name} (box {timeout:.0f} s, {time.time() - started:.0f} s into the run)", flush=True)
        sec = Section(name, device, args.quick, work, work / f"{name}.json", time.time() + timeout, args)
        results["sections"][name] = record = run_section(name, sec, timeout, fresh=args.fresh_processes)
        print(f"== {name}: {record['status']} in {record['seconds']:.0f} s: {record['summary']}", flush=True)
        if (work / "tests-tail.txt").exists():
            shutil.copyfile(work / "tests-tail.txt", out / "tests-tail.txt")
        results["seconds"] = time.time() - started
        write_results(out, results)
    results["seconds"] = time.time() - started
    results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    write_results(out, results)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
        if work.parent.name == ".gpu-check-work" and not any(work.parent.iterdir()):
            work.parent.rmdir()
    counts = {}
    for rec in results["sections"].values():
        counts[rec["status"]] = counts.get(rec["status"], 0) + 1
    print(f"\ngpu check done in {results['seconds']:.0f} s: " + ", ".join(f"{n} {s}" for s, n in counts.items())
          + f"; {out / 'results.md'}", flush=True)
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    log.close()
    cap_log(out / "log.txt")
    return 0


def cap_log(path: Path, cap: int = LOG_CAP_BYTES) -> None:
    """Keep what travels back small: a log over ``cap`` keeps its first eighth and its last part."""
    if not path.exists() or path.stat().st_size <= cap:
        return
    data = path.read_bytes()
    head, tail = data[: cap // 8], data[-(cap - cap // 8):]
    path.write_bytes(head + f"\n[... {len(data) - len(head) - len(tail)} bytes of the log cut here ...]\n".encode() + tail)


if __name__ == "__main__":
    sys.exit(main())
