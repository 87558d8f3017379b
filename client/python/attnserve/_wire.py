"""Protobuf wire format for the tensor-carrying messages, without copies.

Requests that carry tensors (Prefill, WriteKV, MergeStates) are sent as the
concatenation of (a) the small fields serialized by the generated message
class and (b) each Tensor field written here: a head (tag, length, dtype,
shape, data tag and length) followed by the caller's memory. Protobuf
parsers accept fields in any order, so the bytes parse as the same message;
b"".join() of the pieces is the one copy of the tensor data the client makes.

Responses that carry tensors (Prefill, ReadKV, MergeStates) are walked here
instead of parsed: each Tensor's data is located by offset in the response
bytes and viewed in place by numpy or torch.

The health check (grpc.health.v1) is two one-field messages encoded by hand,
so the package needs no generated code for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_VARINT, _FIXED64, _LEN, _FIXED32 = 0, 1, 2, 5
_MASK64 = (1 << 64) - 1


def varint(value: int) -> bytes:
    """Base-128 varint; negative values as 64-bit two's complement (10 bytes)."""
    value &= _MASK64
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def tag(field_number: int, wire_type: int) -> bytes:
    return varint((field_number << 3) | wire_type)


def tensor_head(field_number: int, dtype: int, shape, data_bytes: int) -> bytes:
    """Everything of a Tensor field (attention.proto) that precedes its data.

    The data (data_bytes bytes) must follow immediately.
    """
    packed_shape = b"".join(varint(int(s)) for s in shape)
    inner = bytearray()
    if dtype:
        inner += tag(1, _VARINT) + varint(dtype)
    if packed_shape:
        inner += tag(2, _LEN) + varint(len(packed_shape)) + packed_shape
    if data_bytes:
        inner += tag(3, _LEN) + varint(data_bytes)
    return tag(field_number, _LEN) + varint(len(inner) + data_bytes) + bytes(inner)


class WireError(ValueError):
    """Bytes that do not parse as the expected message."""


def _read_varint(buf, pos: int, end: int) -> tuple[int, int]:
    result = 0
    shift = 0
    while True:
        if pos >= end or shift > 63:
            raise WireError("truncated or overlong varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7


def fields(buf, start: int = 0, end: int | None = None):
    """Yields (field_number, wire_type, value, start, end) for each field.

    value is the integer for VARINT/FIXED64/FIXED32 fields and None for
    LEN fields, whose payload is buf[start:end].
    """
    end = len(buf) if end is None else end
    pos = start
    while pos < end:
        key, pos = _read_varint(buf, pos, end)
        number, wire_type = key >> 3, key & 7
        if wire_type == _VARINT:
            value, pos = _read_varint(buf, pos, end)
            yield number, wire_type, value, pos, pos
        elif wire_type == _FIXED64:
            if pos + 8 > end:
                raise WireError("truncated fixed64")
            yield number, wire_type, int.from_bytes(buf[pos:pos + 8], "little"), pos, pos + 8
            pos += 8
        elif wire_type == _FIXED32:
            if pos + 4 > end:
                raise WireError("truncated fixed32")
            yield number, wire_type, int.from_bytes(buf[pos:pos + 4], "little"), pos, pos + 4
            pos += 4
        elif wire_type == _LEN:
            length, pos = _read_varint(buf, pos, end)
            if pos + length > end:
                raise WireError("length-delimited field runs past the message")
            yield number, wire_type, None, pos, pos + length
            pos += length
        else:
            raise WireError(f"unsupported wire type {wire_type}")


@dataclass
class TensorRef:
    """A Tensor message inside a response: its dtype, shape and data range."""

    dtype: int = 0
    shape: list = field(default_factory=list)
    data_start: int = 0
    data_end: int = 0

    @property
    def nbytes(self) -> int:
        return self.data_end - self.data_start


def parse_tensor(buf, start: int, end: int, into: TensorRef | None = None) -> TensorRef:
    """Reads a Tensor message; merges into `into` as protobuf merges a repeated
    occurrence of a message field (scalars: last wins; shape: appended)."""
    t = TensorRef(data_start=start, data_end=start) if into is None else into
    for number, wire_type, value, s, e in fields(buf, start, end):
        if number == 1 and wire_type == _VARINT:
            t.dtype = value
        elif number == 2 and wire_type == _LEN:  # packed
            pos = s
            while pos < e:
                v, pos = _read_varint(buf, pos, e)
                t.shape.append(v - (1 << 64) if v >> 63 else v)
        elif number == 2 and wire_type == _VARINT:  # unpacked
            t.shape.append(value - (1 << 64) if value >> 63 else value)
        elif number == 3 and wire_type == _LEN:
            t.data_start, t.data_end = s, e
    return t


def parse_tensor_message(buf, tensor_fields: tuple, incarnation_field: int):
    """Walks a response with Tensor fields and a fixed64 incarnation.

    Returns ({field_number: TensorRef}, incarnation). A Tensor field that is
    absent comes back as an empty TensorRef.
    """
    tensors = {n: TensorRef() for n in tensor_fields}
    incarnation = 0
    for number, wire_type, value, s, e in fields(buf):
        if number in tensors and wire_type == _LEN:
            parse_tensor(buf, s, e, tensors[number])
        elif number == incarnation_field and wire_type == _FIXED64:
            incarnation = value
    return tensors, incarnation


# grpc.health.v1: HealthCheckRequest { string service = 1; }
#                 HealthCheckResponse { ServingStatus status = 1; }
HEALTH_STATUS = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}


def health_request(service: str) -> bytes:
    name = service.encode()
    return tag(1, _LEN) + varint(len(name)) + name if name else b""


def health_status(buf) -> str:
    status = 0
    for number, wire_type, value, _, _ in fields(buf):
        if number == 1 and wire_type == _VARINT:
            status = value
    return HEALTH_STATUS.get(status, f"STATUS_{status}")
