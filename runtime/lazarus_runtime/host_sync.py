"""Host synchronisations: moving host data to the device without one, and counting them.

On a GPU the host waits for the device (a ``cudaStreamSynchronize`` or a blocking copy) when
it
- reads a value the device computed: ``.item()``, ``int()``/``float()``/``bool()`` of a tensor,
  ``.tolist()``, ``.numpy()``, ``.cpu()``, ``torch.equal``; a range check through
  ``aminmax`` is one of these;
- runs an op whose output size depends on the values: ``nonzero`` (and boolean-mask indexing,
  which calls it), ``masked_select``, ``unique``, ``bincount``, ``repeat_interleave``
  without ``output_size``;
- copies host memory to the device with a blocking copy: ``.to(device)`` without
  ``non_blocking=True``, ``torch.tensor(data, device=...)``.

``HostSyncCounter`` counts exactly these operations, and it counts them on the CPU too, so a
CPU test can hold the step to its bound. There is no device there, so the counter plays one:
every tensor an op computes while the counter is active (and every tensor given to
``on_device``) is a device tensor, and a tensor made from host data (``torch.from_numpy``, the
data loader's batches) is a host tensor until it is copied to the device. On CUDA the device
is the real one. What the counter cannot see is a synchronisation inside a kernel library
(a CUDA op that syncs internally): on a GPU, ``count_cuda_syncs`` asks CUDA's own sync
debug mode, which sees those too.
"""
from __future__ import annotations

import collections
import contextlib
import warnings
from collections.abc import Iterator

import numpy as np
import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

aten = torch.ops.aten


def to_device(host: torch.Tensor | np.ndarray, device: torch.device) -> torch.Tensor:
    """``host`` on ``device``, copied without making the host wait (pinned, non-blocking).

    The pinned staging copy comes from PyTorch's caching host allocator, which does not
    reuse it before the transfer has finished.
    """
    tensor = torch.from_numpy(host) if isinstance(host, np.ndarray) else host
    if device.type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


# Ops below autograd whose output size depends on values: the host must read them first.
_VALUE_SHAPED_OPS = {
    aten.nonzero.default, aten.masked_select.default, aten._unique2.default,
    aten.unique_dim.default, aten.unique_consecutive.default, aten.bincount.default,
}
# Ops that hand a device value to the host.
_SCALAR_READS = {aten._local_scalar_dense.default, aten.equal.default}
# Python-level reads: on the CPU they never reach the dispatcher.
_TENSOR_READS = {torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu}


class HostSyncCounter:
    """Counts the operations of a region that make the host wait for ``device``.

        counter = HostSyncCounter(device, on_device=model.parameters())
        with counter, counter.phase("forward"):
            loss = model(batch)
        with counter, counter.phase("backward"):
            loss.backward()
        counter.counts  # {"forward": 12, "backward": 0}

    ``events`` lists what was counted, phase by phase, for error messages.
    """

    def __init__(self, device: torch.device | str, on_device=()):
        self.device = torch.device(device)
        self.counts: collections.Counter[str] = collections.Counter()
        self.events: list[tuple[str, str]] = []
        self._phase = "step"
        self._device_tensors: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.on_device(*on_device)
        self._modes: list = []

    def on_device(self, *tensors: torch.Tensor) -> None:
        """Declare tensors that live on the device (parameters, buffers, optimizer state)."""
        for t in tensors:
            self._device_tensors[t] = True

    def is_device(self, t) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        if self.device.type != "cpu":
            return t.device.type == self.device.type
        return t in self._device_tensors

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        previous, self._phase = self._phase, name
        try:
            yield
        finally:
            self._phase = previous

    def total(self) -> int:
        return sum(self.counts.values())

    def _count(self, what: str) -> None:
        self.counts[self._phase] += 1
        self.events.append((self._phase, what))

    def __enter__(self) -> "HostSyncCounter":
        self._modes.append((_FunctionLevel(self), _DispatchLevel(self)))
        for mode in self._modes[-1]:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes.pop()):
            mode.__exit__(*exc)


def _tensors(args, kwargs) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]


def _mark(counter: HostSyncCounter, out, on_device: bool) -> None:
    for t in pytree.tree_leaves(out):
        if isinstance(t, torch.Tensor):
            if on_device:
                counter._device_tensors[t] = True
            else:
                counter._device_tensors.pop(t, None)


class _FunctionLevel(TorchFunctionMode):
    """Reads and host-to-device copies, seen where Python calls them."""

    def __init__(self, counter: HostSyncCounter):
        super().__init__()
        self.c = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        c = self.c
        emulated = c.device.type == "cpu"
        to_device = None  # for Tensor.to: the target device, and whether it blocks
        if func in _TENSOR_READS and c.is_device(args[0]):
            c._count(f"Tensor.{func.__name__}")
        elif func is torch.Tensor.to:
            device, _, non_blocking, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
            if device is not None and device.type == "cpu" and not emulated \
                    and c.is_device(args[0]):
                c._count("Tensor.to(cpu)")
            elif emulated and device == c.device and not c.is_device(args[0]):
                # Host data going to the device: on a GPU this copy blocks unless it is
                # non-blocking from pinned memory (to_device); here it is a no-op, so the
                # counter decides from the arguments.
                to_device = device
                if not non_blocking:
                    c._count("Tensor.to(device) of host data, blocking")
        elif func in (torch.tensor, torch.as_tensor) and kwargs.get("device") is not None \
                and (torch.device(kwargs["device"]) == c.device or not emulated):
            c._count(f"torch.{func.__name__}(..., device=)")
        out = func(*args, **kwargs)
        if not emulated:
            return out
        if func is torch.Tensor.cpu:
            _mark(c, out, on_device=False)  # what came back to the host is free to read
        elif to_device is not None:
            _mark(c, out, on_device=True)
        elif kwargs.get("device") is not None and not _tensors(args, kwargs):
            # A factory (zeros, arange, tensor(data)...) told to make its result on the device.
            _mark(c, out, on_device=torch.device(kwargs["device"]) == c.device)
        return out


# Below autograd, where the host's data becomes a tensor: its result is a host tensor.
_FROM_HOST = {aten.lift_fresh.default, aten.lift_fresh_copy.default}


class _DispatchLevel(TorchDispatchMode):
    """Scalar reads and value-shaped ops, seen below autograd (so in the backward too), and
    the record of which tensors the device computed: those of ops with a device input."""

    def __init__(self, counter: HostSyncCounter):
        super().__init__()
        self.c = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        c = self.c
        if func in _SCALAR_READS and any(c.is_device(a) for a in args):
            c._count(str(func.overloadpacket.__name__))
        elif func in _VALUE_SHAPED_OPS or (
                func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None):
            c._count(str(func.overloadpacket.__name__))
        elif c.device.type != "cpu" and func in (aten._to_copy.default, aten.copy_.default):
            if func is aten.copy_.default:
                source, target = args[1], args[0].device
                non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
            else:
                source, target = args[0], kwargs.get("device")
                non_blocking = kwargs.get("non_blocking", False)
            if source.device.type == "cpu" and target is not None and target.type != "cpu" \
                    and not non_blocking:
                c._count("host-to-device copy, blocking")
        out = func(*args, **kwargs)
        if c.device.type == "cpu" and func not in _FROM_HOST:
            inputs = _tensors(args, kwargs)
            if inputs and any(c.is_device(t) for t in inputs):
                _mark(c, out, on_device=True)
                _mark(c, _written(func, args, kwargs), on_device=True)
        return out


def _written(func, args, kwargs) -> list:
    """The arguments an op writes in place (``add_``'s self, ``mm``'s out=): once the
    device has written them, they are device tensors."""
    written = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            written.append(args[i] if i < len(args) else kwargs.get(arg.name))
    return written


@contextlib.contextmanager
def count_cuda_syncs() -> Iterator[list]:
    """CUDA's own count of synchronising calls in the region (``torch.cuda`` sync debug
    mode): the list it yields holds one warning message per synchronisation, once the
    region has ended."""
    found: list[str] = []
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    found.extend(str(w.message) for w in caught if "synchroniz" in str(w.message).lower())
