"""Typed errors: one class per gRPC status code, all under AttnserveError.

Every error the client raises for a failed call carries the server's gRPC
code (`code`, a grpc.StatusCode) and message (`details`), so callers can
catch the class they care about:

    try:
        client.allocate_pages(10_000)
    except attnserve.ResourceExhausted as e:
        print(e.code, e.details)   # StatusCode.RESOURCE_EXHAUSTED, "... free ..."

docs/design.md section 4 says which code each kind of bad request gets.
"""

from __future__ import annotations

import re

import grpc


class AttnserveError(Exception):
    """A call failed; `code` is the grpc.StatusCode, `details` the message."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, details: str, code: grpc.StatusCode | None = None, method: str = ""):
        if code is not None:
            self.code = code
        self.details = details
        self.method = method
        where = f"{method}: " if method else ""
        super().__init__(f"{where}{self.code.name}: {details}")


class Cancelled(AttnserveError):
    code = grpc.StatusCode.CANCELLED


class Unknown(AttnserveError):
    code = grpc.StatusCode.UNKNOWN


class InvalidArgument(AttnserveError):
    """Malformed or out-of-range input; the message names the field and the bound."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class DeadlineExceeded(AttnserveError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class NotFound(AttnserveError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(AttnserveError):
    code = grpc.StatusCode.ALREADY_EXISTS


class PermissionDenied(AttnserveError):
    """A page or slot that belongs to another tenant."""

    code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhausted(AttnserveError):
    """No free pages, over the tenant's quota, queue full, or message too large."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(AttnserveError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class StaleIncarnation(FailedPrecondition):
    """The server restarted since this client learned its incarnation.

    Its KV cache is gone and page ids may now belong to someone else. Re-create
    the state (pages, KV) after client.forget_incarnation() or reconnect().
    """


class LeaseExpired(FailedPrecondition):
    """The lease the request named is gone (not renewed within its ttl, revoked,
    or from before a restart): the server released everything held under it
    (pages freed and zeroed, plans released). Never retry with the same state:
    start a new lease and re-create it. docs/security.md, "Leases"."""


class Aborted(AttnserveError):
    code = grpc.StatusCode.ABORTED


class OutOfRange(AttnserveError):
    code = grpc.StatusCode.OUT_OF_RANGE


class Unimplemented(AttnserveError):
    code = grpc.StatusCode.UNIMPLEMENTED


class Internal(AttnserveError):
    code = grpc.StatusCode.INTERNAL


class Unavailable(AttnserveError):
    """The server is unreachable, draining, or not SERVING."""

    code = grpc.StatusCode.UNAVAILABLE


class DataLoss(AttnserveError):
    code = grpc.StatusCode.DATA_LOSS


class Unauthenticated(AttnserveError):
    """Missing or unknown bearer token."""

    code = grpc.StatusCode.UNAUTHENTICATED


class SequencesLost(DataLoss):
    """Sequences whose KV is gone: a server holding part of them restarted or
    could not be reached for too long (attnserve.Cluster), or the KV manager's
    lease expired (attnserve.KvManager). seq_ids names them; finish() them and
    start them again.

    From run(), partial is the step's PrefillResult for the other sequences
    (the lost sequences' rows are 0 with LSE -inf), when there are others.
    """

    code = grpc.StatusCode.DATA_LOSS

    def __init__(self, seq_ids, why: str, partial=None, method: str = ""):
        self.seq_ids = sorted(seq_ids, key=repr)
        self.partial = partial
        super().__init__(f"sequences lost: {self.seq_ids} ({why}); finish() them and start "
                         "them again", grpc.StatusCode.DATA_LOSS, method)


# Codes of a failed call that may or may not have taken effect on the server
# (the reply, not the request, may be what was lost).
_OUTCOME_UNKNOWN = frozenset((grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE,
                              grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN,
                              grpc.StatusCode.INTERNAL, grpc.StatusCode.ABORTED,
                              grpc.StatusCode.DATA_LOSS))


def outcome_unknown(error: AttnserveError) -> bool:
    """True when the failed call may or may not have taken effect on the
    server (DEADLINE_EXCEEDED, UNAVAILABLE, CANCELLED, UNKNOWN, INTERNAL,
    ABORTED, DATA_LOSS); any other code is the server's definite answer: the
    request changed nothing."""
    return error.code in _OUTCOME_UNKNOWN


_BY_CODE = {
    cls.code: cls
    for cls in (Cancelled, Unknown, InvalidArgument, DeadlineExceeded, NotFound, AlreadyExists,
                PermissionDenied, ResourceExhausted, FailedPrecondition, Aborted, OutOfRange,
                Unimplemented, Internal, Unavailable, DataLoss, Unauthenticated)
}


_TOO_LARGE = re.compile(r"^(Sent|Received) message larger than max \((\d+) vs\. (\d+)\)")


def error_for(code: grpc.StatusCode, details: str, method: str = "") -> AttnserveError:
    """The typed error for a gRPC status (code other than OK)."""
    if code == grpc.StatusCode.FAILED_PRECONDITION and details.startswith("lease "):
        return LeaseExpired(details, code, method)
    if code == grpc.StatusCode.FAILED_PRECONDITION and "incarnation" in details:
        return StaleIncarnation(details, code, method)
    m = _TOO_LARGE.match(details) if code == grpc.StatusCode.RESOURCE_EXHAUSTED else None
    if m:
        # gRPC's own check of this client's limit, in attnserve's terms.
        which = "request" if m.group(1) == "Sent" else "response"
        details = (f"the {which} is {m.group(2)} bytes, more than this client's "
                   f"max_message_bytes allows ({m.group(3)} bytes with 1 MiB for framing): send "
                   "tensors this large through a shared-memory region (docs/transport.md; the "
                   "server needs --allow_shared_memory), or split the request, or raise "
                   "max_message_bytes here and --max_message_bytes on the server")
    return _BY_CODE.get(code, AttnserveError)(details, code, method)


def connect_cause(details: str, target: str, tls: bool, tls_ca: str | None = None,
                  tls_cert: str | None = None) -> str | None:
    """The cause of a failed connection that gRPC's UNAVAILABLE message names,
    said in attnserve's terms; None when it names none a caller can act on
    (then the address may still become ready)."""
    ca = f"tls_ca={tls_ca}" if tls_ca else "the system's root CAs"
    if "DNS resolution failed" in details or "Domain name not found" in details:
        return f"cannot resolve the host of {target} (a typo?): {details}"
    if "Connection refused" in details:
        return (f"connection refused: nothing listens on {target} (is attnserve running, and is "
                "this its --listen address?)")
    if "Failed parsing HTTP/2" in details or "http1" in details or "HTTP/1" in details:
        return (f"{target} answers HTTP/1, not gRPC: is it attnserve's metrics port "
                "(--metrics_listen) instead of its --listen address?")
    if "certificate verify failed" in details or "CERTIFICATE_VERIFY_FAILED" in details:
        return (f"TLS: the certificate of {target} is not signed by {ca} (or does not name the "
                f"host): {details}")
    if "wrong version number" in details or "WRONG_VERSION_NUMBER" in details:
        return (f"TLS: {target} does not speak TLS (a server without --tls_cert): connect "
                "without tls, tls_ca or tls_cert")
    # A server that wants client certificates (--tls_client_ca) closes the
    # connection once the handshake has shown the client's.
    mtls = ("a server with --tls_client_ca wants a client certificate (tls_cert, tls_key)"
            if not tls_cert else "a server with --tls_client_ca refuses a client certificate "
            f"its CA did not sign (tls_cert={tls_cert})")
    if "andshake failed" in details:
        return f"TLS handshake with {target} failed ({mtls}?): {details}"
    if "Socket closed" in details or "Connection reset" in details:
        if not tls:
            return (f"{target} closed the connection before answering: if it is a TLS server "
                    "(--tls_cert), connect with tls (and tls_ca)")
        return f"{target} closed the connection after the TLS handshake: {mtls}"
    return None


def from_rpc_error(error: grpc.RpcError, method: str = "") -> AttnserveError:
    """The typed error for a failed call (sync grpc.RpcError or grpc.aio.AioRpcError)."""
    code = error.code() if callable(getattr(error, "code", None)) else grpc.StatusCode.UNKNOWN
    details = error.details() if callable(getattr(error, "details", None)) else str(error)
    if code == grpc.StatusCode.CANCELLED:
        # The client cancels a call itself only when its close() or
        # reconnect() closes the channel, and says so first (_closed_error);
        # an asyncio task's cancellation raises CancelledError, not this.
        # Otherwise the server's gRPC cancelled it, as it does to a call that
        # arrives in the last moments of a shutdown: "go elsewhere".
        return Unavailable(f"the server cancelled the call (it was shutting down): {details}",
                           grpc.StatusCode.UNAVAILABLE, method)
    return error_for(code or grpc.StatusCode.UNKNOWN, details or "", method)
