"""Device memory whose address outlives its pages: the KV cache across `sleep` and `wake`.

A hybrid engine gives its KV cache back while the trainer runs and takes it again for
the next rollout. Memory from torch's allocator comes back at a new address, and the
CUDA graphs captured over the old one (`graphs`, `prefill_graphs`) must then be
captured again at every rollout: tens of milliseconds a graph. CUDA's virtual memory
management splits an allocation into an address range and the physical pages mapped
onto it, so `VirtualBuffer` keeps the range for the engine's life and maps pages onto
it only while the engine is awake: `release` gives the pages back to the device (the
trainer can use them), `map` takes new ones at the same address, and the graphs stay
valid. The calls go to the driver (``libcuda``) through ctypes, on the device torch
made current; where they are missing or fail, `VirtualBuffer.create` returns None and
the engine allocates through torch as before.

The tensor over the range is made through ``__cuda_array_interface__`` (no copy, no
ownership): it is only handed out while pages are mapped.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch
from torch import Tensor

__all__ = ["VirtualBuffer"]

log = logging.getLogger(__name__)

_PINNED = 1  # CU_MEM_ALLOCATION_TYPE_PINNED
_ON_DEVICE = 1  # CU_MEM_LOCATION_TYPE_DEVICE
_READ_WRITE = 3  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE
_OUT_OF_MEMORY = 2  # CUDA_ERROR_OUT_OF_MEMORY


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _AllocationProp(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _AllocFlags),
    ]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class DriverError(RuntimeError):
    """A CUDA driver call failed (``code``: its CUresult)."""

    def __init__(self, call: str, code: int) -> None:
        super().__init__(f"{call} failed with CUDA driver error {code}")
        self.code = code


@functools.cache
def _driver() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    needed = (
        "cuMemAddressReserve",
        "cuMemAddressFree",
        "cuMemCreate",
        "cuMemRelease",
        "cuMemMap",
        "cuMemUnmap",
        "cuMemSetAccess",
        "cuMemGetAllocationGranularity",
    )
    return lib if all(hasattr(lib, name) for name in needed) else None


def _check(call: str, code: int) -> None:
    if code != 0:
        raise DriverError(call, code)


class _Span:
    """The ``__cuda_array_interface__`` of bytes at a device address (for torch.as_tensor)."""

    def __init__(self, address: int, size: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (size,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 2,
        }


class VirtualBuffer:
    """``size`` bytes at a fixed device address, with pages mapped onto it or not."""

    def __init__(self, lib: ctypes.CDLL, device: int, size: int, granularity: int) -> None:
        self.lib, self.device = lib, device
        self.size = -(-size // granularity) * granularity
        address = ctypes.c_ulonglong(0)
        _check(
            "cuMemAddressReserve",
            lib.cuMemAddressReserve(
                ctypes.byref(address),
                ctypes.c_size_t(self.size),
                ctypes.c_size_t(granularity),
                ctypes.c_ulonglong(0),
                ctypes.c_ulonglong(0),
            ),
        )
        self.address = address.value
        self.handle: int | None = None

    @classmethod
    def create(cls, size: int, device: torch.device) -> VirtualBuffer | None:
        """A buffer of at least ``size`` bytes on CUDA ``device`` with its pages mapped,
        or None where the driver cannot (the caller allocates through torch)."""
        lib = _driver()
        if lib is None or device.type != "cuda":
            return None
        index = device.index if device.index is not None else torch.cuda.current_device()
        try:
            torch.cuda.init()
            granularity = ctypes.c_size_t(0)
            prop = _prop(index)
            _check(
                "cuMemGetAllocationGranularity",
                lib.cuMemGetAllocationGranularity(ctypes.byref(granularity), ctypes.byref(prop), 0),
            )
            buffer = cls(lib, index, size, granularity.value)
            buffer.map()
            buffer.tensor((1,), torch.uint8).zero_()  # torch can use the memory
        except (DriverError, RuntimeError, TypeError, ValueError) as err:
            log.warning("native engine: KV cache without a fixed address (%s)", err)
            return None
        return buffer

    @property
    def mapped(self) -> bool:
        return self.handle is not None

    def map(self) -> None:
        """Map new pages onto the range (freeing torch's cached blocks once if the device
        has too few free)."""
        if self.handle is not None:
            return
        handle = ctypes.c_ulonglong(0)
        prop = _prop(self.device)
        code = self.lib.cuMemCreate(
            ctypes.byref(handle),
            ctypes.c_size_t(self.size),
            ctypes.byref(prop),
            ctypes.c_ulonglong(0),
        )
        if code == _OUT_OF_MEMORY:
            torch.cuda.empty_cache()
            code = self.lib.cuMemCreate(
                ctypes.byref(handle),
                ctypes.c_size_t(self.size),
                ctypes.byref(prop),
                ctypes.c_ulonglong(0),
            )
        if code == _OUT_OF_MEMORY:
            raise torch.OutOfMemoryError(
                f"native rollout engine: no room to take back its KV cache "
                f"({self.size / 2**30:.2f} GiB) on cuda:{self.device}: "
                f"{torch.cuda.mem_get_info(self.device)[0] / 2**30:.2f} GiB free. Lower "
                "actor_rollout_ref.rollout.gpu_memory_utilization, or free memory "
                "(offload the trainer's parameters or optimizer)."
            )
        _check("cuMemCreate", code)
        try:
            _check(
                "cuMemMap",
                self.lib.cuMemMap(
                    ctypes.c_ulonglong(self.address),
                    ctypes.c_size_t(self.size),
                    ctypes.c_size_t(0),
                    handle,
                    ctypes.c_ulonglong(0),
                ),
            )
            access = _AccessDesc(_Location(_ON_DEVICE, self.device), _READ_WRITE)
            _check(
                "cuMemSetAccess",
                self.lib.cuMemSetAccess(
                    ctypes.c_ulonglong(self.address),
                    ctypes.c_size_t(self.size),
                    ctypes.byref(access),
                    ctypes.c_size_t(1),
                ),
            )
        except DriverError:
            self.lib.cuMemUnmap(ctypes.c_ulonglong(self.address), ctypes.c_size_t(self.size))
            self.lib.cuMemRelease(handle)
            raise
        self.handle = handle.value

    def release(self) -> None:
        """Give the pages back to the device (after the work queued on them); the
        address range stays."""
        if self.handle is None:
            return
        torch.cuda.synchronize(self.device)
        _check(
            "cuMemUnmap",
            self.lib.cuMemUnmap(ctypes.c_ulonglong(self.address), ctypes.c_size_t(self.size)),
        )
        _check("cuMemRelease", self.lib.cuMemRelease(ctypes.c_ulonglong(self.handle)))
        self.handle = None

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        """A tensor over the start of the range (pages must be mapped while it is used)."""
        if self.handle is None:
            raise RuntimeError("native rollout engine: the KV cache's pages are not mapped")
        count = 1
        for n in shape:
            count *= n
        nbytes = count * torch.empty(0, dtype=dtype).element_size()
        raw = torch.as_tensor(_Span(self.address, nbytes), device=f"cuda:{self.device}")
        return raw.view(dtype).view(shape)

    def __del__(self) -> None:
        try:
            self.release()
            self.lib.cuMemAddressFree(ctypes.c_ulonglong(self.address), ctypes.c_size_t(self.size))
        except Exception:  # noqa: BLE001 - the process may be ending: nothing to do
            pass


def _prop(device: int) -> _AllocationProp:
    prop = _AllocationProp()
    prop.type = _PINNED
    prop.location = _Location(_ON_DEVICE, device)
    return prop
