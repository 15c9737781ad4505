"""Safetensors checkpoints read and written one tensor at a time, at the target device and dtype.

Import: the workbench model is built without initialising its weights (nothing is allocated
for them that is ever touched); ``safe_open`` validates every shard and lists its tensors, and
every name and shape is checked against the config (``weights.plan_import``) before any weight
is read, so a broken checkpoint fails before memory is spent on it. Then each HF tensor arrives
on the target device in the target dtype, still in HF's memory layout, and our weights are
views of it (``W_in`` is ``up_proj.weight.T``, W_Q a reshaped view of ``q_proj``): no
transposing copy. On the CPU in the file's dtype the tensors are the file's mapped pages (read
on first use, as transformers does); otherwise each is mapped, converted once into its target,
and unmapped (``ShardedSafetensors.tensor``), a few at a time in threads (``prefetched``). The
peak is the model's bytes plus a few tensors: no transformers model is built and no second
copy of the weights exists.

HF's layout is also the fast one: a bf16 ``x @ W`` with W [in, out] contiguous (ours, as
built) runs about 7x slower on a CPU than with W a transposed view of [out, in] (oneDNN's
bf16 kernels want the latter; measured on this project's 2-core machine).

Export writes the safetensors format directly: the header (names, shapes, offsets) is known
from the config before any tensor is built, so each tensor is built, written and dropped in
turn. Shards of at most ``max_shard_size`` bytes, with ``model.safetensors.index.json`` when
there is more than one, as ``save_pretrained`` lays them out.

``check_placement`` validates a (device, dtype) pair once, with one error naming what the
device lacks; ``load_checkpoint`` and ``from_hf`` both call it.
"""

from __future__ import annotations

import json
import re
import struct
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional, Union

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor, nn

from workbench.config import ModelConfig
from workbench.interop.hub import HFImportError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PICKLE_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "tf_model.h5", "flax_model.msgpack")
DEFAULT_MAX_SHARD_SIZE = "5GB"  # what most hub repositories use; the write's memory does not depend on it

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}
_CODES = {v: k for k, v in _DTYPES.items()}
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


# ---- device and dtype -------------------------------------------------------------------------
def check_placement(device: Union[str, torch.device, None], dtype: Union[str, torch.dtype, None],
                    error: type = ValueError) -> tuple[torch.device, torch.dtype]:
    """(device, dtype) parsed and checked: the device exists and computes in the dtype.

    ``dtype`` is a torch floating dtype or its name ("bfloat16"); ``device`` a torch device or
    its name (None: torch's default device, cpu unless ``torch.set_default_device`` changed it).
    Raises ``error`` naming the argument and what the machine offers.
    """
    choices = ", ".join(str(d).removeprefix("torch.") for d in FLOAT_DTYPES)
    given = dtype
    if dtype is None:
        dtype = torch.float32
    elif isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."), given)
    if not isinstance(dtype, torch.dtype) or dtype not in FLOAT_DTYPES:
        raise error(f"dtype={given!r} is not supported; choose one of {choices}")
    try:
        device = torch.get_default_device() if device is None else torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        raise error(f"device={device!r} is not a torch device ({e}); use 'cpu', 'cuda', 'cuda:1', 'mps'") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise error(f"device={str(device)!r} but this machine has no CUDA GPU (torch.cuda.is_available() is "
                        f"False; torch {torch.__version__}); use device='cpu'")
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise error(f"device={str(device)!r} but this machine has {torch.cuda.device_count()} CUDA device(s)")
        if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported(including_emulation=False):
            name, (major, minor) = torch.cuda.get_device_name(index), torch.cuda.get_device_capability(index)
            raise error(f"dtype=torch.bfloat16 is not supported natively on {name} (cuda:{index}, compute capability "
                        f"{major}.{minor}; bfloat16 needs 8.0 or newer); use dtype=torch.float16 or torch.float32")
    elif device.type == "mps" and dtype == torch.float64:
        raise error("dtype=torch.float64 is not supported on device='mps'; use torch.float32")
    try:  # the device may still lack kernels for the dtype (an old MPS without bfloat16)
        probe = torch.ones(2, 2, dtype=dtype, device=device)
        (probe @ probe).sum().item()
    except (RuntimeError, TypeError, NotImplementedError) as e:
        raise error(f"dtype={dtype} does not compute on device={str(device)!r} ({e}); choose another dtype "
                    f"({choices})") from None
    return device, dtype


# ---- reading ------------------------------------------------------------------------------------
class ShardedSafetensors:
    """The safetensors weights of a directory as a ``weights.TensorSource``.

    ``model.safetensors``, or the shards ``model.safetensors.index.json`` names. Every shard's
    header is read here (a truncated or corrupt file fails now, naming it); tensors are read
    only by ``tensor``. A directory with only pickled weights (``pytorch_model.bin``) is refused.
    """

    def __init__(self, directory: Union[str, Path], error: type = HFImportError):
        self.directory, self.error = Path(directory), error
        self._handles: dict[Path, Any] = {}
        self._lock = threading.Lock()
        self._file: dict[str, Path] = {}
        self._shape: dict[str, tuple[int, ...]] = {}
        self._dtype: dict[str, str] = {}
        index = self.directory / INDEX_FILE
        if index.is_file():
            self.files = self._shards_of(index)
        elif (self.directory / SINGLE_FILE).is_file():
            self.files = {self.directory / SINGLE_FILE: None}
        else:
            raise error(self._no_weights_message())
        for path, expected in self.files.items():
            self._read_header(path, expected)

    def _no_weights_message(self) -> str:
        pickles = [f for f in PICKLE_FILES if (self.directory / f).exists()]
        if pickles:
            return (f"{self.directory} holds {pickles[0]} and no safetensors weights; the workbench never unpickles "
                    "weights (a pickle can run code). Convert it to safetensors first (transformers: load it and "
                    "save_pretrained; hub repositories often have a safetensors revision: pass revision='refs/pr/N')")
        others = sorted(p.name for p in self.directory.glob("*.safetensors"))
        found = f" (it has {', '.join(others[:3])}, not in the transformers layout)" if others else ""
        return f"{self.directory} has neither {SINGLE_FILE} nor {INDEX_FILE}{found}; it is not a complete model directory"

    def _shards_of(self, index: Path) -> dict[Path, set[str]]:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise TypeError("weight_map is not an object of file names")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise self.error(f"{index} is not a valid safetensors index ({type(e).__name__}: {e})") from None
        shards: dict[Path, set[str]] = {}
        for tensor, file in weight_map.items():
            if Path(file).name != file:
                raise self.error(f"{index} names shard {file!r}, which is not a file name inside {self.directory}")
            shards.setdefault(self.directory / file, set()).add(tensor)
        for path, tensors in shards.items():
            if not path.is_file():
                raise self.error(f"{index} names shard {path.name} (holding {sorted(tensors)[0]} and "
                                 f"{len(tensors) - 1} more tensors) but {path} is missing; the download is incomplete")
        return shards

    def _read_header(self, path: Path, expected: Optional[set[str]]) -> None:
        try:  # the library validates the file: header, offsets, and that the data covers it exactly
            with safe_open(str(path), framework="pt") as f:
                names = set(f.keys())
                for name in names:
                    piece = f.get_slice(name)
                    self._file[name], self._shape[name], self._dtype[name] = path, tuple(piece.get_shape()), piece.get_dtype()
        except (SafetensorError, OSError) as e:
            raise self.error(f"{path} is truncated or corrupt ({e}); write or download it again") from None
        if expected is not None and expected - names:
            raise self.error(f"{INDEX_FILE} says {path.name} holds {sorted(expected - names)[0]}, but that shard does "
                             "not; the index and the shards come from different saves")

    def names(self) -> Iterable[str]:
        return self._file.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shape[name]

    def dtype(self, name: str) -> torch.dtype:
        code = self._dtype[name]
        if code not in _DTYPES:
            raise self.error(f"{self.where(name)} has the safetensors dtype {code}, which torch cannot hold")
        return _DTYPES[code]

    def where(self, name: str) -> str:
        return f"{name} in {self._file[name].name}"

    def tensor(self, name: str, device: torch.device, dtype: torch.dtype) -> Tensor:
        """``name`` on ``device`` in ``dtype``, laid out as in the file; the caller owns it.

        On the CPU in the file's own dtype nothing is read: the tensor is the file's pages,
        mapped copy-on-write by ``safe_open``, read from the page cache on first use and shared
        with it, as transformers does. Otherwise the tensor is mapped by a ``safe_open`` of its
        own and converted; closing that handle and dropping the source unmaps its pages, where
        one long-lived handle per shard would keep every page it touched resident (a 5 GB shard
        adds 5 GB). Measured on a 100M model, bf16 file to fp32: peak 1.01x the model this way,
        1.05x reading into one reused buffer, and 1.1x-1.5x from run to run when each tensor was
        also copied into a transposed layout (a second allocation per tensor: the allocator's holes).
        """
        if device.type == "cpu" and dtype == self.dtype(name):
            return self._mapped(name, keep=True)
        return self._mapped(name, keep=False).to(device=device, dtype=dtype)

    def _mapped(self, name: str, keep: bool) -> Tensor:
        path = self._file[name]
        try:
            if keep:
                with self._lock:  # prefetch threads share the handles
                    if path not in self._handles:
                        self._handles[path] = safe_open(str(path), framework="pt")
                    handle = self._handles[path]
                return handle.get_tensor(name)
            with safe_open(str(path), framework="pt") as f:
                return f.get_tensor(name)
        except (SafetensorError, OSError) as e:  # changed on disk since the header was read
            raise self.error(f"reading {self.where(name)} failed ({e}); the file changed or is damaged") from None

    def close(self) -> None:
        """Drop the reader's file handles (mapped tensors handed out stay valid)."""
        self._handles.clear()

    def __enter__(self) -> "ShardedSafetensors":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


PREFETCH_WORKERS = 4  # tensors read and converted ahead of the one being placed (torch and safetensors release the GIL)


def prefetched(load: Callable[[str], Tensor], names: list[str], workers: int = PREFETCH_WORKERS) -> Iterator[Tensor]:
    """``load(name)`` for each of ``names``, in order, up to ``workers`` running ahead in threads.

    At most ``workers + 1`` loaded tensors exist at once beyond those the caller keeps. On the
    two-core machine here four workers took a 350M-parameter bf16-to-fp32 import from about 4 s
    to about 1.4 s (transformers: 1.9 s).
    """
    if workers <= 1 or len(names) <= 1:
        yield from map(load, names)
        return
    with ThreadPoolExecutor(workers) as pool:
        pending = deque(pool.submit(load, name) for name in names[:workers])
        for k in range(len(names)):
            try:
                tensor = pending.popleft().result()
            except BaseException:
                for future in pending:
                    future.cancel()
                raise
            if k + workers < len(names):
                pending.append(pool.submit(load, names[k + workers]))
            yield tensor
            del tensor


# ---- building the model -------------------------------------------------------------------------
def unfilled_model(cfg: ModelConfig, shaped=None):
    """A HookedDecoder of ``cfg`` on the CPU whose weights are allocated but never initialised.

    ``torch.empty`` reserves address space and the pages are only touched when written, so
    this costs (almost) no memory; every buffer (RoPE frequencies, fixed zero biases) is real.

    ``shaped``: the model of ``cfg`` already built on the meta device (the one a checkpoint load
    checked the file's shapes and the free memory against), made this model instead of building a
    second one (``_materialized``): its parameters stay on the meta device, each to be replaced by
    ``fill_model``, and its buffers are computed on the CPU. Building SmolLM2's 30 layers costs
    40-60 ms; every load built them twice.
    """
    from workbench.model import HookedDecoder

    if shaped is not None:
        model = _materialized(shaped)
        if model is not None:
            return model

    class _Unfilled(HookedDecoder):
        def init_weights(self, seed: Optional[int] = None) -> None:
            pass  # the weights are about to be replaced: do not spend time writing random ones

    with torch.device("cpu"):  # never the default device: on a GPU, empty is a real allocation
        model = _Unfilled(cfg)
    model.__class__ = HookedDecoder
    return model


def _materialized(model):
    """``model`` (built on the meta device) with real buffers on the CPU, its parameters left on the
    meta device; None, with ``model`` untouched, when it holds a buffer not known here.

    Known: the fixed zero biases (``components.registry.add_bias``: zeros) and RoPE's frequencies
    (``rope_inv_freq`` of the rotary's own config, as its constructor and its ``_apply`` compute
    them). Any other (a sinusoidal table, ALiBi slopes, a folded norm's ones) or a tensor held as a
    plain attribute: the caller builds the model anew, so a buffer added later is never left empty.
    """
    from workbench.components.positional import Rotary, rope_inv_freq

    made = []
    for module in model.modules():
        if any(isinstance(v, Tensor) for v in vars(module).values()):
            return None
        zeros = getattr(module, "_fixed_zero_biases", frozenset())
        for name, buffer in module._buffers.items():
            if buffer is None:
                continue
            if name in zeros:
                made.append((module, name, lambda b=buffer: torch.zeros(b.shape, dtype=b.dtype)))
            elif type(module) is Rotary and name == "inv_freq":
                made.append((module, name, lambda m=module: rope_inv_freq(m.cfg)[0]))
            else:
                return None
    with torch.device("cpu"):  # never the default device, nor the meta device rope_inv_freq looks for
        for module, name, value in made:
            module._buffers[name] = value()
    return model


def model_shapes(model) -> tuple[dict[str, Tensor], set[str]]:
    """Every parameter and bias buffer of ``model`` as meta tensors, and the persistent names."""
    ours = {k: v.to("meta") for k, v in {**dict(model.named_buffers()), **dict(model.named_parameters())}.items()}
    return ours, set(model.state_dict())


def float32_weights(model) -> frozenset[str]:
    """Names of the weights ``model`` keeps in float32 whatever its dtype (a module's
    ``float32_weights``: DeepSeek's router), which the loaders read as float32."""
    return frozenset(f"{prefix}.{leaf}" if prefix else leaf
                     for prefix, module in model.named_modules() for leaf in getattr(module, "float32_weights", ()))


def fill_model(model, tensors: Iterator[tuple[str, Tensor]], zero_biases: Iterable[str],
               device: torch.device, dtype: torch.dtype):
    """Make ``tensors`` (already on ``device`` in ``dtype``) the parameters of ``model`` without
    copying them (``load_state_dict(assign=True)``'s effect, without its per-module walk), make the
    named biases zeros, and move the buffers; returns the model in eval mode."""
    params = dict(model.named_parameters())
    placed = set()
    for name, tensor in tensors:
        old = params[name]  # a KeyError here is an internal error: the plan checked every name
        if tuple(tensor.shape) != tuple(old.shape):
            raise RuntimeError(f"internal error: {name} arrived as {list(tensor.shape)}, the model holds {list(old.shape)}")
        module, _, leaf = name.rpartition(".")
        model.get_submodule(module)._parameters[leaf] = nn.Parameter(tensor, requires_grad=old.requires_grad)
        placed.add(name)
    for name in zero_biases:
        module, _, leaf = name.rpartition(".")
        model.get_submodule(module)._parameters[leaf] = nn.Parameter(
            torch.zeros(params[name].shape, device=device, dtype=dtype), requires_grad=params[name].requires_grad)
        placed.add(name)
    missing = sorted(set(params) - placed)
    if missing:
        raise RuntimeError(f"internal error: nothing was loaded into {missing[:3]}")
    model.to(device=device, dtype=dtype)  # the buffers; the weights are there already
    return model.eval()


def load_hf_weights(directory: Union[str, Path], family: str, cfg: ModelConfig, device: torch.device,
                    dtype: torch.dtype):
    """A HookedDecoder of ``cfg`` holding the weights of the HF checkpoint in ``directory``."""
    from workbench.interop.weights import import_tensors, plan_import

    with ShardedSafetensors(directory) as source:
        model = unfilled_model(cfg)
        ours, persistent = model_shapes(model)
        plan = plan_import(family, cfg, source, ours, persistent, layout="file")
        tensors = import_tensors(plan, source, persistent, device, dtype, float32_weights(model))
        return fill_model(model, tensors, plan.zero_biases, device, dtype)


# ---- writing ------------------------------------------------------------------------------------
def parse_size(size: Union[int, str]) -> int:
    """Bytes from 5_000_000_000, "5GB" (10^9) or "5GiB" (2^30), as ``save_pretrained`` reads them."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(I?)B\s*", str(size).upper())
        if not match:
            raise ValueError(f"max_shard_size={size!r} must be a number of bytes or a size like '5GB' or '500MiB'")
        base = 1024 if match[3] else 1000
        value = int(float(match[1]) * base ** " KMGT".index(match[2] or " "))
    if value < 1:
        raise ValueError(f"max_shard_size={size!r} must be at least 1 byte")
    return value


def write_sharded(directory: Path, entries: list, dtype: Optional[torch.dtype], max_shard_size: Union[int, str],
                  metadata: Optional[dict] = None) -> list[str]:
    """Write ``entries`` (``weights.ExportEntry``) as safetensors shards in ``directory``; returns the file names.

    Each tensor is built, cast to ``dtype`` (None: as built) on the CPU, written and dropped, so
    the write holds one tensor at a time. One file is ``model.safetensors``; several are
    ``model-0000i-of-0000n.safetensors`` plus the index.
    """
    limit = parse_size(max_shard_size)
    sized = []
    for entry in entries:
        entry_dtype = dtype or entry.dtype
        nbytes = _numel(entry.shape) * entry_dtype.itemsize
        sized.append((entry, entry_dtype, nbytes))
    shards: list[list] = [[]]
    size = 0
    for item in sized:
        if shards[-1] and size + item[2] > limit:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += item[2]
    names = ([SINGLE_FILE] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    for name, shard in zip(names, shards):
        _write_safetensors(directory / name, shard, metadata or {"format": "pt"})
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(n for _, _, n in sized)},
                 "weight_map": {entry.name: name for name, shard in zip(names, shards) for entry, _, _ in shard}}
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        names.append(INDEX_FILE)
    return names


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


def _write_safetensors(path: Path, shard: list, metadata: dict) -> None:
    """The safetensors format: u64 header length, JSON header (padded to 8 bytes), raw little-endian data."""
    header: dict[str, Any] = {"__metadata__": {k: str(v) for k, v in metadata.items()}}
    offset = 0
    for entry, dtype, nbytes in shard:
        header[entry.name] = {"dtype": _CODES[dtype], "shape": list(entry.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for entry, dtype, _nbytes in shard:
            tensor = entry.build().detach().to(device="cpu", dtype=dtype).contiguous()
            if tuple(tensor.shape) != entry.shape:
                raise RuntimeError(f"internal error: {entry.name} was built as {list(tensor.shape)}, planned {list(entry.shape)}")
            f.write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
            del tensor
    with safe_open(str(path), framework="pt") as f:  # the library's own check of what we wrote
        if set(f.keys()) != {entry.name for entry, _, _ in shard}:
            raise RuntimeError(f"internal error: {path} does not list the tensors written to it")


__all__ = ["check_placement", "ShardedSafetensors", "load_hf_weights", "unfilled_model", "fill_model",
           "write_sharded", "parse_size"]
