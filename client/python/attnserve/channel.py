"""Request channels from Python (docs/transport.md, "Request channels").

A request channel is a ring of request/response slots in a system region
that a server thread polls: a Prefill written into a slot is answered in the
same slot, with no gRPC call. The ring's layout is common/channel_layout.h,
which the server and the C++ client (client/channel.h) share; this module
speaks it from Python.

    region = attnserve.SharedMemoryRegion(64 << 20).register(client, "io")
    channel = client.open_channel(region, 0)          # the ring at offset 0
    q_at = channel.ring_bytes                          # tensors after the ring
    ...
    r = channel.prefill(0, region.tensor(q_at, shape, "bf16"), qo_indptr, ...,
                        output_to=(o, lse))            # as Client.prefill
    call = channel.prefill_layout_async(layer, q, layout, k, v)   # returns at once
    ...                                                # the engine's own work
    r = call.result()                                  # the PrefillResult
    channel.close()

Each call takes a free slot (one per call in flight; when all are taken, the
oldest call in flight is waited for first), writes the serialized request
there, and publishes it. result() spins for spin_us, then sleeps on the
slot's futex word. A server that restarted or died never answers an old
ring: a call then fails with Unavailable (the channel is probed with
GetServerInfo every second while a call waits) or DeadlineExceeded at the
client's per-call deadline, never hangs.

Memory ordering: the two sides share plain memory words. Python has no
atomics, so this module relies on x86-64's ordering (stores are seen in
program order, as are loads; aligned 4- and 8-byte accesses are atomic) and
makes the one store-then-load fence the protocol needs (publish a request,
then read whether the server sleeps; mark the client waiting, then read the
answer) with a locked instruction (pthread_spin_lock). open refuses other
machines with NotImplementedError.
"""

from __future__ import annotations

import ctypes
import itertools
import platform
import threading
import time
import weakref
from typing import Optional

import grpc

from attnserve.errors import (AttnserveError, Cancelled, DeadlineExceeded, Unavailable,
                              error_for, outcome_unknown)
from attnserve.layout import PrefillLayout

MAGIC = 0x4e484341          # "ACHN"
VERSION = 1
MIN_SLOTS, MAX_SLOTS = 1, 64
MIN_SLOT_BYTES, MAX_SLOT_BYTES = 4 << 10, 16 << 20
ALIGN = 64
METHOD_PREFILL = 1

_PROBE_EVERY_S = 1.0          # while a call sleeps, the server is probed this often
_PROBE_TIMEOUT_S = 2.0
_SLEEP_NS = 50_000_000        # the longest single futex sleep
_REOPEN = ("the server may have restarted or closed the channel (its region unregistered): "
           "open a new channel")
_CODES = {c.value[0]: c for c in grpc.StatusCode}


class _Header(ctypes.Structure):
    _fields_ = [("magic", ctypes.c_uint32), ("version", ctypes.c_uint32),
                ("slot_count", ctypes.c_uint32), ("slot_bytes", ctypes.c_uint32),
                ("server_sleeping", ctypes.c_uint32), ("server_wake", ctypes.c_uint32),
                ("closed_channel_id", ctypes.c_uint64), ("reserved", ctypes.c_uint8 * 32)]


class _Control(ctypes.Structure):
    _fields_ = [("request_seq", ctypes.c_uint64), ("response_seq", ctypes.c_uint64),
                ("method", ctypes.c_uint32), ("request_bytes", ctypes.c_uint32),
                ("response_bytes", ctypes.c_uint32), ("status_code", ctypes.c_int32),
                ("client_waiting", ctypes.c_uint32), ("client_wake", ctypes.c_uint32),
                ("flags", ctypes.c_uint32), ("reserved", ctypes.c_uint8 * 20)]


assert ctypes.sizeof(_Header) == 64 and ctypes.sizeof(_Control) == 64
assert _Header.server_sleeping.offset == 16 and _Header.closed_channel_id.offset == 24
assert _Control.client_waiting.offset == 32 and _Control.flags.offset == 40


def channel_bytes(slot_count: int, slot_bytes: int) -> int:
    """Bytes of a ring of slot_count slots of slot_bytes payload each
    (ChannelBytes of common/channel_layout.h)."""
    return 64 + int(slot_count) * (64 + int(slot_bytes))


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Sys:
    """The futex syscall and a full fence, through the C library."""

    SYS_FUTEX = 202            # x86-64
    FUTEX_WAIT, FUTEX_WAKE = 0, 1

    def __init__(self):
        libc = ctypes.CDLL(None, use_errno=True)
        self.syscall = libc.syscall
        self.syscall.restype = ctypes.c_long
        self._spin_lock = libc.pthread_spin_lock
        self._spin_unlock = libc.pthread_spin_unlock
        self._lock_word = ctypes.c_int(0)   # pthread_spinlock_t is an int
        libc.pthread_spin_init(ctypes.byref(self._lock_word), 0)
        self._lock_ref = ctypes.byref(self._lock_word)

    def fence(self) -> None:
        """A full memory barrier: the spin lock's locked instruction orders
        every earlier store before every later load (x86-64)."""
        self._spin_lock(self._lock_ref)
        self._spin_unlock(self._lock_ref)

    def wait(self, address: int, expected: int, timeout_ns: int) -> None:
        ts = _Timespec(timeout_ns // 1_000_000_000, timeout_ns % 1_000_000_000)
        self.syscall(ctypes.c_long(self.SYS_FUTEX), ctypes.c_void_p(address),
                     ctypes.c_int(self.FUTEX_WAIT), ctypes.c_uint32(expected),
                     ctypes.byref(ts), ctypes.c_void_p(None), ctypes.c_int(0))

    def wake(self, address: int) -> None:
        self.syscall(ctypes.c_long(self.SYS_FUTEX), ctypes.c_void_p(address),
                     ctypes.c_int(self.FUTEX_WAKE), ctypes.c_int(0x7FFFFFFF),
                     ctypes.c_void_p(None), ctypes.c_void_p(None), ctypes.c_int(0))


_SYS: Optional[_Sys] = None


def _sys() -> _Sys:
    global _SYS
    if _SYS is None:
        if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
            raise NotImplementedError(
                f"request channels from Python need Linux on x86-64 (this is "
                f"{platform.system()} on {platform.machine()}): their memory ordering relies "
                "on x86's; use the gRPC path (with a shared-memory region) here")
        _SYS = _Sys()
    return _SYS


class ChannelCall:
    """A Prefill in flight on a channel: done() asks without waiting,
    result() waits and returns what the blocking call returns (or raises its
    error). The slot it holds is free again once result() has run (or once
    the channel needed the slot and waited for the answer itself)."""

    def __init__(self, channel: "RequestChannel", slot: int, seq: int, parse, deadline,
                 order: int):
        self._channel = channel
        self._order = order  # the channel's count of calls before this one
        self._slot, self._seq, self._parse, self._deadline = slot, seq, parse, deadline
        self._lock = threading.Lock()
        self._collected = False
        self._value = None
        self._error: Optional[BaseException] = None

    def done(self) -> bool:
        if self._collected:
            return True
        ch = self._channel
        return ch._controls is None or ch._controls[self._slot].response_seq == self._seq

    def result(self, timeout: Optional[float] = None):
        """The call's result. timeout: seconds to wait here (None: until the
        answer or the client's per-call deadline); TimeoutError if it passes
        (the call goes on, result() again waits for it)."""
        self._collect(timeout)
        if self._error is not None:
            raise self._error
        return self._value

    def _collect(self, timeout: Optional[float] = None) -> None:
        with self._lock:
            if self._collected:
                return
            try:
                raw = self._channel._wait(self._slot, self._seq, self._deadline, timeout)
            except TimeoutError:
                raise
            except AttnserveError as e:  # the slot was abandoned (an answer that never came)
                # Without the frames, which hold views of the ring.
                self._error, self._collected = e.with_traceback(None), True
                return
            except BaseException as e:
                # Interrupted while it waited (KeyboardInterrupt), or a probe
                # failed on its own: the slot is abandoned (free again once
                # its answer comes) so that no call waits on it again, and
                # the interruption goes on up.
                self._channel._abandon(self._slot, self)
                self._error, self._collected = e.with_traceback(None), True
                raise
            self._collected = True
            code, payload = raw
            if code != 0:
                self._error = error_for(_CODES.get(code, grpc.StatusCode.UNKNOWN),
                                        payload.decode("utf-8", "replace"), "Prefill")
                return
            try:
                self._value = self._parse(payload)
            except BaseException as e:
                self._error = e


# The rings of each region's open channels in this process: (region's
# attribute) key -> [offset, end, channel id or None while it opens].
_RINGS_LOCK = threading.Lock()


def _reserve_ring(region, begin: int, end: int) -> object:
    key = object()
    with _RINGS_LOCK:
        rings = region.__dict__.setdefault("_channel_rings", {})
        for other_begin, other_end, other_id in rings.values():
            if other_begin < end and begin < other_end:
                whose = "a channel opening" if other_id is None else f"open channel {other_id}"
                raise ValueError(f"offset={begin}: bytes [{begin}, {end}) of region "
                                 f"'{region.name}' overlap the ring of {whose} in this process "
                                 f"(bytes [{other_begin}, {other_end})): close it first, or "
                                 "open the channel on other bytes")
        rings[key] = [begin, end, None]
    return key


def _name_ring(region, key, channel_id: int) -> None:
    with _RINGS_LOCK:
        ring = region.__dict__.get("_channel_rings", {}).get(key)
        if ring is not None:
            ring[2] = channel_id


def _release_ring(region, key) -> None:
    with _RINGS_LOCK:
        region.__dict__.get("_channel_rings", {}).pop(key, None)


class RequestChannel:
    """A request channel on a ring in a registered SharedMemoryRegion; made by
    Client.open_channel. Thread-safe: each call in flight holds one slot."""

    def __init__(self):
        raise TypeError("use Client.open_channel(region, offset)")

    @classmethod
    def _open(cls, client, region, offset: int, *, slot_count: int, slot_bytes: int,
              spin_us: float, timeout) -> "RequestChannel":
        sysc = _sys()
        if getattr(region, "buf", None) is None or getattr(region, "name", None) is None:
            raise ValueError("region: a SharedMemoryRegion registered with this client "
                             "(region.register(client, name)) holds the ring")
        offset = int(offset)
        if not MIN_SLOTS <= int(slot_count) <= MAX_SLOTS:
            raise ValueError(f"slot_count={slot_count} out of range [{MIN_SLOTS}, {MAX_SLOTS}]")
        if (not MIN_SLOT_BYTES <= int(slot_bytes) <= MAX_SLOT_BYTES
                or int(slot_bytes) % ALIGN):
            raise ValueError(f"slot_bytes={slot_bytes} must be in [{MIN_SLOT_BYTES}, "
                             f"{MAX_SLOT_BYTES}] and a multiple of {ALIGN}")
        if offset < 0 or offset % ALIGN:
            raise ValueError(f"offset={offset} must be >= 0 and a multiple of {ALIGN}")
        size = channel_bytes(slot_count, slot_bytes)
        if offset + size > region.size:
            raise ValueError(f"the ring needs {size} bytes at offset {offset}, past the "
                             f"region's {region.size} bytes (channel_bytes(slot_count, "
                             "slot_bytes))")
        self = object.__new__(cls)
        self._client = client
        self._region = region
        self._base = offset
        self.slot_count, self.slot_bytes = int(slot_count), int(slot_bytes)
        self.ring_bytes = size
        self._spin_s = max(float(spin_us), 0.0) * 1e-6
        self._sys = sysc
        # Bytes this client's open channel polls are not written over: the
        # server would refuse the channel (FAILED_PRECONDITION), but the
        # header written first would already have garbled the other's calls.
        self._ring_key = _reserve_ring(region, offset, offset + size)
        buf = region.buf
        header = _Header.from_buffer(buf, offset)
        controls = [_Control.from_buffer(buf, self._control_at(i)) for i in range(slot_count)]
        ctypes.memset(ctypes.addressof(header), 0, 64)
        for c in controls:
            ctypes.memset(ctypes.addressof(c), 0, 64)
        header.magic, header.version = MAGIC, VERSION
        header.slot_count, header.slot_bytes = self.slot_count, self.slot_bytes
        sysc.fence()
        try:
            resp = client._call(client._req_open_channel(region.name, offset, size), timeout)
        except BaseException:
            header = controls = None
            _release_ring(region, self._ring_key)
            raise
        self.id = resp.channel_id
        _name_ring(region, self._ring_key, self.id)
        weakref.finalize(self, _release_ring, region, self._ring_key)
        self.incarnation = resp.incarnation
        self._header = header
        self._controls = controls
        self._server_wake_at = ctypes.addressof(header) + _Header.server_wake.offset
        self._lock = threading.Condition()
        self._wake_lock = threading.Lock()
        self._free = list(range(self.slot_count - 1, -1, -1))
        self._seq = [0] * self.slot_count
        self._in_flight: dict = {}       # slot -> ChannelCall not yet collected
        self._abandoned: set = set()     # slots whose caller gave up on the answer
        self._closed = False
        self._close_answered = False  # the server answered a CloseChannel
        self._calls = itertools.count()
        return self

    def _control_at(self, i: int) -> int:
        return self._base + 64 + i * (64 + self.slot_bytes)

    def _payload_at(self, i: int) -> int:
        return self._control_at(i) + 64

    # ------------------------------------------------------------ calls
    def prefill(self, layer: int, q, qo_indptr, kv_indptr, kv_indices, kv_last_page_len=None,
                **kwargs):
        """Client.prefill through the channel (same arguments and result)."""
        timeout = kwargs.pop("timeout", None)
        out, device, output_to = (kwargs.pop(k, None) for k in ("out", "device", "output_to"))
        append_k, append_v = kwargs.pop("append_k", None), kwargs.pop("append_v", None)
        layout = PrefillLayout.encode(qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
                                      **kwargs)
        return self.prefill_layout(layer, q, layout, append_k, append_v, out=out, device=device,
                                   output_to=output_to, timeout=timeout)

    def prefill_layout(self, layer: int, q, layout, append_k=None, append_v=None, *,
                       options=None, out=None, device=None, output_to=None, timeout=None):
        """Client.prefill_layout through the channel (same arguments and result)."""
        return self.prefill_layout_async(layer, q, layout, append_k, append_v, options=options,
                                         out=out, device=device, output_to=output_to,
                                         timeout=timeout).result()

    def prefill_layout_async(self, layer: int, q, layout, append_k=None, append_v=None, *,
                             options=None, out=None, device=None, output_to=None,
                             timeout=None) -> ChannelCall:
        """prefill_layout, returning as soon as the request is in its slot."""
        request = self._client._req_prefill(layer, q, layout, append_k, append_v, out, device,
                                            output_to, options)
        return self.submit(request, timeout)

    def submit(self, request, timeout: Optional[float] = None) -> ChannelCall:
        """Posts a built request (a Client._req_prefill) and returns its call."""
        method, body, parse = request
        if method != "Prefill":
            raise ValueError(f"a channel carries Prefill requests only, not {method}")
        n = len(body)
        if n > self.slot_bytes:
            raise error_for(grpc.StatusCode.INVALID_ARGUMENT,
                            f"the request needs {n} bytes, more than the channel's slot_bytes="
                            f"{self.slot_bytes}: put its tensors in a region, or open the "
                            "channel with larger slots", "Prefill")
        closed = self._client._closed_error("Prefill", self._client._channel_closes)
        if closed is not None:
            raise closed
        # The ring's views, taken once: close() drops the channel's own.
        header, controls = self._header, self._controls
        if header is None or controls is None:
            raise error_for(grpc.StatusCode.FAILED_PRECONDITION, f"channel {self.id} is closed",
                            "Prefill")
        t = self._client._timeout(timeout)
        deadline = None if t is None else time.monotonic() + t
        slot = self._acquire(deadline)
        try:
            at = self._payload_at(slot)
            self._region.buf[at:at + n] = body
            control = controls[slot]
            control.method = METHOD_PREFILL
            control.request_bytes = n
            seq = self._seq[slot] + 1
            self._seq[slot] = seq
            call = ChannelCall(self, slot, seq, parse, deadline, next(self._calls))
            with self._lock:
                self._in_flight[slot] = call
            control.request_seq = seq        # published (x86: after the stores above)
        except BaseException:
            self._release(slot)
            raise
        self._sys.fence()
        if header.server_sleeping:
            with self._wake_lock:
                header.server_wake = (header.server_wake + 1) & 0xFFFFFFFF
            self._sys.wake(self._server_wake_at)
        return call

    # ------------------------------------------------------------ slots
    def _acquire(self, deadline) -> int:
        next_probe = 0.0
        while True:
            oldest = None
            all_abandoned = False
            with self._lock:
                if self._closed:
                    raise error_for(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"channel {self.id} is closed", "Prefill")
                for slot in list(self._abandoned):  # free once their answer has come
                    if self._controls[slot].response_seq == self._seq[slot]:
                        self._abandoned.discard(slot)
                        self._free.append(slot)
                if self._free:
                    return self._free.pop()
                if len(self._abandoned) == self.slot_count:
                    all_abandoned = True
                elif self._in_flight:
                    oldest = min(self._in_flight.values(), key=lambda c: c._order)
                else:
                    self._lock.wait(0.001)
            if all_abandoned:
                # Every slot waits for an answer its caller gave up on (a
                # deadline, an interruption): while the server is there the
                # answers come and free the slots; once it is gone, none will.
                now = time.monotonic()
                if now >= next_probe:
                    gone = self._server_gone()
                    if gone is not None:
                        raise Unavailable(f"every slot of channel {self.id} waits for an "
                                          f"answer that never came ({gone.details})",
                                          grpc.StatusCode.UNAVAILABLE, "Prefill")
                    next_probe = time.monotonic() + _PROBE_EVERY_S
                time.sleep(0.001)
            if oldest is not None:
                # Every slot holds a call nobody collected yet: wait for the
                # oldest one's answer, which frees its slot.
                try:
                    oldest._collect(None if deadline is None
                                    else max(deadline - time.monotonic(), 0.0))
                except TimeoutError:
                    raise DeadlineExceeded(f"no slot of channel {self.id} freed up before the "
                                           "deadline", grpc.StatusCode.DEADLINE_EXCEEDED,
                                           "Prefill") from None
            if deadline is not None and time.monotonic() >= deadline:
                raise DeadlineExceeded(f"no slot of channel {self.id} freed up before the "
                                       "deadline", grpc.StatusCode.DEADLINE_EXCEEDED, "Prefill")

    def _abandon(self, slot: int, call: "ChannelCall") -> None:
        """Abandons `slot` if `call` still holds it."""
        with self._lock:
            if self._in_flight.get(slot) is call:
                self._in_flight.pop(slot)
                self._abandoned.add(slot)
                self._lock.notify_all()

    def _release(self, slot: int, abandoned: bool = False) -> None:
        with self._lock:
            self._in_flight.pop(slot, None)
            (self._abandoned.add if abandoned else self._free.append)(slot)
            self._lock.notify_all()

    def _wait(self, slot: int, seq: int, deadline, timeout):
        """Waits for the answer to request `seq` in `slot`; returns (status
        code, payload bytes) and frees the slot. TimeoutError when `timeout`
        passes first (the slot stays the call's); Unavailable or
        DeadlineExceeded when the answer will not come (the slot is
        abandoned, free again if it comes after all)."""
        control = self._controls[slot]
        now = time.monotonic()
        until = None if timeout is None else now + timeout
        spin_until = now + self._spin_s
        while control.response_seq != seq and time.monotonic() < spin_until:
            pass
        if control.response_seq != seq:
            self._sleep_until_answer(control, slot, seq, deadline, until)
        code = control.status_code
        n = min(control.response_bytes, self.slot_bytes)
        at = self._payload_at(slot)
        payload = self._region.buf[at:at + n]
        self._release(slot)
        return code, payload

    def _sleep_until_answer(self, control, slot, seq, deadline, until) -> None:
        wake_at = ctypes.addressof(control) + _Control.client_wake.offset
        control.client_waiting = 1
        self._sys.fence()
        next_probe = time.monotonic() + _PROBE_EVERY_S
        try:
            while True:
                word = control.client_wake
                if control.response_seq == seq:
                    return
                if self._header.closed_channel_id == self.id:
                    if control.response_seq == seq:
                        return
                    self._give_up(slot, Unavailable(
                        f"channel {self.id} was closed by the server before taking the "
                        f"request: {_REOPEN}", grpc.StatusCode.UNAVAILABLE, "Prefill"))
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    self._give_up(slot, DeadlineExceeded(
                        f"no answer on channel {self.id} within the deadline; if {_REOPEN}",
                        grpc.StatusCode.DEADLINE_EXCEEDED, "Prefill"))
                if until is not None and now >= until:
                    raise TimeoutError(f"no answer on channel {self.id} yet (the call goes on; "
                                       "result() again waits for it)")
                if now >= next_probe:
                    self._probe(slot)
                    next_probe = time.monotonic() + _PROBE_EVERY_S
                sleep_s = min(_SLEEP_NS * 1e-9, next_probe - now)
                for bound in (deadline, until):
                    if bound is not None:
                        sleep_s = min(sleep_s, bound - now)
                self._sys.wait(wake_at, word, max(int(sleep_s * 1e9), 1000))
        finally:
            control.client_waiting = 0

    def _give_up(self, slot: int, error: AttnserveError) -> None:
        self._release(slot, abandoned=True)
        raise error

    def _server_gone(self) -> Optional[AttnserveError]:
        """Unavailable when the server that opened the channel is gone or
        restarted (no answer will come), Cancelled when the client was closed
        (nothing can tell), else None (e.g. draining: answers may still
        come)."""
        try:
            info = self._client.info(timeout=_PROBE_TIMEOUT_S)
        except AttnserveError as e:
            if e.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                return Unavailable(
                    f"channel {self.id}: the server does not answer ({e.details}); {_REOPEN}",
                    grpc.StatusCode.UNAVAILABLE, "Prefill")
            if e.code == grpc.StatusCode.CANCELLED:  # the client was closed meanwhile
                return Cancelled(f"channel {self.id}: {e.details}", grpc.StatusCode.CANCELLED,
                                 "Prefill")
            return None
        if info.incarnation != self.incarnation:
            return Unavailable(
                f"channel {self.id} was opened on server incarnation {self.incarnation}, which "
                f"is gone (the server restarted; it is now {info.incarnation}): {_REOPEN}",
                grpc.StatusCode.UNAVAILABLE, "Prefill")
        return None

    def _probe(self, slot: int) -> None:
        """Gives up on the slot when the server is gone or restarted."""
        gone = self._server_gone()
        if gone is not None:
            self._give_up(slot, gone)

    # ------------------------------------------------------------ closing
    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, *, timeout: Optional[float] = None) -> None:
        """CloseChannel; the calls still in flight are answered first (their
        results stay readable). Idempotent once the server has answered: a
        CloseChannel whose outcome is unknown (it timed out, or never left)
        is sent again by the next close(), where NOT_FOUND means the earlier
        one went through. Errors are not raised (a server that is gone took
        its channels with it). Lets go of the ring's memory, so that the
        region can be closed after."""
        with self._lock:
            if self._close_answered:
                return
            again = self._closed
            self._closed = True
            calls = list(self._in_flight.values())
            self._lock.notify_all()
        if not again:
            for call in calls:
                try:
                    call._collect(None)
                except TimeoutError:
                    pass
        answered = False  # interrupted (KeyboardInterrupt): sent again next time
        try:
            self._client._call(self._client._req_close_channel(self.id),
                               _PROBE_TIMEOUT_S if timeout is None else timeout)
            answered = True
        except AttnserveError as e:
            answered = not outcome_unknown(e)  # NOT_FOUND included: closed already
        finally:
            self._header = None
            self._controls = None
            _release_ring(self._region, self._ring_key)
            with self._lock:
                self._close_answered = self._close_answered or answered

    def __enter__(self) -> "RequestChannel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
