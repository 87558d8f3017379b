"""Shared-memory regions from Python (numpy over sealed memfds) against a
real CPU server with --allow_shared_memory: every tensor of write_kv,
read_kv, prefill and merge_states through a region, checked against the
float64 reference and the same call sent inline; errors and ownership; a
region that cannot shrink under the server, and registration by shm key
refused."""

import os
from multiprocessing import shared_memory

import numpy as np
import pytest

import attnserve
from attnserve import dtypes as dt
from attnserve.reference import (KvMirror, compare, reference_merge, reference_prefill,
                                 within_tolerance)
from attnserve.regions import SharedMemoryRegion
from attnserve.v1 import attention_pb2 as pb
from server import TestServer


@pytest.fixture(scope="module")
def server():
    with TestServer(extra_flags=["--allow_shared_memory", "--max_regions_per_tenant=4"]) as s:
        yield s


@pytest.fixture
def client(server):
    c = attnserve.Client(server.address, timeout=120)
    yield c
    for r in c.list_regions():
        c.unregister_region(r.name)
    c.close()


def bits(rng, shape):
    """Random bf16 values as their uint16 bits."""
    return dt.float32_to_bf16_bits(rng.standard_normal(shape).astype(np.float32))


def test_prefill_write_read_through_a_region_match_the_reference(client):
    g = client.server_info
    rng = np.random.default_rng(11)
    pages = client.allocate_pages(5)
    slots = [p * g.page_size + i for p in pages[:4] for i in range(g.page_size)]
    n = len(slots)
    row = (g.num_kv_heads, g.head_dim)
    total_q = 13
    q_shape, lse_shape = (total_q, g.num_qo_heads, g.head_dim), (total_q, g.num_qo_heads)
    with SharedMemoryRegion(1 << 20) as region:
        region.register(client, "py-io")
        # K/V in through the region.
        k_at, v_at = 0, n * 2 * g.num_kv_heads * g.head_dim
        region.array(k_at, (n, *row), "bf16")[...] = k = bits(rng, (n, *row))
        region.array(v_at, (n, *row), "bf16")[...] = v = bits(rng, (n, *row))
        client.write_kv(0, slots, region.tensor(k_at, (n, *row), "bf16"),
                        region.tensor(v_at, (n, *row), "bf16"))
        mirror = KvMirror(g.num_kv_heads, g.head_dim)
        mirror.write(0, slots, k, v)
        # Prefill: q and two appended rows from the region, output and LSE into it.
        q_at, ak_at, av_at, o_at, lse_at = 262144, 300000, 301000, 400000, 600000
        region.array(q_at, q_shape, "bf16")[...] = q = bits(rng, q_shape)
        region.array(ak_at, (2, *row), "bf16")[...] = ak = bits(rng, (2, *row))
        region.array(av_at, (2, *row), "bf16")[...] = av = bits(rng, (2, *row))
        append_slots = [pages[4] * g.page_size, pages[4] * g.page_size + 1]
        qo, kv, idx, last = [0, 6, 13], [0, 2, 4], pages[:4], [16, 9]
        r = client.prefill(0, region.tensor(q_at, q_shape, "bf16"), qo, kv, idx, last,
                           append_slots=append_slots,
                           append_k=region.tensor(ak_at, (2, *row), "bf16"),
                           append_v=region.tensor(av_at, (2, *row), "bf16"),
                           output_to=(region.tensor(o_at, q_shape, "bf16"),
                                      region.tensor(lse_at, lse_shape, "fp32")))
        assert r.output is None and r.lse is None
        mirror.write(0, append_slots, ak, av)
        o = dt.bf16_bits_to_float32(region.array(o_at, q_shape, "bf16").copy()).reshape(q_shape)
        lse = region.array(lse_at, lse_shape, "fp32").copy()
        o_ref, lse_ref = reference_prefill(mirror, 0, q, qo, kv, idx, last, page_size=g.page_size)
        assert within_tolerance(compare(o_ref, lse_ref, o, lse))
        inline = client.prefill(0, attnserve.RawBits(q, "bf16"), qo, kv, idx, last, out="numpy")
        assert np.array_equal(inline.output, o) and np.array_equal(inline.lse, lse)
        # read_kv into the region: the appended rows, bit for bit.
        back_k, back_v = 700000, 710000
        assert client.read_kv(0, append_slots,
                              into=(region.tensor(back_k, (2, *row), "bf16"),
                                    region.tensor(back_v, (2, *row), "bf16"))) is None
        assert np.array_equal(region.array(back_k, (2, *row), "bf16"), ak)
        assert np.array_equal(region.array(back_v, (2, *row), "bf16"), av)
        info = client.list_regions()
        assert [(i.name, i.kind, i.key, i.byte_size, i.key_exists) for i in info] == \
            [("py-io", "system", region.key, 1 << 20, True)]
        region.close(client)
    assert client.list_regions() == []
    client.free_pages(pages)


def test_merge_states_through_a_region(client):
    rng = np.random.default_rng(4)
    n, h, d = 5, 8, 64
    states = [(rng.standard_normal((n, h, d)).astype(np.float32),
               (rng.standard_normal((n, h)) * 3).astype(np.float32)) for _ in range(3)]
    states[0][1][1, :] = -np.inf
    with SharedMemoryRegion(1 << 18) as region:
        region.register(client, "py-merge")
        refs, at = [], 0
        for v, lse in states:
            region.array(at, (n, h, d), "bf16")[...] = dt.float32_to_bf16_bits(v)
            region.array(at + n * h * d * 2, (n, h), "fp32")[...] = lse
            refs.append((region.tensor(at, (n, h, d), "bf16"),
                         region.tensor(at + n * h * d * 2, (n, h), "fp32")))
            at += n * h * d * 2 + n * h * 4
        out_v, out_lse = region.tensor(at, (n, h, d), "bf16"), region.tensor(at + n * h * d * 2,
                                                                             (n, h), "fp32")
        assert client.merge_states(refs, into=(out_v, out_lse)) is None
        v = dt.bf16_bits_to_float32(region.array(at, (n, h, d), "bf16").copy()).reshape(n, h, d)
        lse = region.array(at + n * h * d * 2, (n, h), "fp32").copy()
        v_ref, lse_ref = reference_merge(states)
        assert within_tolerance(compare(v_ref, lse_ref, v, lse))
        inline_v, inline_lse = client.merge_states(states)
        assert np.array_equal(inline_v, v) and np.array_equal(inline_lse, lse)
        region.close(client)


def test_bad_references_raise_typed_errors_and_change_nothing(client, server):
    g = client.server_info
    rng = np.random.default_rng(9)
    pages = client.allocate_pages(1)
    slots = [pages[0] * g.page_size]
    k = attnserve.RawBits(bits(rng, (1, g.num_kv_heads, g.head_dim)), "bf16")
    client.write_kv(0, slots, k, k)
    shape = (1, g.num_kv_heads, g.head_dim)
    with SharedMemoryRegion(4096) as region:
        region.register(client, "py-bad")
        with pytest.raises(attnserve.NotFound, match="k.region.name: region 'nope'"):
            client.write_kv(0, slots, attnserve.RegionTensor("nope", 0, shape, "bf16"),
                            region.tensor(0, shape, "bf16"))
        with pytest.raises(attnserve.InvalidArgument, match=r"k.region.offset \+ k.region.byte_size"):
            client.write_kv(0, slots, attnserve.RegionTensor("py-bad", 4000, shape, "bf16"),
                            region.tensor(0, shape, "bf16"))
        with pytest.raises(attnserve.InvalidArgument, match="multiple of 2 bytes"):
            client.write_kv(0, slots, attnserve.RegionTensor("py-bad", 1, shape, "bf16"),
                            region.tensor(0, shape, "bf16"))
        with pytest.raises(attnserve.InvalidArgument, match="overlaps"):
            client.read_kv(0, slots, into=(region.tensor(0, shape, "bf16"),
                                           region.tensor(2, shape, "bf16")))
        # The same memfd under a second name is the same memory: an output
        # there that overlaps an input named through the first is refused.
        client.register_system_region("py-bad-alias", region.fd, region.size)
        with pytest.raises(attnserve.InvalidArgument,
                           match=r"v_region \[2, 258\) overlaps k_region of region 'py-bad', "
                                 r"the same memory as region 'py-bad-alias'"):
            client.read_kv(0, slots, into=(region.tensor(0, shape, "bf16"),
                                           attnserve.RegionTensor("py-bad-alias", 2, shape,
                                                                  "bf16")))
        client.unregister_region("py-bad-alias")
        with pytest.raises(attnserve.AlreadyExists):
            region.register(client, "py-bad")
        with pytest.raises(ValueError, match="both or neither"):
            client.read_kv(0, slots, into=(region.tensor(0, shape, "bf16"),))
        # Another tenant is another token: without auth every caller is one
        # tenant, so ownership is tested by the C++ integration test.
        rk, _ = client.read_kv(0, slots, out="raw")
        assert np.array_equal(rk, k.bits)  # nothing changed
    client.free_pages(pages)
    # The with-block closed the region without unregistering it (as a client
    # that exits does): its holder connection closed, and the next list
    # reclaims it.
    assert client.list_regions() == []
    with pytest.raises(attnserve.NotFound):
        client.unregister_region("py-bad")


def _register_by_key(client, name, key, size):
    req = pb.RegisterRegionRequest(name=name, system=pb.SystemRegion(key=key, byte_size=size))
    return client._call(("RegisterRegion", req.SerializeToString(), lambda raw: None), None)


def test_registration_by_shm_key_is_refused_and_cannot_crash_the_server(client, server):
    """A POSIX shm object by key: refused, naming the field. A server that
    still takes keys dies of SIGBUS when the object shrinks (this test then
    fails)."""
    g = client.server_info
    pages = client.allocate_pages(1)
    slots = [pages[0] * g.page_size]
    row = g.num_kv_heads * g.head_dim * 2
    posix = shared_memory.SharedMemory(create=True, size=4096)
    try:
        with pytest.raises(attnserve.InvalidArgument,
                           match="system.key: registration by POSIX shm name was removed"):
            _register_by_key(client, "py-key", "/" + posix.name, 4096)
            # Taken: shrink the object under the server, then read it.
            os.ftruncate(posix._fd, 0)
            shape = (1, g.num_kv_heads, g.head_dim)
            client.write_kv(0, slots, attnserve.RegionTensor("py-key", 4096 - row, shape, "bf16"),
                            attnserve.RegionTensor("py-key", 4096 - row, shape, "bf16"))
    finally:
        posix.close()
        posix.unlink()
    assert server.alive(), server.output()
    assert client.health() == "SERVING"
    assert client.list_regions() == []
    client.free_pages(pages)


def test_a_region_cannot_shrink_under_the_server(client, server):
    g = client.server_info
    rng = np.random.default_rng(2)
    pages = client.allocate_pages(1)
    slots = [pages[0] * g.page_size]
    shape = (1, g.num_kv_heads, g.head_dim)
    with SharedMemoryRegion(3 * 4096) as region:
        region.register(client, "py-shrink")
        at = 3 * 4096 - 2 * g.num_kv_heads * g.head_dim  # the last bytes of the last page
        region.array(at, shape, "bf16")[...] = k = bits(rng, shape)
        for size in (0, 4096, 4 * 4096):  # neither shrinks nor grows
            with pytest.raises(PermissionError):
                os.ftruncate(region.fd, size)
        client.write_kv(0, slots, region.tensor(at, shape, "bf16"),
                        region.tensor(at, shape, "bf16"))
        rk, rv = client.read_kv(0, slots, out="raw")
        assert np.array_equal(rk, k) and np.array_equal(rv, k)
        assert server.alive()
        region.close(client)
    client.free_pages(pages)


def test_only_sealed_memfds_are_taken(client):
    """A memfd that may shrink is refused by the region socket, naming the
    seal; nothing is registered; a sealed one then works."""
    fd = os.memfd_create("py-unsealed", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, 4096)
        with pytest.raises(attnserve.InvalidArgument,
                           match=f"region socket {client.server_info.region_socket}: the memfd is "
                                 "not sealed against shrinking"):
            client.register_system_region("py-unsealed", fd, 4096)
    finally:
        os.close(fd)
    with pytest.raises(attnserve.NotFound, match="no memfd is deposited under this token"):
        req = pb.RegisterRegionRequest(name="py-unsealed",
                                       system=pb.SystemRegion(claim_token=bytes(16), byte_size=8))
        client._call(("RegisterRegion", req.SerializeToString(), lambda raw: None), None)
    assert client.list_regions() == []
    with SharedMemoryRegion(4096) as region:
        region.register(client, "py-sealed")
        [info] = client.list_regions()
        assert (info.name, info.key, info.key_exists) == ("py-sealed", region.key, True)
        region.close(client)


def test_the_async_client_registers_regions_too(server):
    import asyncio

    async def run():
        async with attnserve.AsyncClient(server.address, timeout=60) as c:
            with SharedMemoryRegion(4096) as region:
                await c.register_system_region("py-aio", region.fd, 4096)
                [info] = await c.list_regions()
                assert info.name == "py-aio" and info.key_exists
                await c.unregister_region("py-aio")
            assert await c.list_regions() == []
    asyncio.run(run())


def test_close_after_a_lost_unregister_reply_unmaps_the_region(server):
    """An UnregisterRegion whose reply is lost leaves the region registered
    in the client's view; the next close(client) gets NotFound (the server
    did unregister it) and must unmap and close the memfd, not raise for
    ever (sync and async)."""
    import asyncio

    from faults import REPLY_LOST, FaultInjector

    faults = FaultInjector(1)
    c = attnserve.Client(server.address, timeout=60, interceptors=faults.interceptors)
    try:
        region = SharedMemoryRegion(1 << 16).register(c, "py-lost")
        fd = region.fd
        faults.fail_next("UnregisterRegion", REPLY_LOST)
        with pytest.raises(attnserve.DeadlineExceeded):
            region.close(c)
        assert region.name == "py-lost" and os.path.exists(f"/proc/self/fd/{fd}")
        assert c.list_regions() == []  # the server did unregister it
        region.close(c)
        assert region.name is None and region.fd == -1
        with pytest.raises(ValueError, match="register"):
            region.tensor(0, (1,), "fp32")
    finally:
        c.close()

    async def run():
        async with attnserve.AsyncClient(server.address, timeout=60,
                                         interceptors=faults.aio_interceptors) as ac:
            region = SharedMemoryRegion(4096)
            await ac.register_system_region("py-lost-aio", region.fd, 4096)
            region.name = "py-lost-aio"
            faults.fail_next("UnregisterRegion", REPLY_LOST)
            with pytest.raises(attnserve.DeadlineExceeded):
                await region.close_async(ac)
            assert region.name == "py-lost-aio" and await ac.list_regions() == []
            await region.close_async(ac)
            assert region.name is None and region.fd == -1
    asyncio.run(run())


def test_regions_are_off_without_the_flag():
    with TestServer() as s, attnserve.Client(s.address, timeout=60) as c:
        with SharedMemoryRegion(4096) as region:
            with pytest.raises(attnserve.FailedPrecondition, match="--allow_shared_memory"):
                region.register(c, "x")
        assert c.list_regions() == []


def test_cuda_regions_are_refused_by_the_cpu_backend(client):
    handle = bytes(range(64))
    with pytest.raises(attnserve.FailedPrecondition, match="cpu backend"):
        client.register_cuda_region("py-gpu", handle, 0, 4096)
    with pytest.raises(attnserve.InvalidArgument, match="cuda.ipc_handle has 10 bytes"):
        client.register_cuda_region("py-gpu", handle[:10], 0, 4096)
    with pytest.raises(attnserve.InvalidArgument, match="cuda.device_id=-1"):
        client.register_cuda_region("py-gpu", handle, -1, 4096)
    with pytest.raises(attnserve.InvalidArgument, match="cuda.byte_size=0"):
        client.register_cuda_region("py-gpu", handle, 0, 0)
    assert client.list_regions() == []


def test_cuda_ipc_handle_needs_a_contiguous_cuda_tensor():
    torch = pytest.importorskip("torch")
    from attnserve.regions import cuda_ipc_handle
    with pytest.raises(ValueError, match="CUDA torch tensor"):
        cuda_ipc_handle(torch.zeros(4))
    with pytest.raises(ValueError, match="CUDA torch tensor"):
        cuda_ipc_handle(np.zeros(4))


# ---------------------------------------------------------------- descriptors that block
def _lingering_tcp():
    """A TCP socket whose close() blocks for an hour: SO_LINGER 3600 s and a
    send queue that cannot drain (its peer, returned to be kept open, never
    reads)."""
    import socket
    import struct
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    sender = socket.socket()
    sender.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    sender.connect(listener.getsockname())
    peer, _ = listener.accept()
    sender.setblocking(False)
    try:
        while True:
            sender.send(b"x" * 65536)
    except BlockingIOError:
        pass
    sender.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 3600))
    return sender, (listener, peer)


def _send_fd(conn, data: bytes, fd: int) -> None:
    import array
    import socket
    conn.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])


def test_descriptors_a_client_hands_the_region_socket_never_block_the_server():
    """A local process can hand the server descriptors whose close() blocks
    (a TCP socket lingering over data its peer never reads): as a deposit,
    which is refused; queued, unread, on an accepted deposit's connection,
    which the server closes when the client hangs up; or on a registered
    region's connection, closed when the lease holding the region is
    revoked. The server closes them on closer threads of their own: the
    region socket, the lease table and every tenant's calls go on (before,
    each of the three blocked a serving thread, and the lease's under the
    lock every AllocatePages and RegisterRegion takes)."""
    import fcntl
    import socket
    import struct
    import time
    keep = []
    with TestServer(extra_flags=["--allow_shared_memory"]) as server:
        c = attnserve.Client(server.address, timeout=20)
        path = c.server_info.region_socket
        assert path.startswith("@")

        def connect():
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            conn.settimeout(10)
            conn.connect("\0" + path[1:])
            conn.recv(64)                                    # the hello
            return conn

        def deposit(conn, fd):
            _send_fd(conn, struct.pack("<II16s", 0x47455241, 1, os.urandom(16)), fd)
            return struct.unpack_from("<i", conn.recv(2048))[0]

        def poison(conn):
            sender, peers = _lingering_tcp()
            keep.append(peers)
            _send_fd(conn, b"poison", sender.fileno())
            sender.close()                                   # the queued copy is the only one

        # A deposit whose descriptor is the lingering socket: refused.
        conn = connect()
        sender, peers = _lingering_tcp()
        keep.append(peers)
        assert deposit(conn, sender.fileno()) != 0
        sender.close()
        conn.close()
        # An accepted deposit whose connection then queues one, and hangs up.
        conn = connect()
        memfd = os.memfd_create("bait", os.MFD_ALLOW_SEALING)
        os.ftruncate(memfd, 4096)
        fcntl.fcntl(memfd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        assert deposit(conn, memfd) == 0
        os.close(memfd)
        poison(conn)
        conn.close()
        # A region under a lease, its connection poisoned, the lease revoked.
        lease = c.grant_lease(60)
        c.use_lease(lease.lease_id)
        SharedMemoryRegion(1 << 16).register(c, "leased")
        poison(c._region_holders["leased"])
        c.use_lease(0)
        c.revoke_lease(lease.lease_id, timeout=10)
        time.sleep(1.5)                                      # the deposit sweep has run
        other = attnserve.Client(server.address, timeout=10)
        region = SharedMemoryRegion(1 << 16).register(other, "after", timeout=10)
        pages = other.allocate_pages(1, timeout=10)
        other.revoke_lease(other.grant_lease(5, timeout=10).lease_id, timeout=10)
        assert other.health(timeout=5) == "SERVING"
        other.free_pages(pages)
        region.close(other)
        other.close()
        c.close()
    for listener, peer in keep:
        peer.close()
        listener.close()


def test_a_region_registers_on_a_restarted_server_once_the_incarnation_is_forgotten():
    """After a restart register_system_region is refused (StaleIncarnation)
    until forget_incarnation(); then it registers on the new server (before,
    the deposit kept naming the incarnation read at connect, for good)."""
    first = TestServer(extra_flags=["--allow_shared_memory"])
    address = first.address
    client = attnserve.Client(address, timeout=20)
    region = SharedMemoryRegion(4096).register(client, "io")
    assert first.stop() == 0
    with TestServer(extra_flags=["--allow_shared_memory", f"--listen={address}"]):
        with pytest.raises(attnserve.StaleIncarnation):
            client.register_system_region("io", region.fd, 4096)
        client.forget_incarnation()
        client.register_system_region("io", region.fd, 4096)
        assert [r.name for r in client.list_regions()] == ["io"]
        region.close(client)
    client.close()
