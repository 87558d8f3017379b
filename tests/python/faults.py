"""Fault injection for the Python KV manager and cluster tests (test_faults.py).

FaultInjector hands out gRPC client interceptors (attnserve.Client's and
AsyncClient's `interceptors=`) that decide, per call of the
AttentionService's methods:

- UNREACHABLE: the call never leaves the client and fails Unavailable, as
  when the server cannot be reached;
- REPLY_LOST: the call reaches the server and completes there, but the
  client sees DeadlineExceeded, as when the reply comes too late. This is the
  dangerous one: the server did the work (freed the pages, allocated them,
  made the plan) and the client does not know.

    faults = FaultInjector(seed=7)
    client = attnserve.Client(address, interceptors=faults.interceptors)
    faults.set_rates(unreachable=0.1, reply_lost=0.1)
    faults.fail_next("FreePages", REPLY_LOST)        # or deterministically

SequenceModel keeps the K/V the test believes each sequence has and checks a
step's output sequence by sequence against attnserve.reference.
"""

from __future__ import annotations

import random
import threading

import grpc
import grpc.aio
import numpy as np

from attnserve.reference import as_float64, compare, reference_prefill, within_tolerance

UNREACHABLE = "unreachable"
REPLY_LOST = "reply lost"
_SERVICE = "/attnserve.v1.AttentionService/"


class _Failed(grpc.RpcError, grpc.Call, grpc.Future):
    """A finished call that failed with `code` (what a blocking interceptor returns)."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__()
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details

    def initial_metadata(self):
        return ()

    def trailing_metadata(self):
        return ()

    def is_active(self):
        return False

    def time_remaining(self):
        return None

    def cancel(self):
        return False

    def add_callback(self, callback):
        return False

    def cancelled(self):
        return False

    def running(self):
        return False

    def done(self):
        return True

    def result(self, timeout=None):
        raise self

    def exception(self, timeout=None):
        return self

    def traceback(self, timeout=None):
        return None

    def add_done_callback(self, fn):
        fn(self)


class _Interceptor(grpc.UnaryUnaryClientInterceptor):
    def __init__(self, faults: "FaultInjector", target: str):
        self._faults, self._target = faults, target

    def intercept_unary_unary(self, continuation, client_call_details, request):
        fault = self._faults.decide(self._target, client_call_details.method)
        if fault == UNREACHABLE:
            return _Failed(grpc.StatusCode.UNAVAILABLE,
                           "injected fault: the server cannot be reached")
        outcome = continuation(client_call_details, request)
        if fault == REPLY_LOST:
            outcome.exception()  # the server has answered
            return _Failed(grpc.StatusCode.DEADLINE_EXCEEDED, "injected fault: the reply was lost")
        return outcome


class _AioInterceptor(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, faults: "FaultInjector", target: str):
        self._faults, self._target = faults, target

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        fault = self._faults.decide(self._target, client_call_details.method)
        if fault == UNREACHABLE:
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(),
                                       grpc.aio.Metadata(),
                                       "injected fault: the server cannot be reached")
        call = await continuation(client_call_details, request)
        if fault == REPLY_LOST:
            try:
                await call  # the server has answered
            except grpc.RpcError:
                pass
            raise grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(),
                                       grpc.aio.Metadata(), "injected fault: the reply was lost")
        return call


class FaultInjector:
    """Decides the fate of every call of the clients it was given to
    (thread-safe: a cluster's run() calls several servers at once)."""

    def __init__(self, seed: int):
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self._unreachable = 0.0
        self._reply_lost = 0.0
        self._exempt = {"KeepAlive"}  # the leases' renewals, in the background
        self._next: list = []
        self._down: set = set()
        self.counts = {UNREACHABLE: 0, REPLY_LOST: 0}
        self.calls: dict = {}

    def interceptors(self, target: str) -> list:
        """For attnserve.Client(..., interceptors=faults.interceptors)."""
        return [_Interceptor(self, target)]

    def aio_interceptors(self, target: str) -> list:
        """For attnserve.AsyncClient(..., interceptors=faults.aio_interceptors)."""
        return [_AioInterceptor(self, target)]

    @property
    def injected(self) -> int:
        return sum(self.counts.values())

    def set_rates(self, unreachable: float = 0.0, reply_lost: float = 0.0) -> None:
        with self._lock:
            self._unreachable, self._reply_lost = unreachable, reply_lost

    def fail_next(self, method: str, fault: str, target: str = "") -> None:
        """The next call of `method` ("FreePages") fails with `fault` (to
        `target` only, when given), whatever the rates."""
        with self._lock:
            self._next.append((method, target, fault))

    def set_down(self, target: str, down: bool) -> None:
        """Every call to `target` fails UNREACHABLE while down."""
        with self._lock:
            (self._down.add if down else self._down.discard)(target)

    def decide(self, target: str, method) -> str | None:
        if isinstance(method, bytes):
            method = method.decode()
        if not method.startswith(_SERVICE):
            return None  # health checks
        name = method[len(_SERVICE):]
        with self._lock:
            self.calls[name] = self.calls.get(name, 0) + 1
            fault = None
            if target in self._down:
                fault = UNREACHABLE
            else:
                for i, (m, t, f) in enumerate(self._next):
                    if m == name and (not t or t == target):
                        fault = f
                        del self._next[i]
                        break
                if fault is None and name not in self._exempt and (self._unreachable or
                                                                   self._reply_lost):
                    u = self._rng.random()
                    if u < self._unreachable:
                        fault = UNREACHABLE
                    elif u < self._unreachable + self._reply_lost:
                        fault = REPLY_LOST
            if fault is not None:
                self.counts[fault] += 1
            return fault


class _SequenceRows:
    """One sequence's rows as attnserve.reference reads them (slot j is position j)."""

    def __init__(self, k: np.ndarray, v: np.ndarray, wire_dtype: int):
        self._k, self._v = k, v
        self.row_shape = k.shape[1:]
        self.wire_dtype = wire_dtype

    def rows(self, layer: int, slots) -> tuple:
        idx = np.asarray(slots, dtype=np.int64)
        return self._k[idx], self._v[idx]


class SequenceModel:
    """The K/V the test believes each sequence has, by sequence, layer and
    position, and the float64 reference of a step over it."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, wire_dtype: int):
        self.num_layers = num_layers
        self.row_shape = (num_kv_heads, head_dim)
        self.wire_dtype = wire_dtype
        self._rows: dict = {}  # seq -> [layer] -> (k, v) float64 [rows, heads, dim]

    def write(self, seq, layer: int, start: int, k, v) -> None:
        """Rows [start, start + n) of `layer` (k, v [n, heads, dim] as sent)."""
        layers = self._rows.setdefault(seq, [(np.zeros((0, *self.row_shape)),) * 2
                                             for _ in range(self.num_layers)])
        old_k, old_v = layers[layer]
        end = start + len(k)
        if len(old_k) < end:
            grow = end - len(old_k)
            old_k = np.concatenate([old_k, np.zeros((grow, *self.row_shape))])
            old_v = np.concatenate([old_v, np.zeros((grow, *self.row_shape))])
        old_k[start:end] = as_float64(k, self.wire_dtype)
        old_v[start:end] = as_float64(v, self.wire_dtype)
        layers[layer] = (old_k, old_v)

    def rows(self, seq, layer: int) -> int:
        layers = self._rows.get(seq)
        return 0 if layers is None else len(layers[layer][0])

    def erase(self, seq) -> None:
        self._rows.pop(seq, None)

    def clear(self) -> None:
        self._rows.clear()

    def check(self, layer: int, parts, q, output, lse) -> list:
        """parts: (seq, row, q_len, kv_len): the sequence's query rows are the
        last q_len of its kv_len positions, at rows [row, row + q_len) of q,
        output and lse. Returns [(seq, why)] of the parts that differ."""
        wrong = []
        for seq, row, q_len, kv_len in parts:
            if self.rows(seq, layer) < kv_len:
                wrong.append((seq, f"the model has {self.rows(seq, layer)} rows of layer "
                                   f"{layer}, the step attends over {kv_len}"))
                continue
            k, v = self._rows[seq][layer]
            mirror = _SequenceRows(k, v, self.wire_dtype)
            o_ref, lse_ref = reference_prefill(mirror, layer, q[row:row + q_len], [0, q_len],
                                               [0, kv_len], list(range(kv_len)), [1],
                                               page_size=1)
            c = compare(o_ref, lse_ref, output[row:row + q_len], lse[row:row + q_len])
            if not within_tolerance(c):
                wrong.append((seq, str(c)))
        return wrong
