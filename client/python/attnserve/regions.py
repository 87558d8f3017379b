"""Shared-memory regions (docs/transport.md): tensors a request names instead
of carrying their bytes.

    from attnserve.regions import SharedMemoryRegion
    region = SharedMemoryRegion(64 << 20)                 # a POSIX shm object of ours
    region.register(client, "io")                         # needs --allow_shared_memory
    q_view = region.array(0, (rows, heads, dim), "bf16")  # numpy view (bf16 as uint16 bits)
    q_view[...] = q_bits
    o = region.tensor(8 << 20, (rows, heads, dim), "bf16")
    lse = region.tensor(16 << 20, (rows, heads), "fp32")
    client.prefill(0, region.tensor(0, (rows, heads, dim), "bf16"), ..., output_to=(o, lse))
    region.array(8 << 20, (rows, heads, dim), "bf16")     # the output, in place
    region.close(client)                                  # unregister, unmap, unlink

A RegionTensor stands wherever a request takes a tensor (prefill's q,
append_k, append_v; write_kv's k, v; merge_states' states); outputs go to
regions with output_to= (prefill), into= (read_kv, merge_states).

CUDA tensors (torch) live in CUDA regions: the server (CUDA backend, on the
same host, on the tensor's GPU or a peer of it) opens the allocation's IPC
handle once and copies device to device, with no host bounce:

    q = torch.randn(rows, heads, dim, dtype=torch.bfloat16, device="cuda:0")
    q_ref = register_cuda_tensor(client, "q", q)          # RegionTensor naming q
    o = torch.empty_like(q); lse = torch.empty(rows, heads, device="cuda:0")
    out = (register_cuda_tensor(client, "o", o), register_cuda_tensor(client, "lse", lse))
    torch.cuda.synchronize()                               # q is written before the server reads it
    client.prefill(0, q_ref, ..., output_to=out)           # o and lse are filled when it returns
    for name in ("q", "o", "lse"): client.unregister_region(name)

Keep a registered tensor alive (and its memory unchanged while a request
reads it) until it is unregistered. The CPU backend refuses CUDA regions
(FAILED_PRECONDITION).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Optional

import numpy as np

from attnserve import dtypes as _dt

_ELEM = {"bf16": (2, np.uint16, _dt.DTYPE_BF16), "fp16": (2, np.float16, _dt.DTYPE_FP16),
         "fp32": (4, np.float32, _dt.DTYPE_FP32)}


@dataclass(frozen=True)
class RegionTensor:
    """A tensor in a registered region: its bytes are
    [offset, offset + nbytes) of region `region` (the registered name)."""

    region: str
    offset: int
    shape: tuple
    dtype: str  # "bf16", "fp16" or "fp32"

    @property
    def nbytes(self) -> int:
        n = _ELEM[self.dtype][0]
        for s in self.shape:
            n *= int(s)
        return n

    @property
    def wire_dtype(self) -> int:
        return _ELEM[self.dtype][2]


def _check_dtype(dtype: str) -> None:
    if dtype not in _ELEM:
        raise ValueError(f"dtype must be one of {sorted(_ELEM)}, not {dtype!r}")


class SharedMemoryRegion:
    """A POSIX shared-memory object this process creates (multiprocessing's
    shared_memory) for a system region. close() unregisters it (if
    registered), unmaps and unlinks it; a server that still holds it keeps its
    own mapping until the region is unregistered."""

    def __init__(self, size: int, *, name: Optional[str] = None):
        if size < 1:
            raise ValueError(f"size={size} must be >= 1")
        self.shm = shared_memory.SharedMemory(create=True, size=int(size),
                                              name=name or f"attn_{secrets.token_hex(8)}")
        self.size = int(size)
        self.name: Optional[str] = None  # the registered region name

    @property
    def key(self) -> str:
        """The shm_open name the server opens."""
        return "/" + self.shm.name

    def register(self, client, name: str, *, timeout: Optional[float] = None) -> "SharedMemoryRegion":
        client.register_system_region(name, self.key, self.size, timeout=timeout)
        self.name = name
        return self

    def array(self, offset: int, shape, dtype: str) -> np.ndarray:
        """A numpy view of [offset, offset + nbytes) (bf16 as uint16 bits)."""
        _check_dtype(dtype)
        t = RegionTensor("", int(offset), tuple(int(s) for s in shape), dtype)
        if offset < 0 or offset + t.nbytes > self.size:
            raise ValueError(f"[{offset}, {offset + t.nbytes}) is outside the region's "
                             f"{self.size} bytes")
        return np.ndarray(t.shape, dtype=_ELEM[dtype][1], buffer=self.shm.buf, offset=int(offset))

    def tensor(self, offset: int, shape, dtype: str) -> RegionTensor:
        """The RegionTensor naming [offset, offset + nbytes) of this region."""
        _check_dtype(dtype)
        if self.name is None:
            raise ValueError("register() the region before naming its tensors")
        t = RegionTensor(self.name, int(offset), tuple(int(s) for s in shape), dtype)
        if offset < 0 or offset + t.nbytes > self.size:
            raise ValueError(f"[{offset}, {offset + t.nbytes}) is outside the region's "
                             f"{self.size} bytes")
        return t

    def close(self, client=None, *, timeout: Optional[float] = None) -> None:
        if client is not None and self.name is not None:
            client.unregister_region(self.name, timeout=timeout)
            self.name = None
        self.shm.close()
        try:
            self.shm.unlink()
        except FileNotFoundError:
            pass

    def __enter__(self) -> "SharedMemoryRegion":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_LIBCUDA = None


def _libcuda():
    """The CUDA driver library (present wherever a GPU is)."""
    global _LIBCUDA
    if _LIBCUDA is None:
        import ctypes
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64),
                                                ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
        lib.cuIpcGetMemHandle.argtypes = [ctypes.c_char_p, ctypes.c_uint64]
        _LIBCUDA = lib
    return _LIBCUDA


def cuda_ipc_handle(tensor):
    """(ipc_handle bytes, device index, byte offset of the tensor in its
    allocation) of a CUDA torch tensor, for Client.register_cuda_region.

    The handle exports the whole device allocation the tensor lives in
    (torch's caching allocator carves several tensors from one), so the
    tensor starts at that offset into the region: register at least offset
    + nbytes bytes and name the tensor at the offset (register_cuda_tensor
    does both). The tensor must be contiguous. Uses the CUDA driver
    (cuMemGetAddressRange, cuIpcGetMemHandle) through ctypes."""
    import ctypes
    import torch  # only when used
    if not isinstance(tensor, torch.Tensor) or not tensor.is_cuda:
        raise ValueError("cuda_ipc_handle needs a CUDA torch tensor")
    if not tensor.is_contiguous():
        raise ValueError("cuda_ipc_handle needs a contiguous tensor")
    # Makes the device's primary context current on this thread for the
    # driver calls below.
    torch.cuda.synchronize(tensor.device)
    cu = _libcuda()
    base = ctypes.c_uint64()
    size = ctypes.c_size_t()
    rc = cu.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(tensor.data_ptr()))
    if rc != 0:
        raise ValueError(f"cuMemGetAddressRange failed (CUresult {rc}) for the tensor's memory")
    handle = ctypes.create_string_buffer(64)
    rc = cu.cuIpcGetMemHandle(handle, base)
    if rc != 0:
        raise ValueError(f"cuIpcGetMemHandle failed (CUresult {rc}): the tensor's memory cannot be exported "
                         "(allocations from expandable segments cannot: set "
                         "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False)")
    return handle.raw[:64], int(tensor.device.index), int(tensor.data_ptr() - base.value)


_TORCH_DTYPES = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32"}


def register_cuda_tensor(client, name: str, tensor, *, timeout: Optional[float] = None) -> RegionTensor:
    """Registers the allocation holding CUDA torch tensor `tensor` (bf16,
    fp16 or float32, contiguous) as CUDA region `name`, up to the tensor's
    end, and returns the RegionTensor naming the tensor in it."""
    dtype = _TORCH_DTYPES.get(str(tensor.dtype))
    if dtype is None:
        raise ValueError(f"tensor dtype {tensor.dtype} is not bf16, fp16 or float32")
    handle, device, offset = cuda_ipc_handle(tensor)
    nbytes = tensor.numel() * tensor.element_size()
    client.register_cuda_region(name, handle, device, offset + nbytes, timeout=timeout)
    return RegionTensor(name, offset, tuple(int(s) for s in tensor.shape), dtype)
