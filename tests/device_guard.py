"""A guard that finds, on a CPU, the tensors a CUDA run would find on the wrong device.

Inside ``HostTensorGuard()`` a tensor made by a factory (``torch.zeros``, ``arange``, ``tensor``,
``randn``...) without ``device=`` is tagged *host*: on a GPU it would be made on the CPU while the
model's data is on the GPU. What is computed from host tensors only is host too; ``.to(device)``,
``*_like`` of data and ``new_*`` of data are not. Every op that meets a host tensor and data raises,
except where CUDA itself accepts a CPU tensor: a 0-dim one (a scalar), the indices of an indexing
of data, either side of ``copy_`` and of an assignment to a slice (a copy). Numpy reading the data's
tensor (``.numpy()``, ``np.asarray``) without ``.cpu()`` first raises too. Tensors made before the guard (the model, the prompts) are data.

The first CUDA run crashed in the attribution graph on ``torch.searchsorted`` with a CPU-built
tensor, then on an index of a CPU tensor by CUDA indices. Running each analysis under
``torch.device("meta")`` does not find those: a meta index into a CPU tensor and searchsorted of a
meta tensor both pass silently. This guard does. (A module with this name, not a conftest fixture,
so a test file can also use it under ``--device cuda``, where it is a cheap no-op check.)
"""

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

# Factories whose result lands on the default device (the CPU) unless given device=.
FACTORIES = {getattr(torch, n) for n in (
    "tensor", "as_tensor", "asarray", "zeros", "ones", "empty", "full", "arange", "range", "linspace", "logspace",
    "eye", "rand", "randn", "randint", "randperm", "tril_indices", "triu_indices", "empty_strided",
    "scalar_tensor", "from_numpy", "frombuffer", "normal", "bernoulli",
)}
TO_HOST = {torch.Tensor.cpu}
TO_NUMPY = {torch.Tensor.numpy, torch.Tensor.__array__}
MOVES = {torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.type_as}
_DEVICE = torch.Tensor.device  # its __get__, seen by the mode on each `.device`
SHAPE_OF_OTHER = {torch.Tensor.view_as, torch.Tensor.reshape_as, torch.Tensor.expand_as}  # reads only a shape
INDEXING = {torch.Tensor.__getitem__, torch.index_select, torch.Tensor.index_select}


class DeviceMismatch(AssertionError):
    pass


def _tensors(obj) -> list:
    return [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]


class HostTensorGuard(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.host: dict[int, torch.Tensor] = {}  # kept alive, so an id is never reused while we run
        self.host_devices: dict[int, torch.device] = {}  # ``.device`` of a host tensor, a CPU on a GPU run

    def _host_device(self, device) -> bool:
        return device is None or self.host_devices.get(id(device)) is device

    def __enter__(self):
        # torch.from_numpy never reaches a TorchFunctionMode: wrap it for the guard's lifetime
        self._from_numpy = torch.from_numpy
        torch.from_numpy = lambda array: self._tagged(self._from_numpy(array))
        return super().__enter__()

    def __exit__(self, *exc):
        torch.from_numpy = self._from_numpy
        return super().__exit__(*exc)

    def _tagged(self, t: torch.Tensor) -> torch.Tensor:
        self._tag(t, True)
        return t

    def _is_host(self, t: torch.Tensor) -> bool:
        return self.host.get(id(t)) is t

    def _tag(self, out, host: bool) -> None:
        for t in _tensors(out):
            if host:
                self.host[id(t)] = t
            else:
                self.host.pop(id(t), None)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if getattr(func, "__self__", None) is _DEVICE:
            if args and self._is_host(args[0]):
                out = torch.device(out.type, out.index)  # its own object, so a use of it can be told apart
                self.host_devices[id(out)] = out
            return out
        if func in FACTORIES:
            data = args[0] if args else kwargs.get("data")
            from_data = func in (torch.as_tensor, torch.asarray) and isinstance(data, torch.Tensor)
            if from_data and kwargs.get("device") is None:
                self._tag(out, self._is_host(data))
            else:
                self._tag(out, self._host_device(kwargs.get("device")))
            return out
        if func in TO_NUMPY and args and not self._is_host(args[0]):
            raise DeviceMismatch(f"{getattr(func, '__qualname__', func)} of the data's tensor (shape "
                                 f"{tuple(args[0].shape)}): on a GPU numpy cannot read it; call .cpu() first")
        if func in TO_HOST:
            self._tag(out, True)
            return out
        inputs = _tensors((args, kwargs))
        if func in MOVES:
            target = [a for a in (*args[1:], kwargs.get("device"), kwargs.get("other"))
                      if isinstance(a, (torch.device, str, torch.Tensor))]
            if target:  # a move to a device (or a tensor's): data unless to "cpu" or a host tensor('s device)
                self._tag(out, any(self._is_host(a) if isinstance(a, torch.Tensor)
                                   else a.startswith("cpu") if isinstance(a, str)
                                   else self._host_device(a) for a in target))
            elif inputs:
                self._tag(out, self._is_host(inputs[0]))
            return out
        if func.__name__.endswith("_like") or func.__name__.startswith("new_"):
            self._tag(out, self._host_device(kwargs["device"]) if kwargs.get("device") is not None
                      else bool(inputs) and self._is_host(inputs[0]))
            return out
        host = [t for t in inputs if self._is_host(t)]
        if not host:
            return out
        data = [t for t in inputs if not self._is_host(t)]
        if not data:
            self._tag(out, True)
            return out
        if func in SHAPE_OF_OTHER:
            self._tag(out, self._is_host(args[0]))
            return out
        if func is torch.Tensor.copy_:
            return out  # CUDA copies across devices
        if func is torch.Tensor.__setitem__:
            index, value = args[1], args[2]
            if not _tensors(index):
                return out  # an assignment to a slice is a copy
            value_ok = not isinstance(value, torch.Tensor) or value.ndim == 0 or self._is_host(value) == self._is_host(args[0])
            index_ok = self._is_host(args[0]) == all(self._is_host(t) for t in _tensors(index)) or not self._is_host(args[0])
            if value_ok and index_ok:
                return out
        elif func in INDEXING:
            if not self._is_host(inputs[0]):
                return out  # data indexed by host indices: CUDA accepts CPU indices
        elif all(t.ndim == 0 for t in host):
            self._tag(out, False)  # CUDA takes a 0-dim CPU tensor as a scalar
            return out
        raise DeviceMismatch(
            f"{getattr(func, '__qualname__', func)} meets a tensor made without device= "
            f"(shape {tuple(host[0].shape)}) and the data's (shape {tuple(data[0].shape)}): on a GPU the "
            "first is on the CPU and the second is not")
