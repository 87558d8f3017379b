"""Conversions between numpy / torch arrays and the wire's 16-bit tensors.

The wire carries raw little-endian 16-bit values in the server's kv_dtype
(bf16 or fp16) and float32 LSEs (docs/design.md section 3). numpy has no
bfloat16, so bf16 values live in numpy as uint16 bit patterns:

    bits = float32_to_bf16_bits(x)   # round to nearest even; NaN stays NaN
    y = bf16_bits_to_float32(bits)   # exact

Inputs accepted wherever a tensor goes to the server:
  * torch tensors (CPU or CUDA) of any floating dtype; bf16 / fp16 tensors that
    match the server's dtype are sent as they are (a CUDA tensor is copied to
    the host once), others are converted by torch on their device first;
  * numpy floating arrays (float32, float16; float64 is rounded to float32
    first), converted with round-to-nearest-even;
  * RawBits(bits, "bf16" or "fp16"): 16-bit patterns (e.g. what
    float32_to_bf16_bits returns) sent as they are; their dtype must be the
    server's.
Any other array (a numpy uint16 array among them: its values are integers,
not bf16 bits, unless wrapped in RawBits) raises TypeError.

Results (result_like): a query of numpy or torch floating values gets its
output back in its own dtype (and torch device); RawBits get bit patterns.

FP8 KV caches (docs/design.md, "FP8 KV cache"): K and V rows for a server
whose kv_dtype is "fp8_e4m3" or "fp8_e5m2" may also go as the FP8 bytes the
cache stores, stored as they are: torch float8_e4m3fn / float8_e5m2 tensors,
or RawBits(uint8 bits, "fp8_e4m3" / "fp8_e5m2"). numpy has no FP8 dtype:

    bits = float_to_fp8_bits(x, "fp8_e4m3", scale)   # x / scale, nearest even, saturating
    y = fp8_bits_to_float32(bits, "fp8_e4m3") * scale

the same rounding as the server's quantizer (written apart from it, from the
formats' definitions). Note that torch's own .to(torch.float8_e4m3fn) does
not saturate: values beyond 448 become NaN.
"""

from __future__ import annotations

import warnings

import numpy as np

try:  # torch is optional
    import torch
except ImportError:  # pragma: no cover - exercised only where torch is absent
    torch = None

# attention.proto's DType enum.
DTYPE_BF16 = 1
DTYPE_FP16 = 2
DTYPE_FP32 = 3
DTYPE_FP8_E4M3 = 4
DTYPE_FP8_E5M2 = 5
DTYPE_NAMES = {0: "unspecified", DTYPE_BF16: "bf16", DTYPE_FP16: "fp16", DTYPE_FP32: "fp32",
               DTYPE_FP8_E4M3: "fp8_e4m3", DTYPE_FP8_E5M2: "fp8_e5m2"}
FP8_DTYPES = (DTYPE_FP8_E4M3, DTYPE_FP8_E5M2)

# (exponent bits, mantissa bits, largest finite bit pattern) of each format.
_FP8_FORMATS = {DTYPE_FP8_E4M3: (4, 3, 0x7E), DTYPE_FP8_E5M2: (5, 2, 0x7B)}


def _fp8_wire(fmt) -> int:
    """A format given as "fp8_e4m3" / "fp8_e5m2" or its wire dtype."""
    if fmt in _FP8_FORMATS:
        return fmt
    for wire, name in DTYPE_NAMES.items():
        if name == fmt and wire in _FP8_FORMATS:
            return wire
    raise ValueError(f"FP8 format must be 'fp8_e4m3' or 'fp8_e5m2', not {fmt!r}")


def _fp8_table(wire: int) -> np.ndarray:
    """float32 value of each of the 256 bit patterns (NaN, and E5M2's +-inf)."""
    exp_bits, man_bits, _ = _FP8_FORMATS[wire]
    bias = (1 << (exp_bits - 1)) - 1
    bits = np.arange(256)
    e = (bits >> man_bits) & ((1 << exp_bits) - 1)
    m = bits & ((1 << man_bits) - 1)
    frac = m / float(1 << man_bits)
    mag = np.where(e == 0, np.ldexp(frac, 1 - bias), np.ldexp(1.0 + frac, e - bias))
    top = (1 << exp_bits) - 1
    if wire == DTYPE_FP8_E5M2:
        mag = np.where(e == top, np.where(m == 0, np.inf, np.nan), mag)
    else:
        mag = np.where((e == top) & (m == (1 << man_bits) - 1), np.nan, mag)
    return np.where(bits & 0x80, -mag, mag).astype(np.float32)


def fp8_bits_to_float32(bits, fmt) -> np.ndarray:
    """float32 values of FP8 bit patterns (uint8) of fmt ("fp8_e4m3" or
    "fp8_e5m2"); exact. The real value of a stored element is this times its
    scale."""
    b = np.asarray(bits)
    if b.dtype not in (np.uint8, np.int8):
        raise TypeError(f"fp8 bits must be a uint8 array, not {b.dtype}")
    return _fp8_table(_fp8_wire(fmt))[b.view(np.uint8)]


def float_to_fp8_bits(x, fmt, scale=1.0) -> np.ndarray:
    """FP8 bit patterns (uint8) of x / scale in fmt ("fp8_e4m3" or "fp8_e5m2"),
    as the server quantizes: the quotient in float64, rounded to the nearest
    FP8 value, ties to even; magnitudes at or beyond the largest finite value
    (448 for E4M3, 57344 for E5M2), infinities included, saturate to it; NaN
    becomes 0x7F; zero keeps its sign. scale: a number, or an array that
    broadcasts against x (e.g. [num_kv_heads, 1] per KV head); pass the
    scales as the server holds them (float32, e.g. from Client.kv_scales())."""
    wire = _fp8_wire(fmt)
    exp_bits, man_bits, max_bits = _FP8_FORMATS[wire]
    emin = 2 - (1 << (exp_bits - 1))  # exponent of the smallest normal
    q = np.asarray(x, dtype=np.float64) / np.asarray(scale, dtype=np.float64)
    sign = np.where(np.signbit(q), 0x80, 0).astype(np.uint8)
    a = np.abs(q)
    max_value = float(_fp8_table(wire)[max_bits])
    with np.errstate(invalid="ignore", over="ignore"):
        finite = np.isfinite(a) & (a < max_value)
        safe = np.where(finite, a, 0.0)
        _, ex = np.frexp(safe)                     # safe = m * 2^ex, m in [0.5, 1)
        e_eff = np.where(safe > 0, np.maximum(ex - 1, emin), emin)
        quanta = np.rint(np.ldexp(safe, man_bits - e_eff))  # rint: ties to even
        mag = ((e_eff - emin) << man_bits) + quanta.astype(np.int64)
        mag = np.minimum(mag, max_bits)
    out = np.where(finite, mag, max_bits).astype(np.uint8) | sign
    return np.where(np.isnan(q), np.uint8(0x7F), out).astype(np.uint8)


def float32_to_bf16_bits(x) -> np.ndarray:
    """bf16 bit patterns (uint16) of x, rounded to nearest, ties to even.

    Infinities stay infinite, values above the largest bf16 round to infinity,
    and NaN stays NaN (sign kept, quiet bit set).
    """
    f = np.ascontiguousarray(x, dtype=np.float32)
    bits = f.view(np.uint32)
    # Adding 0x7FFF plus the lowest kept bit carries into bit 16 exactly when
    # the dropped half is above the midpoint, or at it with an odd kept part.
    rounded = (bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)
    out = rounded.astype(np.uint16)
    nan = np.isnan(f)
    if nan.any():
        out[nan] = ((bits[nan] >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16)
    return out


def bf16_bits_to_float32(bits) -> np.ndarray:
    """float32 values of bf16 bit patterns (exact)."""
    b = np.ascontiguousarray(bits).view(np.uint16)
    return (b.astype(np.uint32) << np.uint32(16)).view(np.float32)


def is_torch(x) -> bool:
    return torch is not None and isinstance(x, torch.Tensor)


class RawBits:
    """Bit patterns of a tensor's values, sent to the server as they are.

        q = attnserve.RawBits(attnserve.float32_to_bf16_bits(x), "bf16")
        k = attnserve.RawBits(attnserve.float_to_fp8_bits(x, "fp8_e4m3", scale), "fp8_e4m3")

    bits: a numpy uint16 or int16 array (any shape) for dtype "bf16" or
    "fp16", the server's q_dtype; a uint8 array for "fp8_e4m3" or "fp8_e5m2",
    K and V rows as an FP8 server's cache stores them. numpy has no bfloat16
    nor FP8, so such values otherwise travel as float32 and are rounded.
    """

    def __init__(self, bits, dtype: str):
        arr = np.asarray(bits)
        if dtype in ("fp8_e4m3", "fp8_e5m2"):
            if arr.dtype not in (np.uint8, np.int8):
                raise TypeError(f"RawBits: {dtype} bits must be a uint8 array, not {arr.dtype}")
            self.bits = arr.view(np.uint8)
            self.dtype = dtype
            self.wire_dtype = _fp8_wire(dtype)
            return
        if arr.dtype not in (np.uint16, np.int16):
            raise TypeError(f"RawBits: bits must be a uint16 or int16 array, not {arr.dtype}")
        if dtype not in ("bf16", "fp16"):
            raise ValueError(f"RawBits: dtype must be 'bf16', 'fp16', 'fp8_e4m3' or 'fp8_e5m2', "
                             f"not {dtype!r}")
        self.bits = arr
        self.dtype = dtype
        self.wire_dtype = DTYPE_BF16 if dtype == "bf16" else DTYPE_FP16

    @property
    def shape(self):
        return self.bits.shape

    def __len__(self):
        return len(self.bits)

    def __getitem__(self, index):
        return RawBits(self.bits[index], self.dtype)


def _torch_dtype(wire_dtype: int):
    return torch.bfloat16 if wire_dtype == DTYPE_BF16 else torch.float16


def _torch_fp8(wire_dtype: int):
    """torch's dtype of an FP8 format, or None where this torch has none."""
    name = "float8_e4m3fn" if wire_dtype == DTYPE_FP8_E4M3 else "float8_e5m2"
    return getattr(torch, name, None) if torch is not None else None


def fp8_wire_of(x):
    """The FP8 wire dtype x holds (a torch float8 tensor, or RawBits of FP8
    bits), or None: how a K or V row tensor says it is already FP8."""
    if isinstance(x, RawBits):
        return x.wire_dtype if x.wire_dtype in FP8_DTYPES else None
    if is_torch(x):
        for wire in FP8_DTYPES:
            if _torch_fp8(wire) is not None and x.dtype == _torch_fp8(wire):
                return wire
    return None


def to_wire(x, wire_dtype: int, name: str):
    """(shape, memoryview of the raw bytes) of x as wire_dtype values.

    The memoryview views x's own memory whenever x already holds wire_dtype
    values contiguously on the host; otherwise it views one converted copy.
    """
    if wire_dtype in FP8_DTYPES:
        # FP8 rows as an FP8 cache stores them: sent as they are.
        have = fp8_wire_of(x)
        if have != wire_dtype:
            raise TypeError(f"{name}: FP8 rows of {DTYPE_NAMES[wire_dtype]} expected (a torch "
                            f"float8 tensor or RawBits), not {DTYPE_NAMES.get(have, type(x).__name__)}")
        if isinstance(x, RawBits):
            raw = np.ascontiguousarray(x.bits)
            return raw.shape, memoryview(raw).cast("B") if raw.size else memoryview(b"")
        x = x.detach().to("cpu").contiguous()
        raw = x.view(torch.uint8).numpy()
        return tuple(x.shape), memoryview(raw).cast("B") if raw.size else memoryview(b"")
    if wire_dtype not in (DTYPE_BF16, DTYPE_FP16):
        raise ValueError(f"{name}: unsupported server dtype {DTYPE_NAMES.get(wire_dtype, wire_dtype)}")
    if fp8_wire_of(x) is not None:
        raise TypeError(f"{name}: FP8 values where {DTYPE_NAMES[wire_dtype]} values go (FP8 rows "
                        "are taken only as K and V rows, by a server with an FP8 kv_dtype)")
    if is_torch(x):
        if not x.is_floating_point():
            raise TypeError(f"{name}: torch dtype {x.dtype} is not a floating type")
        want = _torch_dtype(wire_dtype)
        if x.dtype != want:
            x = x.to(want)  # on x's device, before the transfer
        x = x.detach()
        if x.device.type != "cpu":
            x = x.to("cpu")
        x = x.contiguous()
        shape = tuple(x.shape)
        arr = x.view(torch.int16).numpy()
        return shape, memoryview(arr).cast("B") if arr.size else memoryview(b"")
    if isinstance(x, RawBits):
        if x.wire_dtype != wire_dtype:
            raise TypeError(f"{name}: RawBits of {x.dtype}, but the server takes "
                            f"{DTYPE_NAMES[wire_dtype]} values here: the bits would be read as "
                            "other values")
        raw = np.ascontiguousarray(x.bits)
        return raw.shape, memoryview(raw).cast("B") if raw.size else memoryview(b"")
    arr = np.asarray(x)
    if arr.dtype.kind == "f":
        if wire_dtype == DTYPE_FP16:
            raw = arr.astype(np.float16, copy=False)
        else:
            raw = float32_to_bf16_bits(arr)
    elif arr.dtype in (np.uint16, np.int16):
        raise TypeError(
            f"{name}: numpy {arr.dtype} holds integers, not {DTYPE_NAMES[wire_dtype]} values: "
            f"pass floating values (float32, float16), or wrap bit patterns as "
            f"attnserve.RawBits({name}, \"{DTYPE_NAMES[wire_dtype]}\")")
    else:
        raise TypeError(f"{name}: numpy dtype {arr.dtype} is not a floating type (float32, "
                        f"float16, float64), nor RawBits")
    raw = np.ascontiguousarray(raw)
    return arr.shape, memoryview(raw).cast("B") if raw.size else memoryview(b"")


def result_like(x):
    """What a result computed from input x is returned as: (out, dtype), out
    one of "numpy", "torch", "raw" (None for no preference: a region), dtype
    the numpy or torch dtype of x's values (None: the default of out)."""
    if is_torch(x):
        return "torch", x.dtype
    if isinstance(x, RawBits):
        return "raw", None
    if isinstance(x, np.ndarray) and x.dtype.kind == "f":
        return "numpy", x.dtype
    return None, None


def _numpy_dtype(dtype):
    """dtype (numpy or torch) as a numpy floating dtype; bfloat16, which numpy
    lacks, as float32."""
    if is_torch_dtype(dtype):
        return {torch.float16: np.float16, torch.float64: np.float64}.get(dtype, np.float32)
    return np.dtype(dtype)


def is_torch_dtype(dtype) -> bool:
    return torch is not None and isinstance(dtype, torch.dtype)


def f32_to_wire(x, name: str):
    """(shape, memoryview) of x as float32 (LSEs)."""
    if is_torch(x):
        x = x.detach().to("cpu", torch.float32).contiguous()
        return tuple(x.shape), memoryview(x.numpy()).cast("B") if x.numel() else memoryview(b"")
    arr = np.ascontiguousarray(x, dtype=np.float32)
    return arr.shape, memoryview(arr).cast("B") if arr.size else memoryview(b"")


def _np_view(buf, start: int, nbytes: int, dtype) -> np.ndarray:
    itemsize = np.dtype(dtype).itemsize
    return np.frombuffer(buf, dtype=dtype, count=nbytes // itemsize, offset=start)


def from_wire(buf, start: int, nbytes: int, shape, wire_dtype: int, out: str, device=None,
              dtype=None):
    """A response tensor as numpy or torch, viewing buf where it can.

    out: "numpy" (bf16 widened to float32, fp16 as float16, fp32 as float32),
         "raw" (uint16 bit patterns; float32 for fp32),
         "torch" (torch bf16/fp16/float32 on `device`, default CPU).
    dtype: a numpy or torch floating dtype to return the 16-bit values in
    instead (the caller's; float32 stays float32).
    """
    t = _from_wire(buf, start, nbytes, shape, wire_dtype, out, device)
    if dtype is None or out == "raw" or wire_dtype in (DTYPE_FP32, *FP8_DTYPES):
        return t
    if out == "torch":
        want = dtype if is_torch_dtype(dtype) else torch.from_numpy(
            np.zeros(0, _numpy_dtype(dtype))).dtype
        return t if t.dtype == want else t.to(want)
    want = _numpy_dtype(dtype)
    return t if t.dtype == want else t.astype(want)


def _from_wire(buf, start: int, nbytes: int, shape, wire_dtype: int, out: str, device=None):
    shape = tuple(int(s) for s in shape)
    if wire_dtype == DTYPE_FP32:
        np_dtype = np.float32
    elif wire_dtype in (DTYPE_BF16, DTYPE_FP16):
        np_dtype = np.uint16
    elif wire_dtype in FP8_DTYPES:
        np_dtype = np.uint8
    else:
        raise ValueError(f"response tensor has dtype {DTYPE_NAMES.get(wire_dtype, wire_dtype)}")
    itemsize = np.dtype(np_dtype).itemsize
    count = int(np.prod(shape, dtype=np.int64)) if shape else 0
    if count * itemsize != nbytes:
        raise ValueError(f"response tensor of shape {list(shape)} holds {nbytes} bytes, "
                         f"expected {count * itemsize}")
    raw = _np_view(buf, start, nbytes, np_dtype).reshape(shape)
    if wire_dtype in FP8_DTYPES:
        # An FP8 cache's stored bytes: uint8 bit patterns (fp8_bits_to_float32
        # decodes them), or a torch float8 tensor.
        if out != "torch":
            return raw.copy()
        if torch is None:
            raise RuntimeError("out='torch' needs torch, which is not importable")
        device = torch.device(device) if device is not None else torch.device("cpu")
        t = torch.from_numpy(raw.copy())  # uint8 where this torch has no float8 dtype
        if _torch_fp8(wire_dtype) is not None:
            t = t.view(_torch_fp8(wire_dtype))
        return t.to(device) if device.type != "cpu" else t
    if out == "raw":
        return raw
    if out == "numpy":
        if wire_dtype == DTYPE_BF16:
            return bf16_bits_to_float32(raw).reshape(shape)
        if wire_dtype == DTYPE_FP16:
            return raw.view(np.float16)
        return raw
    if out == "torch":
        if torch is None:
            raise RuntimeError("out='torch' needs torch, which is not importable")
        device = torch.device(device) if device is not None else torch.device("cpu")
        if device.type == "cpu" and raw.ctypes.data % itemsize:
            raw = raw.copy()  # torch kernels expect aligned elements
        view = raw.view(np.int16) if np_dtype == np.uint16 else raw
        with warnings.catch_warnings():
            # The response bytes are not writable in Python's eyes; this client
            # holds their only reference, so the tensor may own them.
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(view)
        if wire_dtype == DTYPE_BF16:
            t = t.view(torch.bfloat16)
        elif wire_dtype == DTYPE_FP16:
            t = t.view(torch.float16)
        return t.to(device) if device.type != "cpu" else t
    raise ValueError(f"out must be 'numpy', 'torch' or 'raw', not {out!r}")
