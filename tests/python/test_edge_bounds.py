"""What a connection and a caller may hold before and after authentication
(docs/security.md, "What hostile input costs"): request bodies without a
valid token are never buffered (the call is refused from its metadata), an
authenticated sender that stalls is cut off after --request_read_timeout_s,
and idle connections are closed after --connection_idle_timeout_s. The
hostile client is h2_flood.py (raw HTTP/2: bodies that stop half-way)."""

import json
import signal
import os
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import pytest

import attnserve
from server import TestServer

HERE = os.path.dirname(os.path.abspath(__file__))
MIB = 1 << 20


@pytest.fixture(scope="module")
def tokens():
    with tempfile.NamedTemporaryFile("w", suffix=".tokens", delete=False) as f:
        f.write("tok-a alice\n")
    yield f.name
    os.unlink(f.name)


class Flood:
    """h2_flood.py running against a server; ready() and done() return its JSON lines."""

    def __init__(self, address, *args):
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "h2_flood.py"), address, *map(str, args)],
            stdout=subprocess.PIPE, text=True)

    def _line(self):
        line = self.proc.stdout.readline()
        assert line, f"h2_flood exited early ({self.proc.wait()})"
        return json.loads(line)

    def ready(self):
        return self._line()

    def done(self):
        out = self._line()
        self.proc.wait(timeout=60)
        return out


def _works(server, token):
    client = attnserve.Client(server.address, token=token, timeout=30)
    g = client.server_info
    pages = client.allocate_pages(1)
    rng = np.random.default_rng(1)
    kv = rng.standard_normal((1, g.num_kv_heads, g.head_dim))
    client.write_kv(0, [pages[0] * g.page_size], kv, kv)
    q = rng.standard_normal((1, g.num_qo_heads, g.head_dim))
    client.prefill(0, q, [0, 1], [0, 1], pages, [1])
    client.free_pages(pages)
    client.close()


def test_bodies_without_a_token_are_never_buffered(tokens):
    with TestServer(extra_flags=[f"--auth_tokens_file={tokens}"]) as server:
        before = server.rss_bytes()
        # 16 connections x 16 calls, each claiming a 64 MiB message: before
        # the fix the server took each body whole before it checked the
        # token (+226 MiB for 4 such calls).
        flood = Flood(server.address, "--connections", 16, "--streams", 16, "--claim", 64 * MIB,
                      "--send_for", 3, "--hold", 1)
        ready = flood.ready()
        grown = server.rss_bytes() - before
        flood.done()
        assert ready["rejected"] == 256, ready
        assert grown <= 64 * MIB, f"the server holds {grown / MIB:.1f} MiB more for unauthenticated bodies"
        assert server.metric('attnserve_requests_total{code="UNAUTHENTICATED",method="Prefill",shape="prefill"}') == 256
        _works(server, "tok-a")


def test_an_authenticated_sender_that_stalls_is_cut_off(tokens):
    with TestServer(extra_flags=[f"--auth_tokens_file={tokens}", "--request_read_timeout_s=1"]) as server:
        flood = Flood(server.address, "--connections", 2, "--streams", 2, "--claim", 8 * MIB,
                      "--token", "tok-a", "--send_for", 0.5, "--hold", 3)
        ready = flood.ready()
        assert ready["rejected"] == 0, ready  # authenticated: being read
        done = flood.done()
        assert done["rejected"] == 4, done
        assert server.metric(
            'attnserve_requests_total{code="DEADLINE_EXCEEDED",method="Prefill",shape="prefill"}') == 4
        _works(server, "tok-a")


def test_idle_connections_are_closed(tokens):
    with TestServer(extra_flags=["--connection_idle_timeout_s=1"]) as server:
        flood = Flood(server.address, "--connections", 50, "--streams", 0, "--send_for", 0,
                      "--hold", 4)
        flood.ready()
        done = flood.done()
        assert done["closed"] == 50, done
        _works(server, None)


def test_an_unknown_method_is_unimplemented_without_reading_its_body(tokens):
    with TestServer() as server:
        flood = Flood(server.address, "--connections", 1, "--streams", 4, "--claim", 64 * MIB,
                      "--method", "NoSuchMethod", "--send_for", 1, "--hold", 0)
        ready = flood.ready()
        flood.done()
        assert ready["rejected"] == 4 and ready["sent"] < 8 * MIB, ready


def test_health_requests_must_arrive_at_once(tokens):
    """The health service answers without a token (probes), so its requests
    are bounded apart (server/grpc/health_service.h): a body that stalls is
    cut off within 250 ms, and the server holds at most what arrived by
    then. gRPC's default health service read each 256 MiB claim whole,
    for as long as the sender took (+2.3 GB for 16 such calls)."""
    with TestServer(extra_flags=[f"--auth_tokens_file={tokens}"]) as server:
        before = server.rss_bytes()
        flood = Flood(server.address, "--connections", 4, "--streams", 4, "--claim", 256 * MIB,
                      "--method", "/grpc.health.v1.Health/Check", "--send_for", 3, "--hold", 1)
        ready = flood.ready()
        grown = server.rss_bytes() - before
        flood.done()
        assert ready["rejected"] == 16, ready
        # What 16 streams can send in 250 ms on loopback, with room: far
        # below the 4 GiB claimed.
        assert grown <= 1024 * MIB, f"the server holds {grown / MIB:.1f} MiB more for health bodies"
        # Without a token, as a probe asks.
        import grpc
        from attnserve import _wire
        with grpc.insecure_channel(server.address) as channel:
            check = channel.unary_unary("/grpc.health.v1.Health/Check")
            assert _wire.health_status(check(_wire.health_request(""), timeout=10)) == "SERVING"
        client = attnserve.Client(server.address, token="tok-a")
        assert client.health() == "SERVING"
        assert client.health("attnserve.v1.AttentionService") == "SERVING"
        with pytest.raises(attnserve.NotFound, match="unknown service 'nope'"):
            client.health("nope")
        client.close()
        _works(server, "tok-a")


def test_health_watch_sends_the_status_and_its_change_at_a_drain():
    """Watch sends the status at once and again when a drain turns it
    NOT_SERVING; an unknown service is SERVICE_UNKNOWN."""
    import grpc
    from attnserve import _wire
    with TestServer() as server:
        channel = grpc.insecure_channel(server.address)
        watch = channel.unary_stream("/grpc.health.v1.Health/Watch")
        unknown = watch(_wire.health_request("nope"), timeout=10)
        assert _wire.health_status(next(unknown)) == "SERVICE_UNKNOWN"
        unknown.cancel()
        stream = watch(_wire.health_request(""), timeout=30)
        assert _wire.health_status(next(stream)) == "SERVING"
        server._proc.send_signal(signal.SIGTERM)
        assert _wire.health_status(next(stream)) == "NOT_SERVING"
        with pytest.raises(grpc.RpcError):
            next(stream)
        channel.close()


def test_idle_connections_to_metrics_do_not_stall_a_scrape():
    """Six connections to /metrics that send nothing hold its threads for at
    most 2 s (civetweb's default of 30 s let two of them stall every scrape
    past Prometheus's 10 s timeout)."""
    import socket
    with TestServer() as server:
        host, port = server.metrics_address.rsplit(":", 1)
        idle = [socket.create_connection((host, int(port))) for _ in range(6)]
        time.sleep(0.3)
        start = time.monotonic()
        assert server.metric("attnserve_kv_pages") >= 0
        assert time.monotonic() - start < 5.0
        for s in idle:
            s.close()


def test_a_tenants_plans_hold_at_most_their_bytes():
    """--max_plan_bytes_per_tenant bounds what CreatePlan keeps (a plan holds
    its layout's arrays, about 16 bytes a kv index and 48 a sequence, for up
    to --plan_idle_timeout_s, and the positions its requests check for
    written rows): 1,500 sequences of one query row that each list one page
    16 times (a shared prefix; 241 keys, within the cache's 16 x 16 rows a
    layer) take about 460 KB, so the third such plan passes 1 MiB."""
    with TestServer(num_pages=16, extra_flags=["--max_plan_bytes_per_tenant=1048576"]) as server:
        client = attnserve.Client(server.address, timeout=30)
        page = client.allocate_pages(1)[0]
        seqs, per = 1500, 16
        layout = dict(qo_indptr=list(range(seqs + 1)), kv_indptr=[per * b for b in range(seqs + 1)],
                      kv_indices=[page] * (seqs * per), kv_last_page_len=[1] * seqs)
        plans = [client.create_plan(**layout) for _ in range(2)]
        with pytest.raises(attnserve.ResourceExhausted,
                           match=r"the plan takes \d+ bytes of server memory and the tenant's 2 "
                                 r"plans hold \d+, at most 1048576 in all "
                                 r"\(--max_plan_bytes_per_tenant\)"):
            client.create_plan(**layout)
        client.release_plan(plans[0])
        plans[0] = client.create_plan(**layout)           # released bytes come back
        for plan_id in plans:
            client.release_plan(plan_id)
        client.close()
    for bad in ("--max_plan_bytes_per_tenant=1048575", "--max_plan_bytes_per_tenant=-1"):
        with pytest.raises(RuntimeError, match="must be at least 1048576"):
            TestServer(extra_flags=[bad]).stop()


def test_a_prefill_whose_caller_gave_up_stops_on_the_cpu_backend():
    """The CPU backend runs a request in groups of bounded work and stops
    once its caller has given up (docs/security.md, "What a request's work
    costs"): a Prefill of 1,024 rows x 32 heads over 32,768 keys (over ten
    seconds of two cores) whose deadline passes after 0.5 s stops there,
    attnserve_given_up_requests_total counts it, and the next request is
    answered instead of waiting for the rest."""
    flags = ["--check_kv_written=false"]  # unwritten rows read as zeros: the work is the same
    with TestServer(num_pages=2048, num_qo_heads=32, num_kv_heads=4, head_dim=128,
                    extra_flags=flags) as server:
        client = attnserve.Client(server.address, timeout=60)
        g = client.server_info
        pages = client.allocate_pages(2048)
        rng = np.random.default_rng(11)
        q = rng.standard_normal((1024, g.num_qo_heads, g.head_dim)).astype(np.float32)
        with pytest.raises(attnserve.DeadlineExceeded):
            client.prefill(0, q, [0, 1024], [0, 2048], pages, [16], causal=False, timeout=0.5)
        given_up = 'attnserve_given_up_requests_total'
        for _ in range(600):
            if server.metric(given_up) >= 1:
                break
            time.sleep(0.1)
        assert server.metric(given_up) == 1
        small = client.prefill(0, q[:2], [0, 2], [0, 1], pages[:1], [16], timeout=30)
        assert np.isfinite(small.lse).all()
        client.free_pages(pages)
        client.close()


def test_queued_and_running_requests_hold_at_most_max_queue_bytes():
    """--max_queue_bytes bounds the memory admitted requests hold (their
    messages and responses): while an 8 MiB Prefill runs (taken although it
    is larger than the 1 MiB budget: nothing else was held), a small one is
    RESOURCE_EXHAUSTED naming the flag; once the large one has ended (its
    caller gave up), the small one runs."""
    flags = ["--check_kv_written=false", "--max_queue_bytes=1048576"]
    with TestServer(num_pages=2048, num_qo_heads=32, num_kv_heads=4, head_dim=128,
                    extra_flags=flags) as server:
        client = attnserve.Client(server.address, timeout=60)
        g = client.server_info
        pages = client.allocate_pages(2048)
        q = np.random.default_rng(12).standard_normal(
            (1024, g.num_qo_heads, g.head_dim)).astype(np.float32)
        ended = []

        def large():
            try:
                client.prefill(0, q, [0, 1024], [0, 2048], pages, [16], causal=False, timeout=3)
            except attnserve.AttnserveError as e:
                ended.append(e)
        t = threading.Thread(target=large)
        t.start()
        admitted = 'attnserve_request_stage_seconds_count{stage="admit"}'
        for _ in range(600):                   # until the large one is queued or running
            if server.metric(admitted) >= 1:
                break
            time.sleep(0.05)
        with pytest.raises(attnserve.ResourceExhausted,
                           match=r"queue full: queued and running requests and unsent responses hold \d+ bytes of "
                                 r"server memory and this one would add \d+, "
                                 r"max_queue_bytes=1048576"):
            client.prefill(0, q[:2], [0, 2], [0, 1], pages[:1], [16])
        t.join()
        assert isinstance(ended[0], attnserve.DeadlineExceeded), ended
        for _ in range(600):                   # the large one's bytes come back
            try:
                small = client.prefill(0, q[:2], [0, 2], [0, 1], pages[:1], [16])
                break
            except attnserve.ResourceExhausted:
                time.sleep(0.1)
        assert np.isfinite(small.lse).all()
        client.free_pages(pages)
        client.close()


def test_responses_a_client_does_not_read_stay_within_max_queue_bytes():
    """A response stays counted in --max_queue_bytes until gRPC has sent it,
    not only until it is ready: a client that sends ReadKV calls on a
    connection whose receive window it never opens (raw HTTP/2) gets a few
    4 MiB responses made and the rest RESOURCE_EXHAUSTED, and another client
    is refused too while they wait unsent; once that connection closes, the
    bytes come back. (Before, every response was made and held: 16 stalled
    calls held 1.6 GB against a 256 MiB bound.)"""
    sys.path.insert(0, HERE)
    import struct

    import h2_flood
    from attnserve.v1 import attention_pb2 as pb

    flags = ["--check_kv_written=false", "--max_queue_bytes=16777216"]
    with TestServer(num_layers=1, num_pages=256, page_size=16, num_qo_heads=4, num_kv_heads=4,
                    head_dim=128, extra_flags=flags) as server:
        client = attnserve.Client(server.address, timeout=60)
        pages = client.allocate_pages(256)
        slots = [p * 16 + i for p in pages[:128] for i in range(16)]  # 2,048 rows: 4 MiB of K and V
        body = pb.ReadKVRequest(layer=0, slots=slots).SerializeToString()
        message = b"\x00" + struct.pack(">I", len(body)) + body
        conn = h2_flood.Connection(server.address, timeout=10)
        # SETTINGS_INITIAL_WINDOW_SIZE 0: the server may send no response bytes.
        conn.sock.sendall(h2_flood.frame(h2_flood.SETTINGS, 0, 0, struct.pack(">HI", 4, 0)))
        conn.pump(0.2)
        calls = 6
        for i in range(calls):
            stream = 1 + 2 * i
            conn.open(stream, "/attnserve.v1.AttentionService/ReadKV", server.address, "")
            conn.windows[stream] = 65535  # the server's window for the request: it fits
            conn.sock.sendall(h2_flood.frame(h2_flood.DATA, h2_flood.END_STREAM, stream, message))
        ok = 'attnserve_requests_total{code="OK",method="ReadKV",shape="none"}'
        full = 'attnserve_requests_total{code="RESOURCE_EXHAUSTED",method="ReadKV",shape="none"}'
        for _ in range(600):
            conn.pump(0)
            if server.metric(ok) + server.metric(full) >= calls:
                break
            time.sleep(0.05)
        made = server.metric(ok)
        assert 3 <= made <= 4 and server.metric(full) == calls - made, (made, server.metric(full))
        with pytest.raises(attnserve.ResourceExhausted, match="unsent responses hold"):
            client.read_kv(0, slots)
        held = server.metric("attnserve_queue_held_bytes")
        assert made * 4 * MIB <= held <= 16 * MIB, held    # the gauge shows the unsent responses
        conn.sock.close()
        for _ in range(600):                   # the unsent responses' bytes come back
            try:
                k, v = client.read_kv(0, slots)
                break
            except attnserve.ResourceExhausted:
                time.sleep(0.05)
        assert k.shape[0] == len(slots)
        for _ in range(600):                   # and the gauge goes back to nothing held
            if server.metric("attnserve_queue_held_bytes") == 0:
                break
            time.sleep(0.05)
        assert server.metric("attnserve_queue_held_bytes") == 0
        client.free_pages(pages)
        client.close()


def test_a_client_sending_one_request_at_a_time_is_never_refused_for_bytes():
    """Responses of 64 KiB or more stop counting once gRPC has written them
    out, so a client that sends its next request on each answer always finds
    their bytes back: 400 ReadKVs of 640 KiB, one at a time, under a 1 MiB
    --max_queue_bytes all run (while responses counted until the call was
    deleted, after its status, about 4% were RESOURCE_EXHAUSTED)."""
    flags = ["--check_kv_written=false", "--max_queue_bytes=1048576"]
    with TestServer(num_layers=1, num_pages=64, page_size=16, num_qo_heads=4, num_kv_heads=4,
                    head_dim=64, extra_flags=flags) as server:
        client = attnserve.Client(server.address, timeout=60)
        pages = client.allocate_pages(20)
        slots = [p * 16 + i for p in pages for i in range(16)]   # 320 rows x 1 KiB of K and V
        for _ in range(400):
            k, v = client.read_kv(0, slots)
        assert k.shape[0] == len(slots)
        client.free_pages(pages)
        client.close()
