"""Resident memory from Linux's /proc, shared by the benchmarks and by ``_ct_side.py`` (which runs in
circuit-tracer's own venv: standard library only here)."""

import ctypes
import gc
import resource
from typing import Callable, Optional, Union


def status_bytes(field: str, pid: Union[int, str] = "self") -> Optional[int]:
    """A memory field of ``/proc/<pid>/status`` in bytes (``VmRSS``: resident now, ``VmHWM``: its peak), or None
    where it cannot be read (not Linux, or the process has ended)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_mb() -> float:
    """This process's peak resident memory in MB: Linux's VmHWM, which an exec starts afresh. Not ru_maxrss: Linux
    carries the pre-exec high-water mark across execve, so a child forked from a large parent reported the parent's."""
    peak = status_bytes("VmHWM")
    return peak / 2**20 if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def peak_growth(fn: Callable) -> Optional[int]:
    """How far one call of ``fn`` raised the process's resident memory above where it started (bytes),
    the peak reset first (Linux /proc/self/clear_refs) and freed memory handed back to the system first
    (glibc's malloc_trim), so that reused free memory does not hide the growth; None where that cannot be read."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    start = status_bytes("VmRSS")
    out = fn()
    peak = status_bytes("VmHWM")
    del out
    return None if start is None or peak is None else peak - start
