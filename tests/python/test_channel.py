"""Request channels from Python (attnserve.channel, docs/transport.md
"Request channels"): Client.prefill's arguments, results and errors through
the ring of common/channel_layout.h, with no gRPC call; calls in flight at
once (more than the ring's slots); a channel the server closed; bad
arguments."""

import os

import numpy as np
import pytest

import attnserve
import attnserve.channel as attnserve_channel
from server import TestServer


@pytest.fixture(scope="module")
def server():
    with TestServer(extra_flags=["--allow_shared_memory"]) as s:
        yield s


class _Counter:
    """A client interceptor that counts the gRPC calls of each method."""

    def __init__(self):
        import grpc
        self.calls: dict = {}
        counter = self

        class Interceptor(grpc.UnaryUnaryClientInterceptor):
            def intercept_unary_unary(self, continuation, details, request):
                name = details.method.rsplit("/", 1)[-1]
                counter.calls[name] = counter.calls.get(name, 0) + 1
                return continuation(details, request)
        self.interceptor = Interceptor()


def test_channel_is_the_clients_prefill(server):
    """RequestChannel.prefill takes Client.prefill's arguments and gives its
    results and errors, with no gRPC call."""
    counter = _Counter()
    client = attnserve.Client(server.address, timeout=60, interceptors=[counter.interceptor])
    g = client.server_info
    region = attnserve.SharedMemoryRegion(1 << 20).register(client, "chan-test")
    try:
        ch = client.open_channel(region, 0, slot_count=2, slot_bytes=64 << 10)
        pages = client.allocate_pages(2)
        slots = [p * g.page_size + i for p in pages for i in range(g.page_size)]
        rng = np.random.default_rng(12)
        kv = rng.standard_normal((2, len(slots), g.num_kv_heads, g.head_dim), np.float32)
        client.write_kv(0, slots, kv[0], kv[1])
        q = rng.standard_normal((3, g.num_qo_heads, g.head_dim), np.float32)
        args = (0, q, [0, 3], [0, 2], pages, [g.page_size])
        expected = client.prefill(*args)
        grpc_prefills = counter.calls["Prefill"]
        r = ch.prefill(*args)
        assert np.array_equal(r.output, expected.output) and np.array_equal(r.lse, expected.lse)
        with pytest.raises(attnserve.InvalidArgument, match="kv_last_page_len"):
            ch.prefill(0, q, [0, 3], [0, 2], pages, [g.page_size + 1])
        calls = [ch.prefill_layout_async(0, q, attnserve.PrefillLayout.encode(
            [0, 3], [0, 2], pages, [g.page_size])) for _ in range(5)]   # more than its 2 slots
        for call in calls:
            assert np.array_equal(call.result().output, expected.output) and call.done()
        assert counter.calls["Prefill"] == grpc_prefills      # none of them over gRPC
        big = np.ones((200, g.num_qo_heads, g.head_dim), np.float32)
        with pytest.raises(attnserve.InvalidArgument, match="more than the channel's "
                                                            "slot_bytes=65536"):
            ch.prefill(0, big, [0, 200], [0, 2], pages, [g.page_size])
        # Closed by the server (CloseChannel from elsewhere): a call fails, no hang.
        client.close_channel(ch.id)
        with pytest.raises(attnserve.Unavailable, match="closed by the server"):
            ch.prefill(*args)
        ch.close()
        with pytest.raises(attnserve.FailedPrecondition, match="is closed"):
            ch.prefill(*args)
        with pytest.raises(ValueError, match="slot_count=0 out of range"):
            client.open_channel(region, 0, slot_count=0)
        with pytest.raises(ValueError, match="offset=8 must be >= 0 and a multiple of 64"):
            client.open_channel(region, 8)
        with pytest.raises(ValueError, match="the ring needs"):
            client.open_channel(region, 0, slot_count=64, slot_bytes=1 << 20)
        client.free_pages(pages)
    finally:
        region.close(client)
        client.close()


@pytest.mark.parametrize("fault", ["unreachable", "reply lost"])
def test_a_close_whose_outcome_is_unknown_is_sent_again(server, fault):
    """A CloseChannel that failed with its outcome unknown: one that never
    left kept the channel open on the server, and close() never sent it
    again (idempotent at once), so the channel held one of the tenant's
    --max_channels_per_tenant until its region went. The next close() now
    sends it again; after a lost reply its NOT_FOUND is a success."""
    from faults import REPLY_LOST, UNREACHABLE, FaultInjector
    faults = FaultInjector(1)
    client = attnserve.Client(server.address, timeout=60, interceptors=faults.interceptors)
    region = attnserve.SharedMemoryRegion(1 << 20).register(client, "chan-close")

    def open_channels():
        return len(client.list_holdings().unleased.channels)
    try:
        ch = client.open_channel(region, 0, slot_count=2, slot_bytes=64 << 10)
        before = open_channels()
        faults.fail_next("CloseChannel", UNREACHABLE if fault == "unreachable" else REPLY_LOST)
        ch.close()
        assert ch.closed
        assert open_channels() == (before if fault == "unreachable" else before - 1)
        ch.close()
        assert open_channels() == before - 1
        calls = dict(faults.calls)
        ch.close()                                   # answered: nothing more is sent
        assert faults.calls == calls
    finally:
        region.close(client)
        client.close()


def test_one_ring_never_has_two_channels(server):
    """An OpenChannel whose reply was lost left a channel the client had no
    id for; the retry on the same bytes opened a second one there, and both
    of the server's pollers took each request: answers went to the wrong
    calls (another request's rows, without an error). The server now refuses
    a ring that overlaps an open channel's, naming it, and the client
    refuses, before writing anything, bytes one of its own open channels
    polls."""
    from faults import REPLY_LOST, FaultInjector
    faults = FaultInjector(1)
    client = attnserve.Client(server.address, timeout=60, interceptors=faults.interceptors)
    g = client.server_info
    region = attnserve.SharedMemoryRegion(1 << 20).register(client, "chan-twice")
    try:
        pages, rng = _decode_setup(client)
        q = rng.standard_normal((3, g.num_qo_heads, g.head_dim), np.float32)
        args = (1, q, [0, 3], [0, 1], pages, [g.page_size])
        expected = client.prefill(*args)
        before = set(client.list_holdings().unleased.channels)
        faults.fail_next("OpenChannel", REPLY_LOST)
        with pytest.raises(attnserve.DeadlineExceeded):
            client.open_channel(region, 0, slot_count=2, slot_bytes=64 << 10)
        (orphan,) = set(client.list_holdings().unleased.channels) - before
        with pytest.raises(attnserve.FailedPrecondition,
                           match=f"overlap the ring of open channel {orphan:016x}"):
            client.open_channel(region, 0, slot_count=2, slot_bytes=64 << 10)
        client.close_channel(orphan)
        ch = client.open_channel(region, 0, slot_count=2, slot_bytes=64 << 10)
        # A second channel of this client on the same bytes: refused before
        # its header is written, so the first one's calls are untouched.
        with pytest.raises(ValueError, match=f"overlap the ring of open channel {ch.id}"):
            client.open_channel(region, 1024, slot_count=2, slot_bytes=64 << 10)
        for _ in range(20):
            r = ch.prefill(*args)
            assert np.array_equal(r.output, expected.output)
        ch.close()
        again = client.open_channel(region, 0, slot_count=2, slot_bytes=64 << 10)  # free again
        assert np.array_equal(again.prefill(*args).output, expected.output)
        again.close()
        client.free_pages(pages)
    finally:
        region.close(client)
        client.close()


def test_a_call_after_the_clients_close_raises_cancelled(server):
    """A channel call after Client.close() went out anyway, and with the
    server gone it waited forever (its probe's own Cancelled read as "the
    server is still there")."""
    client = attnserve.Client(server.address, timeout=60)
    g = client.server_info
    region = attnserve.SharedMemoryRegion(1 << 20).register(client, "chan-closed")
    pages, rng = _decode_setup(client)
    ch = client.open_channel(region, 0, slot_count=2, slot_bytes=64 << 10)
    q = rng.standard_normal((1, g.num_qo_heads, g.head_dim), np.float32)
    ch.prefill(1, q, [0, 1], [0, 1], pages, [g.page_size])
    ch.close()
    client.free_pages(pages)
    region.close(client)
    ch2_client = attnserve.Client(server.address, timeout=60)
    region2 = attnserve.SharedMemoryRegion(1 << 20).register(ch2_client, "chan-closed2")
    pages2, _ = _decode_setup(ch2_client)
    ch2 = ch2_client.open_channel(region2, 0, slot_count=2, slot_bytes=64 << 10)
    ch2_client.free_pages(pages2)
    ch2_client.close()
    with pytest.raises(attnserve.Cancelled, match="the client is closed"):
        ch2.prefill(1, q, [0, 1], [0, 1], pages2, [g.page_size])
    client.close()


def _decode_setup(client):
    g = client.server_info
    pages = client.allocate_pages(1)
    slots = [pages[0] * g.page_size + i for i in range(g.page_size)]
    rng = np.random.default_rng(14)
    kv = rng.standard_normal((2, len(slots), g.num_kv_heads, g.head_dim), np.float32)
    client.write_kv(1, slots, kv[0], kv[1])
    return pages, rng


def test_threads_share_a_channel(server):
    import threading
    with attnserve.Client(server.address, timeout=60) as client:
        g = client.server_info
        region = attnserve.SharedMemoryRegion(1 << 20).register(client, "chan-threads")
        ch = client.open_channel(region, 0, slot_count=2, slot_bytes=16 << 10)
        pages, rng = _decode_setup(client)
        qs = [rng.standard_normal((2, g.num_qo_heads, g.head_dim), np.float32)
              for _ in range(4)]
        expected = [client.prefill(1, q, [0, 1, 2], [0, 1, 1], pages, [g.page_size, 0])
                    for q in qs]
        failures = []

        def worker(i):
            for _ in range(10):
                r = ch.prefill(1, qs[i], [0, 1, 2], [0, 1, 1], pages, [g.page_size, 0])
                if not np.array_equal(r.output, expected[i].output):
                    failures.append(i)
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not failures
        ch.close()
        region.close(client)
        client.free_pages(pages)


def test_a_dead_server_fails_the_call_instead_of_hanging():
    import os
    import signal
    with TestServer(extra_flags=["--allow_shared_memory"]) as s:
        client = attnserve.Client(s.address, timeout=60)
        g = client.server_info
        region = attnserve.SharedMemoryRegion(1 << 20).register(client, "chan-dead")
        ch = client.open_channel(region, 0, slot_count=1, slot_bytes=16 << 10)
        pages, rng = _decode_setup(client)
        q = rng.standard_normal((1, g.num_qo_heads, g.head_dim), np.float32)
        ch.prefill(1, q, [0, 1], [0, 1], pages, [g.page_size])
        os.kill(s.pid, signal.SIGKILL)
        s.stop()
        # Nothing polls the ring any more: the wait's probe of the server says so.
        with pytest.raises(attnserve.Unavailable, match="does not answer"):
            ch.prefill(1, q, [0, 1], [0, 1], pages, [g.page_size])
        # Every slot now waits for an answer that never came.
        with pytest.raises(attnserve.Unavailable, match="open a new channel"):
            ch.prefill(1, q, [0, 1], [0, 1], pages, [g.page_size])
        ch.close(timeout=1)
        region.close()
        client.close()


def test_an_interrupted_wait_abandons_its_slot_instead_of_wedging_it(monkeypatch):
    """A KeyboardInterrupt while a call waits for its answer (the server is
    stopped meanwhile) abandons the call's slot: once the answer comes the
    slot is free again, and the next call runs (before, the slot stayed the
    interrupted call's for good, and the next call spun until its
    deadline, or for ever without one)."""
    import os
    import signal
    import threading
    with TestServer(extra_flags=["--allow_shared_memory"]) as s:
        client = attnserve.Client(s.address, timeout=60)
        g = client.server_info
        region = attnserve.SharedMemoryRegion(1 << 20).register(client, "chan-interrupt")
        ch = client.open_channel(region, 0, slot_count=1, slot_bytes=16 << 10)
        pages, rng = _decode_setup(client)
        q = rng.standard_normal((1, g.num_qo_heads, g.head_dim), np.float32)
        args = (1, q, [0, 1], [0, 1], pages, [g.page_size])
        expected = ch.prefill(*args).output
        # The wait's probe of the stopped server would end the call as
        # UNAVAILABLE if a loaded host delayed the interrupt past it.
        monkeypatch.setattr(attnserve_channel, "_PROBE_EVERY_S", 600.0)
        s.pause()                                             # no answer for now
        timer = threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT))
        timer.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                ch.prefill(*args)
        finally:
            s.resume()                                        # the answer comes
        assert np.array_equal(ch.prefill(*args, timeout=20).output, expected)
        ch.close(timeout=10)
        region.close(client)
        client.free_pages(pages)
        client.close()


def _rss_anon(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon")


@pytest.mark.skipif(os.environ.get("ATTNSERVE_SANITIZED") == "1",
                    reason="AddressSanitizer quarantines freed memory instead of giving it back")
def test_an_idle_channel_keeps_no_copy_of_its_large_requests():
    """The server copies each request out of its slot. A slot keeps that
    copy's buffer for the next request only up to 256 KiB (docs/transport.md,
    "What it costs"), so after 4 MiB requests in each of 16 slots the idle
    channel holds no 64 MiB of the server's memory."""
    with TestServer(extra_flags=["--allow_shared_memory"]) as server:
        client = attnserve.Client(server.address, timeout=60)
        slot_bytes, slots = 4 << 20, 16
        region = attnserve.SharedMemoryRegion(
            attnserve_channel.channel_bytes(slots, slot_bytes)).register(client, "big")
        try:
            ch = client.open_channel(region, 0, slot_count=slots, slot_bytes=slot_bytes)
            g = client.server_info
            before = _rss_anon(server._proc.pid)
            # 3 MiB of queries over a page never allocated: refused once the
            # server has copied the request out of its slot and checked it.
            rows = (3 << 20) // (g.num_qo_heads * g.head_dim * 2)
            q = np.ones((rows, g.num_qo_heads, g.head_dim), np.float32)
            layout = attnserve.PrefillLayout.encode([0, rows], [0, 1], [g.num_pages - 1], [1])
            calls = [ch.prefill_layout_async(0, q, layout) for _ in range(slots)]
            for call in calls:
                with pytest.raises(attnserve.AttnserveError, match="kv_indices"):
                    call.result()
            grown = _rss_anon(server._proc.pid) - before
            assert grown < (32 << 20), f"the idle channel holds {grown >> 20} MiB of the server's memory"
            ch.close()
        finally:
            region.close(client)
            client.close()
