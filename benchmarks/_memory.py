"""Peak memory of the running process, shared by the benchmarks and by ``_ct_side.py`` (which runs in
circuit-tracer's own venv: standard library only here)."""

import resource


def peak_mb() -> float:
    """This process's peak resident memory in MB: Linux's VmHWM, which an exec starts afresh. Not ru_maxrss: Linux
    carries the pre-exec high-water mark across execve, so a child forked from a large parent reported the parent's."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
