"""Shared-memory regions (docs/transport.md): tensors a request names instead
of carrying their bytes.

    from attnserve.regions import SharedMemoryRegion
    region = SharedMemoryRegion(64 << 20)                 # a sealed memfd of ours
    region.register(client, "io")                         # needs --allow_shared_memory
    q_view = region.array(0, (rows, heads, dim), "bf16")  # numpy view (bf16 as uint16 bits)
    q_view[...] = q_bits
    o = region.tensor(8 << 20, (rows, heads, dim), "bf16")
    lse = region.tensor(16 << 20, (rows, heads), "fp32")
    client.prefill(0, region.tensor(0, (rows, heads, dim), "bf16"), ..., output_to=(o, lse))
    region.array(8 << 20, (rows, heads, dim), "bf16")     # the output, in place
    region.close(client)                                  # unregister, unmap, close

A system region is a memfd (os.memfd_create) sealed so that it never
shrinks: registering sends its file descriptor to the server over the
server's region socket (ServerInfo.region_socket) with a random claim token,
then names the token in RegisterRegion. The memory has no name anyone else
could open, so no other tenant can register it; and since it cannot shrink
under the server's mapping, no client can crash the server through it. The
client keeps the socket connection (the region's holder) until it
unregisters the region or exits; an idle region whose holder closed is
reclaimed by the server.

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

import array
import fcntl
import mmap
import os
import secrets
import socket
import struct
from dataclasses import dataclass
from typing import Optional

import grpc
import numpy as np

from attnserve import dtypes as _dt
from attnserve.errors import NotFound, error_for

# Each dtype's element bytes, numpy view type and wire dtype. FP8 (K and V
# rows as an FP8 cache stores them) is viewed as uint8 bit patterns.
_ELEM = {"bf16": (2, np.uint16, _dt.DTYPE_BF16), "fp16": (2, np.float16, _dt.DTYPE_FP16),
         "fp32": (4, np.float32, _dt.DTYPE_FP32),
         "fp8_e4m3": (1, np.uint8, _dt.DTYPE_FP8_E4M3),
         "fp8_e5m2": (1, np.uint8, _dt.DTYPE_FP8_E5M2)}


@dataclass(frozen=True)
class RegionTensor:
    """A tensor in a registered region: its bytes are
    [offset, offset + nbytes) of region `region` (the registered name)."""

    region: str
    offset: int
    shape: tuple
    dtype: str  # "bf16", "fp16", "fp32", or "fp8_e4m3" / "fp8_e5m2" (FP8 K and V rows)

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


# The region socket's protocol (common/region_socket.h): a hello from the
# server, one deposit (the claim token, with the memfd by SCM_RIGHTS), one
# reply (int32 code, then the message).
REGION_SOCKET_MAGIC = 0x47455241  # "AREG"
REGION_SOCKET_VERSION = 1
CLAIM_TOKEN_BYTES = 16
_HELLO = struct.Struct("<IIQ")      # magic, version, incarnation
_DEPOSIT = struct.Struct("<II16s")  # magic, version, claim token
_CODES = {c.value[0]: c for c in grpc.StatusCode}


def _socket_address(name: str) -> str:
    """'@NAME' is NAME in the abstract namespace, anything else a path."""
    return "\0" + name[1:] if name.startswith("@") else name


def deposit_region_fd(socket_name: str, fd: int, *, expected_incarnation: int = 0,
                      timeout: float = 10.0):
    """Sends memfd `fd` (sealed with at least F_SEAL_SHRINK) to the server's
    region socket `socket_name` (ServerInfo.region_socket) under a fresh
    random claim token; returns (claim_token, holder), the bytes to name in
    RegisterRegion's system.claim_token and the connection to keep open while
    the region is in use. When expected_incarnation is non-zero the server's
    hello must carry it (FailedPrecondition otherwise: the server restarted,
    or another process holds the socket). A refusal raises the typed error
    with the server's message."""
    where = f"region socket {socket_name}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.settimeout(timeout)
        try:
            sock.connect(_socket_address(socket_name))
        except OSError as e:
            raise error_for(grpc.StatusCode.UNAVAILABLE,
                            f"{where}: cannot connect (a client of system regions runs on the "
                            f"server's host, and for an '@' name in its network namespace): {e}",
                            "RegisterRegion") from None
        first = _recv(sock, where)
        if len(first) >= 4 and struct.unpack_from("<I", first)[0] == REGION_SOCKET_MAGIC:
            if len(first) != _HELLO.size:
                raise error_for(grpc.StatusCode.UNAVAILABLE,
                                f"{where}: a hello of {len(first)} bytes", "RegisterRegion")
            _, version, incarnation = _HELLO.unpack(first)
            if version != REGION_SOCKET_VERSION:
                raise error_for(grpc.StatusCode.FAILED_PRECONDITION,
                                f"{where}: protocol version {version}; this client speaks "
                                f"{REGION_SOCKET_VERSION}", "RegisterRegion")
            if expected_incarnation and incarnation != expected_incarnation:
                raise error_for(grpc.StatusCode.FAILED_PRECONDITION,
                                f"{where} answers for server incarnation {incarnation}, not "
                                f"{expected_incarnation} which this client talks to: the server "
                                "restarted or another process holds the socket",
                                "RegisterRegion")
        else:
            _raise_reply(first, where)
            raise error_for(grpc.StatusCode.UNAVAILABLE, f"{where}: not an attnserve region socket",
                            "RegisterRegion")
        token = secrets.token_bytes(CLAIM_TOKEN_BYTES)
        message = _DEPOSIT.pack(REGION_SOCKET_MAGIC, REGION_SOCKET_VERSION, token)
        try:
            sock.sendmsg([message], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                      array.array("i", [int(fd)]))])
        except OSError as e:
            raise error_for(grpc.StatusCode.UNAVAILABLE, f"{where}: cannot send the memfd: {e}",
                            "RegisterRegion") from None
        _raise_reply(_recv(sock, where), where)
        sock.settimeout(None)
        return token, sock
    except BaseException:
        sock.close()
        raise


def _recv(sock, where: str) -> bytes:
    try:
        data = sock.recv(4 + 1024)
    except socket.timeout:
        raise error_for(grpc.StatusCode.DEADLINE_EXCEEDED, f"{where}: no answer in time",
                        "RegisterRegion") from None
    except OSError as e:
        raise error_for(grpc.StatusCode.UNAVAILABLE, f"{where}: {e}", "RegisterRegion") from None
    if len(data) < 4:
        raise error_for(grpc.StatusCode.UNAVAILABLE, f"{where}: closed without answering",
                        "RegisterRegion")
    return data


def _raise_reply(reply: bytes, where: str) -> None:
    """Raises the typed error of a reply that is not OK."""
    code = struct.unpack_from("<i", reply)[0]
    if code != 0:
        raise error_for(_CODES.get(code, grpc.StatusCode.UNKNOWN),
                        f"{where}: {reply[4:].decode('utf-8', 'replace')}", "RegisterRegion")


SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def _not_async(client, method: str, instead: str) -> None:
    """TypeError for an AsyncClient given to a blocking method (its calls
    would be coroutines never awaited: nothing would happen)."""
    import inspect
    if inspect.iscoroutinefunction(getattr(client, "register_system_region", None)):
        raise TypeError(f"SharedMemoryRegion.{method}() takes an attnserve.Client; with an "
                        f"AsyncClient, await SharedMemoryRegion.{instead}()")


class SharedMemoryRegion:
    """A memfd this process creates for a system region: `size` zeroed bytes,
    sealed so that it never shrinks or grows (SEALS), mapped read-write.
    close() unregisters it (if registered), unmaps it and closes the file; a
    server that still holds it keeps its own mapping until the region is
    unregistered or reclaimed."""

    def __init__(self, size: int, *, name: Optional[str] = None):
        if size < 1:
            raise ValueError(f"size={size} must be >= 1")
        self.size = int(size)
        self.key = name or f"attn_{secrets.token_hex(8)}"  # the memfd's name (ListRegions' key)
        self.fd = os.memfd_create(self.key, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, self.size)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, SEALS)
            self.buf = mmap.mmap(self.fd, self.size)
        except BaseException:
            os.close(self.fd)
            raise
        self.name: Optional[str] = None  # the registered region name
        self._client = None

    def register(self, client, name: str, *, timeout: Optional[float] = None) -> "SharedMemoryRegion":
        """Registers the region as `name` through an attnserve.Client (with an
        AsyncClient: `await region.register_async(client, name)`)."""
        _not_async(client, "register", "register_async")
        client.register_system_region(name, self.fd, self.size, timeout=timeout)
        self.name = name
        self._client = client
        return self

    async def register_async(self, client, name: str, *,
                             timeout: Optional[float] = None) -> "SharedMemoryRegion":
        """register() through an attnserve.aio.AsyncClient."""
        await client.register_system_region(name, self.fd, self.size, timeout=timeout)
        self.name = name
        self._client = client
        return self

    def array(self, offset: int, shape, dtype: str) -> np.ndarray:
        """A numpy view of [offset, offset + nbytes) (bf16 as uint16 bits, FP8
        as uint8 bits)."""
        _check_dtype(dtype)
        t = RegionTensor("", int(offset), tuple(int(s) for s in shape), dtype)
        if offset < 0 or offset + t.nbytes > self.size:
            raise ValueError(f"[{offset}, {offset + t.nbytes}) is outside the region's "
                             f"{self.size} bytes")
        return np.ndarray(t.shape, dtype=_ELEM[dtype][1], buffer=self.buf, offset=int(offset))

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
        """With `client`, unregisters the region. Without, lets go of it: the
        client closes the region's holder connection, and the server reclaims
        the region once no request uses it (at the tenant's next
        register_system_region or list_regions)."""
        if client is not None and self.name is not None:
            _not_async(client, "close", "close_async")
            try:
                client.unregister_region(self.name, timeout=timeout)
            except NotFound:
                # Already gone: an earlier close() whose reply was lost, or
                # a server that restarted. The name is free either way.
                pass
        elif self._client is not None and self.name is not None:
            self._client._drop_region_holder(self.name)
        self._unmap()

    async def close_async(self, client, *, timeout: Optional[float] = None) -> None:
        """close(client) through an attnserve.aio.AsyncClient: unregisters
        the region, then unmaps and closes it."""
        if self.name is not None:
            try:
                await client.unregister_region(self.name, timeout=timeout)
            except NotFound:
                pass  # already gone, as in close()
        self._unmap()

    def _unmap(self) -> None:
        self.name = None
        self._client = None
        if self.fd >= 0:
            try:
                self.buf.close()
            except BufferError:
                # Views of it may be held only by garbage in reference
                # cycles (a traceback's frames): collect them, and try once more.
                import gc
                gc.collect()
                self.buf.close()  # BufferError while numpy views of it live
            os.close(self.fd)
            self.fd = -1

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
