"""Python client for attnserve, the GPU-resident attention server.

    import attnserve
    client = attnserve.Client("127.0.0.1:50051")
    mgr = attnserve.KvManager(client)
    gpt_oss = attnserve.AttentionOptions(window_left=127, sinks=sinks)   # a variant (docs/python.md)
    cluster = attnserve.Cluster(["10.0.0.1:50051", "10.0.0.2:50051"])   # many servers

docs/python.md is the guide; proto/attnserve/v1/attention.proto and
docs/design.md are the contract.
"""

from attnserve.client import Client
from attnserve.layout import AttentionOptions, PrefillLayout
from attnserve.results import (Holdings, HoldingsList, LeaseGrant, LeaseInfo, PrefillResult,
                               RegionInfo, ServerInfo)
from attnserve._settings import retain_freed_memory
from attnserve.aio import AsyncClient
from attnserve.dtypes import (RawBits, bf16_bits_to_float32, float32_to_bf16_bits,
                              float_to_fp8_bits, fp8_bits_to_float32)
from attnserve.errors import (Aborted, AlreadyExists, AttnserveError, Cancelled, DataLoss,
                              DeadlineExceeded, FailedPrecondition, Internal, InvalidArgument,
                              LeaseExpired, NotFound, OutOfRange, PermissionDenied,
                              ResourceExhausted,
                              StaleIncarnation, Unauthenticated, Unavailable, Unimplemented,
                              Unknown)
from attnserve.lease import AsyncLease, Lease
from attnserve.kv_manager import AsyncKvManager, KvManager, Plan
from attnserve.regions import RegionTensor, SharedMemoryRegion, register_cuda_tensor
from attnserve.cluster import Cluster, ClusterServer, ClusterStep, SequencesLost, Shard
from attnserve.merge import merge_states

from attnserve._version import __version__

__all__ = [
    "Client", "AsyncClient", "ServerInfo", "PrefillResult", "PrefillLayout", "AttentionOptions",
    "KvManager", "AsyncKvManager", "Plan", "RegionInfo", "RegionTensor", "SharedMemoryRegion",
    "register_cuda_tensor", "retain_freed_memory",
    "Lease", "AsyncLease", "LeaseGrant", "LeaseInfo", "Holdings", "HoldingsList", "LeaseExpired",
    "Cluster", "ClusterStep", "ClusterServer", "Shard", "SequencesLost", "merge_states",
    "float32_to_bf16_bits", "bf16_bits_to_float32", "RawBits", "float_to_fp8_bits",
    "fp8_bits_to_float32",
    "AttnserveError", "Cancelled", "Unknown", "InvalidArgument", "DeadlineExceeded", "NotFound",
    "AlreadyExists", "PermissionDenied", "ResourceExhausted", "FailedPrecondition",
    "StaleIncarnation", "Aborted", "OutOfRange", "Unimplemented", "Internal", "Unavailable",
    "DataLoss", "Unauthenticated",
]
