"""The peak of the bytes held by live tensors on one device type, whatever holds them: the
engine, autograd's saved tensors, an optimizer, a communication buffer, another library.

While `LiveStoragePeak` is active, every storage that a tensor seen by Python's garbage
collector views on entry, and every storage an operation makes or hands back (TorchDispatchMode
sees each operation, backward included), counts its bytes once (views share a storage) until it
is freed (a finalizer on the storage) or resized. The same count for any code, so two engines
can be set side by side (tools/bench_vs_megatron.py); on a GPU the allocator's own peak
(torch.cuda.max_memory_allocated) is the measure instead. Every operation pays a Python call,
so time steps without it.
"""

from __future__ import annotations

import gc
import warnings
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveStoragePeak(TorchDispatchMode):
    """`peak` and `current`: bytes of live `device_type` storages (see the module docstring).
    With `by_origin`, `at_peak` holds the bytes live at the peak by the operation that made
    their storage ("before" for those alive on entry): where the memory goes."""

    def __init__(self, device_type: str = "cpu", by_origin: bool = False):
        super().__init__()
        self.device_type = device_type
        self.by_origin = by_origin
        self._bytes: dict[int, int] = {}  # id of a storage -> its bytes when last seen
        self._origin: dict[int, str] = {}
        self._by_origin: dict[str, int] = {}  # live bytes per origin, kept as they change
        self._finalizers: list[weakref.finalize] = []
        self.current = 0
        self.peak = 0
        self.at_peak: dict[str, int] = {}

    def _see(self, storage, origin: str) -> None:
        key, size = id(storage), storage.nbytes()
        known = self._bytes.get(key)
        if known is None:
            self._finalizers.append(weakref.finalize(storage, self._freed, key))
            self._origin[key] = origin
        elif known == size:
            return
        self._bytes[key] = size
        self._add(self._origin[key], size - (known or 0))
        if self.current > self.peak:
            self.peak = self.current
            if self.by_origin:
                self.at_peak = {k: v for k, v in self._by_origin.items() if v}

    def _add(self, origin: str, change: int) -> None:
        self.current += change
        if self.by_origin:
            self._by_origin[origin] = self._by_origin.get(origin, 0) + change

    def _freed(self, key: int) -> None:
        size = self._bytes.pop(key, 0)
        self._add(self._origin.pop(key, ""), -size)

    def _see_tensor(self, value, origin: str) -> None:
        if isinstance(value, torch.Tensor) and value.device.type == self.device_type:
            try:
                self._see(value.untyped_storage(), origin)
            except (RuntimeError, NotImplementedError):  # tensors without a storage
                pass

    def __enter__(self):
        gc.collect()  # what is already garbage is not counted as live
        with warnings.catch_warnings():  # isinstance() on deprecated module proxies warns
            warnings.simplefilter("ignore")
            for obj in gc.get_objects():
                try:
                    self._see_tensor(obj, "before")
                except Exception:  # noqa: BLE001 - a dead proxy, an object whose class raises
                    continue
        return super().__enter__()

    def __exit__(self, *exc):
        for finalizer in self._finalizers:  # the counts stay as they were at the end
            finalizer.detach()
        self._finalizers.clear()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        origin = str(func.overloadpacket)
        for value in tree_leaves(out):
            self._see_tensor(value, origin)
        for value in tree_leaves(args):  # in-place resizes of an argument's storage
            self._see_tensor(value, origin)
        return out
