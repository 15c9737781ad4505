"""Small things every part of the library shares: a mode flip that survives exceptions, and the
argument checks of the public API.

Every public function that takes a count, an index or a scale checks it here, at the
boundary, so a bad value raises one ``ValueError`` that names the argument and its valid
range instead of an ``IndexError`` (or a silently wrapped index) deep inside torch.
``bool`` is never accepted as a number: ``True`` is an ``int`` to Python but never what a
caller meant by ``n_layers=True``.
"""

from __future__ import annotations

import contextlib
import math
import numbers
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import torch
from torch import Tensor, nn

Number = Union[int, float]


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """``model.eval()`` for the duration of the block; its previous mode is restored even on error."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def _range_text(lo: Optional[Number], hi: Optional[Number], lo_open: bool = False, hi_open: bool = False) -> str:
    if lo is not None and hi is not None:
        return f" in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
    if lo is not None:
        return f" {'>' if lo_open else '>='} {lo}"
    if hi is not None:
        return f" {'<' if hi_open else '<='} {hi}"
    return ""


def is_int(value: Any) -> bool:
    """An integer that is not a bool (numpy integers count)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, torch.Tensor))


def check_int(name: str, value: Any, lo: Optional[int] = None, hi: Optional[int] = None) -> int:
    """``value`` as an int, or ValueError naming ``name`` and the range ``[lo, hi]`` (inclusive)."""
    if is_int(value) and (lo is None or value >= lo) and (hi is None or value <= hi):
        return int(value)
    raise ValueError(f"{name} must be an integer{_range_text(lo, hi)}, got {value!r}")


def check_float(
    name: str,
    value: Any,
    lo: Optional[Number] = None,
    hi: Optional[Number] = None,
    *,
    lo_open: bool = False,
    hi_open: bool = False,
) -> float:
    """``value`` as a finite float within the range, or ValueError naming ``name`` and the range."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, (bool, torch.Tensor)) and math.isfinite(value)
    if ok:
        ok = (lo is None or (value > lo if lo_open else value >= lo)) and (
            hi is None or (value < hi if hi_open else value <= hi)
        )
    if ok:
        return float(value)
    raise ValueError(f"{name} must be a finite number{_range_text(lo, hi, lo_open, hi_open)}, got {value!r}")


def check_index(name: str, value: Any, size: int, *, negative: bool = False, of: str = "") -> int:
    """An index into an axis of ``size`` entries, as a non-negative int.

    Negative indices are refused unless ``negative=True`` (for arguments whose documentation
    promises Python-style counting from the end, such as ``pos=-1``); they are then normalised
    here, explicitly, rather than left for tensor indexing to wrap. ``of`` names the axis in
    the message (``"n_layers=2"``).
    """
    lo = -size if negative else 0
    if is_int(value) and lo <= value < size:
        return int(value) % size
    valid = f"[{lo}, {size})" if size > 0 else "none (the axis is empty)"
    where = f" ({of})" if of else ""
    raise ValueError(f"{name}={value!r} is out of range: valid values are integers in {valid}{where}")


def check_token_ids(name: str, ids: Any, d_vocab: Optional[int], *, allow: tuple[int, ...] = ()) -> Tensor:
    """Token ids (an int or an integer tensor) as a long tensor, each in ``[0, d_vocab)`` or in ``allow``.

    ``d_vocab=None`` checks only the type and the sign (for a check made before the vocabulary is known).
    """
    if isinstance(ids, Tensor):
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise ValueError(f"{name} must hold integer token ids, got dtype {ids.dtype}")
        tensor = ids.long()
    elif is_int(ids):
        tensor = torch.tensor(int(ids))
    else:
        raise ValueError(f"{name} must be a token id (an integer) or an integer tensor of ids, got {ids!r}")
    bad = (tensor < 0) | (tensor >= d_vocab) if d_vocab is not None else tensor < 0
    for value in allow:
        bad &= tensor != value
    if bool(bad.any()):
        valid = f"in [0, {d_vocab})" if d_vocab is not None else ">= 0"
        extra = f" (or {', '.join(map(str, allow))})" if allow else ""
        raise ValueError(f"{name} must be token ids {valid}{extra}; got {int(tensor[bad].flatten()[0])}")
    return tensor


def check_seed(name: str, value: Any, *, optional: bool = False) -> Optional[int]:
    """A seed torch's generators accept: an integer in [0, 2**64 - 1] (or None when ``optional``)."""
    if optional and value is None:
        return None
    if is_int(value) and 0 <= value < 2**64:
        return int(value)
    raise ValueError(f"{name} must be an integer in [0, 2**64){' or None' if optional else ''}, got {value!r}")


def jsonable(value: Any) -> Any:
    """Recursively turn tuples, paths and tokenizer objects into JSON-friendly values."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "kind"):
        return value.kind
    return str(value)


def available_memory_bytes(device: Union[str, torch.device, None] = "cpu") -> Optional[int]:
    """Memory free for new tensors on ``device``: the system's MemAvailable for the CPU, the
    driver's free bytes for a CUDA device; None where neither says."""
    device = torch.device(device or "cpu")
    if device.type == "cuda" and torch.cuda.is_available():
        try:
            return int(torch.cuda.mem_get_info(device)[0])
        except (RuntimeError, AssertionError):
            return None
    if device.type != "cpu":
        return None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    import os

    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


NAME_MAX_BYTES = 255  # one file or folder name, on every common file system
PATH_MAX_BYTES = 4096


def check_path(path: Union[str, Path], what: str = "path") -> Path:
    """``path`` as a Path, or ValueError when the file system cannot hold it: a name over 255
    bytes or a path over 4096 (which ``stat`` answers with an ``OSError`` [Errno 36]), or a NUL."""
    text = str(path)
    if "\x00" in text:
        raise ValueError(f"the {what} contains a NUL character; type a usable {what}")
    long = [part for part in Path(text).parts if len(part.encode("utf-8", "surrogateescape")) > NAME_MAX_BYTES]
    if long:
        raise ValueError(f"the {what} has a name of {len(long[0].encode('utf-8', 'surrogateescape'))} bytes "
                         f"({long[0][:40]}...); file systems allow at most {NAME_MAX_BYTES}: use a shorter name")
    if len(text.encode("utf-8", "surrogateescape")) > PATH_MAX_BYTES:
        raise ValueError(f"the {what} is {len(text.encode('utf-8', 'surrogateescape'))} bytes long; file systems "
                         f"allow at most {PATH_MAX_BYTES}: use a shorter path")
    return Path(path)


# ---- has a module changed since? ------------------------------------------------------------------
_ROW = 4096  # elements per partial sum in weights_signature


def _sums(p: Tensor) -> tuple[Union[float, str], Union[float, str]]:
    """(sum, sum of squares) of a tensor's values: partial sums of ``_ROW`` elements each in float32
    (float64 for a float64 tensor), then added exactly (``math.fsum``).

    Each partial sum is one row of one reduction, made by one thread in a fixed order, and fsum's
    result does not depend on the order of its terms: the same values give the same two numbers
    whatever ``torch.set_num_threads`` says. A float64 sum over the whole tensor (what graphs compared before) is
    split among threads above 32,768 elements, and changed in its last bits when their number did,
    which would read as an edit; it was also about 3x slower (0.45-0.65 s a pass over SmolLM2-135M's
    weights on one thread of a busy 2-core machine, against 0.16-0.18 s). A change of one weight
    moves its row's partial sum by that change: one float32 ulp of a row sum is about 1e-7 at this
    scale. A tensor holding NaN or inf gives a string (NaN never equals itself: the same weights
    would read as changed)."""
    acc = torch.float64 if p.dtype == torch.float64 else torch.float32
    flat = p.detach().reshape(-1)
    cut = flat.numel() - flat.numel() % _ROW
    rows, tail = flat[:cut].view(-1, _ROW), flat[cut:].double()
    sums = rows.sum(1, dtype=acc).tolist() + tail.tolist()
    squares = torch.linalg.vector_norm(rows, dim=1, dtype=acc).double().square().tolist() + tail.square().tolist()
    return _exact_sum(sums), _exact_sum(squares)


def _exact_sum(values: list) -> Union[float, str]:
    try:
        total = math.fsum(values)
    except (ValueError, OverflowError):  # inf and -inf among the terms, or a finite sum past float64
        return "not finite"
    return total if math.isfinite(total) else "not finite"


def weights_signature(*modules) -> tuple:
    """Every parameter's dtype, device, shape, sum and sum of squares (``_sums``: one pass over the
    values, no copy of a contiguous tensor, the same whatever the thread count) of ``modules`` (anything
    with ``parameters()``). What a cache built from the weights compares to notice an edit, ``.data``
    edits included: those bump no version counter, so ``weights_stamp`` misses them."""
    with torch.no_grad():
        return tuple((p.dtype, str(p.device), tuple(p.shape), *_sums(p)) for m in modules for p in m.parameters())


def weights_stamp(*modules) -> tuple:
    """Every parameter's and buffer's (id, dtype, device, shape, storage address, version counter) of
    ``modules``: no pass over the values (about a microsecond a tensor), so it sees a
    ``load_state_dict``, a cast, a move, ``param.data = ...``, an in-place op on a parameter or an
    optimizer step, but not an in-place edit through ``.data`` (``p.data.mul_(2)``), which bumps no
    version counter (``weights_signature`` sees that, at the cost of a pass)."""
    tensors = [t for m in modules for t in (*m.parameters(), *(m.buffers() if hasattr(m, "buffers") else ()))]
    # an inference tensor (made under torch.inference_mode) has no version counter to read
    return tuple((id(t), t.dtype, t.device, t.shape, t.data_ptr(), None if t.is_inference() else t._version)
                 for t in tensors)
