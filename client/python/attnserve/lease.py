"""Leases kept alive in the background (docs/security.md, "Leases").

    client = attnserve.Client("127.0.0.1:50051")
    with attnserve.Lease(client) as lease:     # grants one, renews it every ttl/3
        pages = client.allocate_pages(4)        # held under the lease
        ...
    # revoked on exit: the pages are freed. If the process dies instead, the
    # server frees them within the lease's ttl.

The server is the authority on what expired: a renewal refused because the
lease is gone stops the keeper (`expired` turns true, `error` says why), and
every request naming the lease raises attnserve.LeaseExpired. A server found
restarted, which ended every lease, stops it too (`error` is the
StaleIncarnation; `expired` stays false: the restart is what to act on).
A client that was closed stops it (`error` is the Cancelled). Other failed
renewals (server unreachable, a reconnect() in progress) are retried every
quarter period, the last one's error in `error` until a renewal succeeds.

AsyncLease is the same for an AsyncClient, renewing from an asyncio task.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Optional

from attnserve.errors import AttnserveError, LeaseExpired, StaleIncarnation


def _after_failed_renewal(lease, e: Exception, period: float) -> Optional[float]:
    """Records why a renewal of `lease` failed (its `error`); the wait before
    the next one, or None when renewing is over: the lease is gone, the
    server restarted (which ended every lease) or the client was closed.
    Anything else (the server unreachable, a reconnect() in progress, an
    error that is not the server's answer) is tried again every quarter
    period."""
    lease.error = e
    if isinstance(e, (LeaseExpired, StaleIncarnation)):
        return None
    if isinstance(e, AttnserveError) and lease._client._closed:
        return None
    return max(period / 4.0, 0.05)


class Lease:
    """A lease on `client`, made the client's lease (client.use_lease) and
    renewed from a daemon thread until close() (or the with block's end),
    which revokes it."""

    def __init__(self, client, ttl: Optional[float] = None):
        self._client = client
        grant = client.grant_lease(ttl)
        self.lease_id = grant.lease_id
        self.ttl = grant.ttl
        self.error: Optional[Exception] = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._renewal = None  # the KeepAlive in flight, which _halt() cancels
        client.use_lease(self.lease_id)
        self._thread = threading.Thread(target=self._run, name=f"attnserve-lease-{self.lease_id:x}",
                                        daemon=True)
        self._thread.start()

    @property
    def expired(self) -> bool:
        """True once the server refused a renewal because the lease is gone."""
        return isinstance(self.error, LeaseExpired)

    def _run(self) -> None:
        period = max(self.ttl / 3.0, 0.05)
        wait = period
        while not self._stop.wait(wait):
            try:
                # A renewal may take up to the whole ttl; _halt() cancels it.
                call = self._client._call_future(self._client._req_keep_alive(self.lease_id),
                                                 self.ttl)
                with self._lock:
                    self._renewal = call
                if self._stop.is_set():
                    call.cancel()
                try:
                    call.result()
                finally:
                    with self._lock:
                        self._renewal = None
                wait = period
                self.error = None
            except Exception as e:
                wait = _after_failed_renewal(self, e, period)
                if wait is None:
                    return

    def _halt(self) -> None:
        """Stops renewing: a renewal in flight is cancelled (on a server that
        does not answer it would wait up to the ttl), the thread joined."""
        self._stop.set()
        with self._lock:
            if self._renewal is not None:
                self._renewal.cancel()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def abandon(self) -> None:
        """Stops renewing without an RPC: the server releases everything under
        the lease within its ttl (for a server that restarted or cannot be
        reached, where a revocation would fail or wait). Idempotent."""
        self._halt()
        if self._client.lease_id == self.lease_id:
            self._client.use_lease(0)

    def close(self) -> None:
        """Stops renewing and revokes the lease (best effort: an unreachable
        server lets it expire). Idempotent."""
        if self._stop.is_set():
            return
        self._halt()
        if not self.expired:
            try:
                self._client.revoke_lease(self.lease_id)
            except AttnserveError:
                pass
        if self._client.lease_id == self.lease_id:
            self._client.use_lease(0)

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncLease:
    """Lease for an AsyncClient: `lease = await AsyncLease.start(client)`,
    renewed from an asyncio task until `await lease.close()`."""

    def __init__(self, client, lease_id: int, ttl: float):
        self._client = client
        self.lease_id = lease_id
        self.ttl = ttl
        self.error: Optional[Exception] = None
        self._task: Optional[asyncio.Task] = None

    @classmethod
    async def start(cls, client, ttl: Optional[float] = None) -> "AsyncLease":
        grant = await client.grant_lease(ttl)
        lease = cls(client, grant.lease_id, grant.ttl)
        client.use_lease(grant.lease_id)
        lease._task = asyncio.get_running_loop().create_task(lease._run())
        return lease

    @property
    def expired(self) -> bool:
        return isinstance(self.error, LeaseExpired)

    async def _run(self) -> None:
        period = max(self.ttl / 3.0, 0.05)
        wait = period
        while True:
            await asyncio.sleep(wait)
            try:
                await self._client.keep_alive(self.lease_id, timeout=self.ttl)
                wait = period
                self.error = None
            except Exception as e:
                wait = _after_failed_renewal(self, e, period)
                if wait is None:
                    return

    def abandon(self) -> None:
        """Stops renewing without an RPC (as Lease.abandon)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
        if self._client.lease_id == self.lease_id:
            self._client.use_lease(0)

    async def close(self) -> None:
        if self._task is None:
            return
        task, self._task = self._task, None
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        if not self.expired:
            try:
                await self._client.revoke_lease(self.lease_id)
            except AttnserveError:
                pass
        if self._client.lease_id == self.lease_id:
            self._client.use_lease(0)
