"""The top k of each row on one CPU thread: a small C kernel, for a TopK dictionary's inference.

A spliced TopK SAE picks its k features per token with a top-k over ``d_sae`` pre-activations.
``torch.topk`` on the CPU copies each row into (value, index) pairs and runs a selection over
all of them, about 6 ns per element: on one thread the selection of 32 of 1,024 features for 512
tokens cost as much as the encoder's matmul. The kernel here first bounds the k-th largest value
from below without selecting anything (the least of the maxima of k equal chunks: k chunks reach
it), keeps only the entries at or above that bound (about a tenth of a random row), and runs a
quickselect over those (1.4-1.5 ms for 512 rows of 1,024 on this CPU's one thread, measured from C;
``torch.topk`` about 3 ms). Values are compared as int32 keys that order as the floats do, with NaN
above every number, as in ``torch.topk``; among equal values at the k-th place any choice is a top
k, as in ``torch.topk``.

It returns indices only; the values are gathered from the input, so gradients flow as through
``torch.topk``. It is a ``torch.library`` custom op (``workbench::row_topk_indices``) with a fake
implementation, so ``torch.compile`` graphs call it as one opaque kernel.

The C source is compiled with the system C compiler (the one inductor uses) the first time it is
needed, into a cache folder, in well under a second. Where there is none, or for anything but a
float32 CPU tensor, or when torch runs more than one thread (``torch.topk`` parallelises over
rows), ``row_topk_indices`` is ``chunked_topk``'s (``topk.py``, torch ops): never wrong, only slower.
"""

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

_SOURCE = r"""
#include <stdint.h>
#include <string.h>

/* An int32 that orders as the float does, NaN above every number (torch.topk's order). */
static inline int32_t key_of(float f) {
    int32_t b;
    memcpy(&b, &f, sizeof b);
    b ^= (b >> 31) & 0x7fffffff;
    return f != f ? INT32_MAX : b;
}

/* Reorder v[0, m) so that its k largest come first (quickselect, Hoare partition, median of three). */
static void select_top(int64_t *v, int64_t m, int64_t k) {
    int64_t lo = 0, hi = m - 1, t = k - 1;
    while (lo < hi) {
        int64_t a = v[lo], b = v[lo + (hi - lo) / 2], c = v[hi];
        int64_t pivot = a > b ? (b > c ? b : (a > c ? c : a)) : (a > c ? a : (b > c ? c : b));
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (v[i] > pivot) i++;
            while (v[j] < pivot) j--;
            if (i <= j) { int64_t s = v[i]; v[i] = v[j]; v[j] = s; i++; j--; }
        }
        if (t <= j) hi = j;
        else if (t >= i) lo = i;
        else return;
    }
}

/* Indices [rows, k] of the k largest of each row of x [rows, n] (n < 2^31). Scratch: keys (n int32),
   cand (n int64). The least of the maxima of k equal chunks is at most the row's k-th largest value
   (k chunks reach it), so only the entries at or above it (about a tenth of a random row) go to the
   selection, each packed with its index into one int64 (ties go to the lower index). */
void row_topk(const float *x, int64_t rows, int64_t n, int64_t k, int64_t *out, int32_t *keys, int64_t *cand) {
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * n;
        for (int64_t i = 0; i < n; i++) keys[i] = key_of(row[i]);
        int32_t floor = INT32_MAX;
        for (int64_t c = 0; c < k; c++) {
            int32_t top = INT32_MIN;
            for (int64_t i = c * n / k; i < (c + 1) * n / k; i++) top = keys[i] > top ? keys[i] : top;
            floor = top < floor ? top : floor;
        }
        int64_t m = 0;
        for (int64_t i = 0; i < n; i++) {  /* branch-free: write always, keep when at or above the floor */
            cand[m] = (int64_t)keys[i] * 4294967296LL + (n - 1 - i);  /* the key, then the index (packed) */
            m += keys[i] >= floor;
        }
        select_top(cand, m, k);
        for (int64_t j = 0; j < k; j++) out[r * k + j] = n - 1 - (cand[j] & 0xffffffffLL);
    }
}
"""

_LIBRARY: list = []  # [ctypes function or None], once tried


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "workbench" / "kernels"


def _load() -> Optional[ctypes._CFuncPtr]:
    """The compiled kernel (built once into the cache folder), or None where it cannot be built."""
    if _LIBRARY:
        return _LIBRARY[0]
    function = None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    digest = hashlib.sha256(_SOURCE.encode()).hexdigest()[:16]
    try:
        folder = _cache_dir()
        folder.mkdir(parents=True, exist_ok=True)
        library = folder / f"row_topk_{digest}.so"
        if not library.exists() and compiler:
            with tempfile.TemporaryDirectory(dir=folder) as tmp:  # built aside, then moved in whole
                source, built = Path(tmp) / "row_topk.c", Path(tmp) / "row_topk.so"
                source.write_text(_SOURCE)
                subprocess.run([compiler, "-O3", "-shared", "-fPIC", "-o", str(built), str(source)],
                               check=True, capture_output=True, timeout=120)
                os.replace(built, library)
        if library.exists():
            function = ctypes.CDLL(str(library)).row_topk
            function.restype = None
            function.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                 ctypes.c_void_p, ctypes.c_void_p]
    except (OSError, subprocess.SubprocessError):
        function = None
    _LIBRARY.append(function)
    return function


# (no ``from __future__ import annotations`` in this file: torch.library reads this signature's types)
@torch.library.custom_op("workbench::row_topk_indices", mutates_args=())
def row_topk_indices(x: Tensor, k: int) -> Tensor:
    """Indices [*rows, k] (long, in no particular order) of the ``k`` largest entries of each row of ``x``."""
    n = x.shape[-1]
    kernel = (_load() if x.device.type == "cpu" and x.dtype == torch.float32 and 1 <= k <= n < 2**31
              and torch.get_num_threads() == 1 else None)
    if kernel is None:
        from workbench.analysis.dictionaries.topk import chunked_topk

        return chunked_topk(x, k)[1]
    rows = x.reshape(-1, n).contiguous()
    out = torch.empty((rows.shape[0], k), dtype=torch.long)
    keys, candidates = torch.empty(n, dtype=torch.int32), torch.empty(n, dtype=torch.long)
    kernel(rows.data_ptr(), rows.shape[0], n, k, out.data_ptr(), keys.data_ptr(), candidates.data_ptr())
    return out.view(*x.shape[:-1], k)


@row_topk_indices.register_fake
def _(x: Tensor, k: int) -> Tensor:
    return x.new_empty((*x.shape[:-1], k), dtype=torch.long)


def row_topk(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """``x.topk(k, dim=-1, sorted=False)``: (values, indices), the same elements (ties aside)."""
    indices = row_topk_indices(x.detach(), int(k))
    return x.gather(-1, indices), indices
