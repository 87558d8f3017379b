"""The gRPC settings both clients (attnserve.Client, attnserve.AsyncClient)
open their channels with: the service's methods, the HTTP/2 and TCP
settings for large tensors, the retry policy, and glibc's malloc settings
for large messages (retain_freed_memory). attnserve.client re-exports them."""

from __future__ import annotations

import json

SERVICE = "attnserve.v1.AttentionService"
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
DEFAULT_MAX_MESSAGE_BYTES = 512 << 20
METHODS = ("GetServerInfo", "AllocatePages", "FreePages", "WriteKV", "ReadKV", "Prefill",
            "MergeStates", "CreatePlan", "ReleasePlan", "RegisterRegion", "UnregisterRegion",
            "ListRegions", "GrantLease", "KeepAlive", "RevokeLease", "ListHoldings",
            "ReleaseHoldings", "OpenChannel", "CloseChannel", "SetKvScales",
            "GetKvScales")


# gRPC's HTTP/2 and TCP settings for large tensors: the same names and values
# as common/transport.h (docs/transport.md, "TCP").
TRANSPORT_OPTIONS = (
    ("grpc.http2.max_frame_size", 4 << 20),
    ("grpc.http2.write_buffer_size", 8 << 20),
)

# The gRPC service config of both clients (common/transport.h,
# kClientServiceConfig, has the same JSON): a call that fails with UNAVAILABLE
# is tried again up to 3 more times, after waits of about 0.05, 0.1 and 0.2 s
# (gRPC's backoff, each jittered by +-20%), for the idempotent methods only. AllocatePages, FreePages,
# CreatePlan, ReleasePlan, RegisterRegion and UnregisterRegion are never
# retried: a repeat of one the server had already run would leave the
# client's books wrong. The clients raise gRPC's per-call retry buffer
# (256 KiB by default, past which nothing is retried) to their largest message.
RETRY_SERVICE_CONFIG = json.dumps({
    "methodConfig": [{
        "name": [{"service": SERVICE, "method": m} for m in
                 ("GetServerInfo", "Prefill", "WriteKV", "ReadKV", "MergeStates", "ListRegions")],
        "retryPolicy": {
            "maxAttempts": 4,
            "initialBackoff": "0.05s",
            "maxBackoff": "1s",
            "backoffMultiplier": 2,
            "retryableStatusCodes": ["UNAVAILABLE"],
        },
    }],
})

# glibc's mallopt parameters (malloc.h) and the values of common/transport.h's
# RetainFreedMemory.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
RETAIN_MMAP_THRESHOLD = 32 << 20
RETAIN_TRIM_THRESHOLD = 1 << 30


def retain_freed_memory() -> bool:
    """Process-wide, once at start: glibc's malloc keeps freed memory for the
    next message instead of returning it to the kernel, as attnserve does
    (docs/transport.md, "Freed memory"). gRPC receives each large message into
    fresh malloc blocks; without this, every 128 MiB response is received
    into memory the kernel faults in and zeroes again. The process then keeps
    up to 1 GiB of freed memory mapped per malloc arena. Returns False where
    it has no effect (not glibc)."""
    import ctypes
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return (mallopt(_M_MMAP_THRESHOLD, RETAIN_MMAP_THRESHOLD) == 1
            and mallopt(_M_TRIM_THRESHOLD, RETAIN_TRIM_THRESHOLD) == 1)


def method_path(name: str) -> str:
    """The gRPC path of method `name` of the service."""
    return f"/{SERVICE}/{name}"
