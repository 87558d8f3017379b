"""bf16 / fp16 conversion and the numpy / torch paths, without a server.

float32 -> bf16 is checked bit by bit against two references: torch's own
conversion, and an exact nearest-value computation in float64 with ties to
even. Every one of the 65536 upper halves is paired with the lower halves
that matter for rounding (0, 1, just below / at / just above the midpoint,
all ones) and random ones.
"""

import numpy as np
import pytest
import torch

from attnserve import dtypes as dt
from attnserve.dtypes import bf16_bits_to_float32, float32_to_bf16_bits

LOWER = np.array([0x0000, 0x0001, 0x7FFE, 0x7FFF, 0x8000, 0x8001, 0xC000, 0xFFFF], np.uint32)


def all_patterns(seed=0):
    upper = np.arange(1 << 16, dtype=np.uint32) << np.uint32(16)
    rng = np.random.default_rng(seed)
    lower = np.concatenate([LOWER, rng.integers(0, 1 << 16, 8, dtype=np.uint32)])
    return (upper[:, None] | lower[None, :]).reshape(-1)


def nearest_even_reference(bits: np.ndarray) -> np.ndarray:
    """bf16 bits nearest to each non-NaN float32, ties to even, from exact float64 math."""
    x = bits.view(np.float32).astype(np.float64)
    lo = (bits >> np.uint32(16)).astype(np.uint32)           # truncation toward zero
    hi = lo + np.uint32(1)                                      # next bf16 away from zero
    lo_val = np.abs(bf16_bits_to_float32((lo & 0xFFFF).astype(np.uint16)).astype(np.float64))
    hi_mag = (hi & np.uint32(0x7FFF))
    hi_val = np.abs(bf16_bits_to_float32((hi & 0xFFFF).astype(np.uint16)).astype(np.float64))
    hi_val = np.where(hi_mag == 0x7F80, 2.0 ** 128, hi_val)    # past the largest: infinity
    ax = np.abs(x)
    d_lo, d_hi = ax - lo_val, hi_val - ax
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & ((lo & 1) == 1))
    exact = (bits & np.uint32(0xFFFF)) == 0
    return np.where(pick_hi & ~exact, hi, lo).astype(np.uint16)


def test_bf16_rounding_matches_exact_nearest_even():
    bits = all_patterns()
    f = bits.view(np.float32)
    finite = ~np.isnan(f) & ~np.isinf(f)
    got = float32_to_bf16_bits(f[finite])
    want = nearest_even_reference(bits[finite])
    bad = np.nonzero(got != want)[0]
    assert bad.size == 0, f"{bad.size} mismatches, first x=0x{bits[finite][bad[0]]:08x}"


def test_bf16_rounding_matches_torch():
    bits = all_patterns(seed=1)
    f = bits.view(np.float32)
    ours = float32_to_bf16_bits(f)
    theirs = torch.from_numpy(f.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    nan = np.isnan(f)
    assert np.array_equal(ours[~nan], theirs[~nan])
    # NaN stays NaN with its sign; torch agrees that it is NaN.
    back = bf16_bits_to_float32(ours[nan])
    assert np.isnan(back).all()
    assert np.array_equal(np.signbit(back), np.signbit(f[nan]))
    assert np.isnan(bf16_bits_to_float32(theirs[nan])).all()


def test_bf16_ties_go_to_even():
    # 1 + 2^-8 lies halfway between bf16 1.0 (even) and 1 + 2^-7 (odd): down.
    # 1 + 3 * 2^-8 lies halfway between 1 + 2^-7 (odd) and 1 + 2^-6 (even): up.
    x = np.array([1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, -(1 + 2.0 ** -8)], np.float32)
    assert bf16_bits_to_float32(float32_to_bf16_bits(x)).tolist() == [1.0, 1 + 2.0 ** -6,
                                                                      -1.0]


def test_bf16_overflow_infinity_and_round_trip():
    big = np.array([3.4e38, np.finfo(np.float32).max, np.inf, -np.inf], np.float32)
    assert np.isinf(bf16_bits_to_float32(float32_to_bf16_bits(big))).all()
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    back = float32_to_bf16_bits(bf16_bits_to_float32(every))
    nan = np.isnan(bf16_bits_to_float32(every))
    assert np.array_equal(back[~nan], every[~nan])          # exact for every non-NaN
    assert np.isnan(bf16_bits_to_float32(back[nan])).all()


def test_fp16_path_is_numpy_rounding():
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((64, 4, 8)) * 100).astype(np.float32)
    shape, mv = dt.to_wire(x, dt.DTYPE_FP16, "q")
    assert shape == x.shape
    got = np.frombuffer(mv, np.float16).reshape(shape)
    assert np.array_equal(got, x.astype(np.float16))
    assert np.array_equal(got, torch.from_numpy(x).half().numpy())


def test_torch_bf16_on_cpu_is_sent_without_a_copy():
    t = torch.randn(16, 2, 64).to(torch.bfloat16)
    shape, mv = dt.to_wire(t, dt.DTYPE_BF16, "q")
    assert shape == (16, 2, 64)
    assert np.frombuffer(mv, np.uint8).ctypes.data == t.data_ptr()
    # float32 torch tensors are rounded by torch (the same bits as ours).
    f = torch.randn(8, 2, 64)
    _, mv32 = dt.to_wire(f, dt.DTYPE_BF16, "q")
    assert np.array_equal(np.frombuffer(mv32, np.uint16),
                          float32_to_bf16_bits(f.numpy()).reshape(-1))


def test_numpy_inputs_and_raw_bits():
    x = np.random.default_rng(3).standard_normal((5, 2, 64)).astype(np.float32)
    _, mv = dt.to_wire(x, dt.DTYPE_BF16, "k")
    bits = float32_to_bf16_bits(x)
    assert np.array_equal(np.frombuffer(mv, np.uint16), bits.reshape(-1))
    _, raw = dt.to_wire(dt.RawBits(bits, "bf16"), dt.DTYPE_BF16, "k")  # bits, as they are
    assert np.frombuffer(raw, np.uint8).ctypes.data == bits.ctypes.data
    # A bare uint16 array is integers, not bf16 bits: refused, naming RawBits.
    with pytest.raises(TypeError, match=r"k: numpy uint16 holds integers, not bf16 values.*"
                                        r"attnserve.RawBits\(k, \"bf16\"\)"):
        dt.to_wire(bits, dt.DTYPE_BF16, "k")
    with pytest.raises(TypeError, match="k: numpy int16 holds integers, not fp16"):
        dt.to_wire(bits.view(np.int16), dt.DTYPE_FP16, "k")
    # RawBits of the other 16-bit type would be read as other values.
    with pytest.raises(TypeError, match="k: RawBits of fp16, but the server takes bf16 values here"):
        dt.to_wire(dt.RawBits(bits, "fp16"), dt.DTYPE_BF16, "k")
    with pytest.raises(TypeError, match="RawBits: bits must be a uint16 or int16 array"):
        dt.RawBits(x, "bf16")
    with pytest.raises(TypeError, match="k: numpy dtype int32"):
        dt.to_wire(np.zeros((1, 2, 64), np.int32), dt.DTYPE_BF16, "k")
    with pytest.raises(TypeError, match="q: torch dtype torch.int64"):
        dt.to_wire(torch.zeros(1, 2, 64, dtype=torch.int64), dt.DTYPE_BF16, "q")


@pytest.mark.parametrize("wire", [dt.DTYPE_BF16, dt.DTYPE_FP16])
def test_from_wire_views_and_converts(wire):
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 4, 8)).astype(np.float32)
    bits = float32_to_bf16_bits(x) if wire == dt.DTYPE_BF16 else x.astype(np.float16).view(np.uint16)
    for pad in (0, 1):  # an odd offset as well: torch gets an aligned copy
        buf = b"\0" * pad + bits.tobytes()
        raw = dt.from_wire(buf, pad, bits.nbytes, (3, 4, 8), wire, "raw")
        assert np.array_equal(raw, bits)
        as_np = dt.from_wire(buf, pad, bits.nbytes, (3, 4, 8), wire, "numpy")
        want = bf16_bits_to_float32(bits) if wire == dt.DTYPE_BF16 else bits.view(np.float16)
        assert np.array_equal(as_np, want)
        t = dt.from_wire(buf, pad, bits.nbytes, (3, 4, 8), wire, "torch")
        assert t.dtype == (torch.bfloat16 if wire == dt.DTYPE_BF16 else torch.float16)
        assert np.array_equal(t.view(torch.int16).numpy().view(np.uint16), bits)
    with pytest.raises(ValueError, match="holds 10 bytes"):
        dt.from_wire(b"\0" * 10, 0, 10, (3, 4, 8), wire, "numpy")


@pytest.mark.parametrize("wire", [dt.DTYPE_BF16, dt.DTYPE_FP16])
def test_results_come_back_in_the_callers_dtype(wire):
    x = np.random.default_rng(5).standard_normal((3, 4, 8)).astype(np.float32)
    bits = float32_to_bf16_bits(x) if wire == dt.DTYPE_BF16 else x.astype(np.float16).view(np.uint16)
    buf = bits.tobytes()
    for like in (x.astype(np.float16), x, x.astype(np.float64)):
        kind, dtype = dt.result_like(like)
        got = dt.from_wire(buf, 0, bits.nbytes, (3, 4, 8), wire, kind, None, dtype)
        assert isinstance(got, np.ndarray) and got.dtype == like.dtype
    for like in (torch.from_numpy(x).half(), torch.from_numpy(x), torch.from_numpy(x).bfloat16()):
        kind, dtype = dt.result_like(like)
        got = dt.from_wire(buf, 0, bits.nbytes, (3, 4, 8), wire, kind, None, dtype)
        assert torch.is_tensor(got) and got.dtype == like.dtype
    kind, dtype = dt.result_like(dt.RawBits(bits, "bf16"))
    assert kind == "raw" and dtype is None
    # Asked for torch with a numpy query: torch in the query's dtype.
    got = dt.from_wire(buf, 0, bits.nbytes, (3, 4, 8), wire, "torch", None, np.dtype(np.float16))
    assert got.dtype == torch.float16
