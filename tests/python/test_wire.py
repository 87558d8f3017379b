"""The hand-written wire encoding against the generated protobuf classes."""

import numpy as np
import pytest

from attnserve import _wire
from attnserve import dtypes as dt
from attnserve.client import PrefillLayout
from attnserve.v1 import attention_pb2 as pb


def test_tensor_fields_parse_as_the_generated_messages():
    rng = np.random.default_rng(0)
    q = rng.integers(0, 1 << 16, (7, 8, 64), dtype=np.uint16)
    k = rng.integers(0, 1 << 16, (3, 2, 64), dtype=np.uint16)
    layout = PrefillLayout.encode([0, 7], [0, 2], [5, 9], [3], sm_scale=0.25, causal=False,
                                  lse_base="e", append_slots=[80, 81, 82])
    small = pb.PrefillRequest(layer=1, expected_incarnation=(1 << 64) - 3).SerializeToString()
    body = b"".join([small, layout.encoded,
                     _wire.tensor_head(2, dt.DTYPE_BF16, q.shape, q.nbytes), memoryview(q),
                     _wire.tensor_head(11, dt.DTYPE_BF16, k.shape, k.nbytes), memoryview(k),
                     _wire.tensor_head(12, dt.DTYPE_BF16, k.shape, k.nbytes), memoryview(k)])
    m = pb.PrefillRequest.FromString(body)
    assert m.layer == 1 and m.expected_incarnation == (1 << 64) - 3
    assert list(m.qo_indptr) == [0, 7] and list(m.kv_indices) == [5, 9]
    assert list(m.kv_last_page_len) == [3] and list(m.append_slots) == [80, 81, 82]
    assert m.HasField("sm_scale") and m.sm_scale == 0.25
    assert m.HasField("causal") and m.causal is False
    assert m.lse_base == pb.LSE_BASE_E
    assert m.q.dtype == pb.DTYPE_BF16 and list(m.q.shape) == [7, 8, 64]
    assert m.q.data == q.tobytes()
    assert list(m.append_k.shape) == [3, 2, 64] and m.append_v.data == k.tobytes()
    assert (layout.total_q, layout.num_append) == (7, 3)


def test_defaults_are_left_unset():
    m = pb.PrefillRequest.FromString(PrefillLayout.encode([0, 1], [0, 1], [0], [1]).encoded)
    assert not m.HasField("sm_scale") and not m.HasField("causal")


def test_empty_tensor_and_large_values():
    head = _wire.tensor_head(2, dt.DTYPE_FP16, (0, 8, 64), 0)
    m = pb.PrefillRequest.FromString(head)
    assert list(m.q.shape) == [0, 8, 64] and m.q.data == b"" and m.q.dtype == pb.DTYPE_FP16
    # A negative shape (invalid, but the server must see what was sent).
    m = pb.PrefillRequest.FromString(_wire.tensor_head(2, dt.DTYPE_BF16, (-1, 2), 0))
    assert list(m.q.shape) == [-1, 2]


@pytest.mark.parametrize("packed", [True, False])
def test_response_walker_reads_generated_responses(packed):
    out = np.arange(24, dtype=np.uint16).reshape(2, 3, 4)
    lse = np.linspace(-3, 3, 6, dtype=np.float32).reshape(2, 3)
    resp = pb.PrefillResponse(incarnation=0xDEADBEEF12345678)
    resp.output.dtype = pb.DTYPE_BF16
    resp.output.data = out.tobytes()
    resp.lse.dtype = pb.DTYPE_FP32
    resp.lse.shape.extend([2, 3])
    resp.lse.data = lse.tobytes()
    raw = resp.SerializeToString()
    if packed:
        resp.output.shape.extend([2, 3, 4])
        raw = resp.SerializeToString()
    else:  # unpacked repeated int64, which parsers must accept too
        raw += _wire.tag(1, 2) + _wire.varint(6) + b"".join(
            _wire.tag(2, 0) + _wire.varint(s) for s in (2, 3, 4))
    tensors, incarnation = _wire.parse_tensor_message(raw, (1, 2), 3)
    assert incarnation == 0xDEADBEEF12345678
    o = tensors[1]
    assert o.dtype == pb.DTYPE_BF16 and o.shape == [2, 3, 4]
    assert raw[o.data_start:o.data_end] == out.tobytes()
    assert np.array_equal(dt.from_wire(raw, tensors[2].data_start, tensors[2].nbytes,
                                       tensors[2].shape, tensors[2].dtype, "numpy"), lse)


def test_walker_rejects_truncated_bytes():
    raw = pb.PrefillResponse(output=pb.Tensor(data=b"x" * 100)).SerializeToString()
    with pytest.raises(_wire.WireError):
        _wire.parse_tensor_message(raw[:-1], (1, 2), 3)


def test_health_messages():
    assert _wire.health_request("") == b""
    assert _wire.health_request("attnserve.v1.AttentionService") == \
        b"\n\x1dattnserve.v1.AttentionService"
    assert _wire.health_status(b"\x08\x01") == "SERVING"
    assert _wire.health_status(b"\x08\x02") == "NOT_SERVING"
    assert _wire.health_status(b"") == "UNKNOWN"


def test_transport_options_match_the_cpp_settings():
    """TRANSPORT_OPTIONS carries common/transport.h's names and values."""
    import os
    import re
    from attnserve.client import TRANSPORT_OPTIONS
    header = open(os.path.join(os.path.dirname(__file__), "..", "..", "common",
                               "transport.h")).read()
    body = header[header.index("if (!tuned) return {};"):header.index("// Parses extra")]
    cpp = []
    for name, a, b in re.findall(r'\{"([\w.]+)", (\d+) << (\d+)\}', body):
        cpp.append((name, int(a) << int(b)))
    for name, value in re.findall(r'\{"([\w.]+)", (\d+)\}', body):
        cpp.append((name, int(value)))
    assert sorted(cpp) == sorted(TRANSPORT_OPTIONS)
    assert len(cpp) == 2


def test_retain_freed_memory_sets_the_values_of_common_transport_h():
    """retain_freed_memory takes effect on glibc, with RetainFreedMemory's values."""
    import os
    import platform
    import re
    from attnserve import retain_freed_memory
    from attnserve.client import RETAIN_MMAP_THRESHOLD, RETAIN_TRIM_THRESHOLD
    header = open(os.path.join(os.path.dirname(__file__), "..", "..", "common",
                               "transport.h")).read()
    body = header[header.index("inline bool RetainFreedMemory()"):]
    values = {name: int(a) << int(b) for name, a, b in
              re.findall(r"mallopt\((M_\w+), (\d+) << (\d+)\)", body)}
    assert values == {"M_MMAP_THRESHOLD": RETAIN_MMAP_THRESHOLD,
                      "M_TRIM_THRESHOLD": RETAIN_TRIM_THRESHOLD}
    if platform.libc_ver()[0] == "glibc":
        assert retain_freed_memory() is True
