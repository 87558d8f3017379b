"""Every error class the server's codes map to, from real failing calls."""

import os
import subprocess

import grpc
import numpy as np
import pytest

import attnserve
from server import TestServer


def q_rows(n, g):
    return np.random.default_rng(n).standard_normal((n, g.num_qo_heads, g.head_dim)).astype(
        np.float32)


def test_every_code_has_a_class():
    for code in grpc.StatusCode:
        if code == grpc.StatusCode.OK:
            continue
        err = attnserve.errors.error_for(code, "message", "Method")
        assert isinstance(err, attnserve.AttnserveError)
        assert err.code == code and err.details == "message"
        assert type(err).__name__.upper().replace("_", "") == code.name.replace("_", ""), err
        assert str(err) == f"Method: {code.name}: message"
    stale = attnserve.errors.error_for(grpc.StatusCode.FAILED_PRECONDITION,
                                       "expected_incarnation=1 differs")
    assert isinstance(stale, attnserve.StaleIncarnation)
    assert isinstance(stale, attnserve.FailedPrecondition)


@pytest.mark.parametrize("case,field", [
    ("layer", "layer"),
    ("q_heads", "q.shape"),
    ("kv_indptr", "kv_indptr"),
    ("last_page_len", "kv_last_page_len"),
    ("page", "kv_indices"),
])
def test_invalid_argument_names_the_field(client, case, field):
    g = client.server_info
    pages = client.allocate_pages(2)
    args = dict(layer=0, q=q_rows(4, g), qo_indptr=[0, 4], kv_indptr=[0, 2], kv_indices=pages,
                kv_last_page_len=[16])
    if case == "layer":
        args["layer"] = g.num_layers
    elif case == "q_heads":
        args["q"] = np.zeros((4, g.num_qo_heads + 1, g.head_dim), np.float32)
    elif case == "kv_indptr":
        args["kv_indptr"] = [0, 3]
    elif case == "last_page_len":
        args["kv_last_page_len"] = [g.page_size + 1]
    elif case == "page":
        args["kv_indices"] = [pages[0], g.num_pages + 5]
    with pytest.raises(attnserve.InvalidArgument) as e:
        client.prefill(**args)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert field in e.value.details, e.value.details
    client.free_pages(pages)


def test_invalid_argument_on_write_and_allocate(client):
    g = client.server_info
    with pytest.raises(attnserve.InvalidArgument, match="count"):
        client.allocate_pages(-1)
    pages = client.allocate_pages(1)
    k = np.ones((2, g.num_kv_heads, g.head_dim), np.float32)
    with pytest.raises(attnserve.InvalidArgument, match=r"k\.shape\[0\]=2 must be 1"):
        client.write_kv(0, [pages[0] * g.page_size], k, k)  # 1 slot, 2 rows
    client.free_pages(pages)


def test_arguments_that_cannot_be_sent_fail_before_any_call(client):
    g = client.server_info
    q = q_rows(1, g)
    with pytest.raises(ValueError, match="kv_indices"):
        client.prefill(0, q, [0, 1], [0, 1], [1 << 40], [1])
    with pytest.raises(ValueError, match="layer"):
        client.prefill(1 << 40, q, [0, 1], [0, 0], [], [])
    with pytest.raises(ValueError, match="count"):
        client.allocate_pages(1 << 31)
    with pytest.raises(TypeError, match="qo_indptr"):
        client.prefill(0, q, [0.0, 1.5], [0, 0], [], [])
    with pytest.raises(TypeError, match="q: numpy dtype"):
        client.prefill(0, np.array([["a"]]), [0, 1], [0, 0], [], [])
    with pytest.raises(ValueError, match="lse_base"):
        client.prefill(0, q, [0, 1], [0, 0], [], [], lse_base="10")
    with pytest.raises(ValueError, match="append_k and append_v"):
        client.prefill(0, q, [0, 1], [0, 0], [], [], append_slots=[0], append_k=q)
    # Unsigned values past int64 are named, not wrapped to a negative slot.
    k = np.ones((2, g.num_kv_heads, g.head_dim), np.float32)
    with pytest.raises(ValueError, match=r"slots\[1\]=9223372036854775808 does not fit in int64"):
        client.write_kv(0, np.array([0, 1 << 63], np.uint64), k, k)
    # Ids are [0, 2^64): the field is named.
    with pytest.raises(ValueError, match=r"plan_id=-1 out of range \[0, 2\^64\)"):
        client.release_plan(-1)
    with pytest.raises(TypeError, match="plan_id: an integer expected, got float"):
        client.release_plan(1.5)


def test_a_page_error_names_the_entry(client):
    """NOT_FOUND names the field, the index and the value of the entry."""
    g = client.server_info
    pages = client.allocate_pages(2)
    client.free_pages([pages[1]])
    q = q_rows(1, g)
    with pytest.raises(attnserve.NotFound, match=rf"kv_indices\[1\]={pages[1]} is not allocated"):
        client.prefill(0, q, [0, 1], [0, 2], pages, [1])
    k = np.ones((1, g.num_kv_heads, g.head_dim), np.float32)
    slot = pages[1] * g.page_size + 3
    with pytest.raises(attnserve.NotFound, match=rf"slots\[0\]={slot} \(page {pages[1]}\) is not allocated"):
        client.write_kv(0, [slot], k, k)
    client.free_pages([pages[0]])


def test_resource_exhausted(client):
    g = client.info()
    held = client.allocate_pages(g.free_pages - 3)
    with pytest.raises(attnserve.ResourceExhausted) as e:
        client.allocate_pages(4)
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert client.info().free_pages == 3  # nothing taken
    client.free_pages(held)
    # More than the server has at all is a bad count, not a shortage.
    with pytest.raises(attnserve.InvalidArgument, match="num_pages"):
        client.allocate_pages(g.num_pages + 1)


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory):
    tokens = tmp_path_factory.mktemp("auth") / "tokens"
    tokens.write_text("# tenants\ntok-alpha alpha\ntok-beta beta\n")
    with TestServer(num_pages=32, extra_flags=[f"--auth_tokens_file={tokens}",
                                               "--tenant_max_pages=8"]) as s:
        yield s


def test_unauthenticated(auth_server):
    with pytest.raises(attnserve.Unauthenticated):
        attnserve.Client(auth_server.address, timeout=30)
    with pytest.raises(attnserve.Unauthenticated) as e:
        attnserve.Client(auth_server.address, token="tok-wrong", timeout=30)
    assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
    # Health needs no credentials.
    with attnserve.Client(auth_server.address, fetch_info=False) as c:
        assert c.health() == "SERVING"


def test_permission_denied_and_quota(auth_server):
    alpha = attnserve.Client(auth_server.address, token="tok-alpha", timeout=30)
    beta = attnserve.Client(auth_server.address, token="tok-beta", timeout=30)
    g = alpha.server_info
    pages = alpha.allocate_pages(2)
    slots = [pages[0] * g.page_size + i for i in range(4)]
    k = np.random.default_rng(0).standard_normal((4, g.num_kv_heads, g.head_dim))
    alpha.write_kv(0, slots, k, k)
    before = alpha.read_kv(0, slots, out="raw")
    with pytest.raises(attnserve.PermissionDenied):
        beta.write_kv(0, slots, -k, -k)
    with pytest.raises(attnserve.PermissionDenied):
        beta.read_kv(0, slots)
    with pytest.raises(attnserve.PermissionDenied):
        beta.prefill(0, q_rows(1, g), [0, 1], [0, 1], pages[:1], [4])
    with pytest.raises(attnserve.PermissionDenied):
        beta.free_pages(pages)
    after = alpha.read_kv(0, slots, out="raw")
    assert all(np.array_equal(a, b) for a, b in zip(before, after))
    # Over the tenant's quota (--tenant_max_pages=8): RESOURCE_EXHAUSTED.
    with pytest.raises(attnserve.ResourceExhausted):
        alpha.allocate_pages(7)
    alpha.free_pages(pages)
    alpha.close()
    beta.close()


def test_stale_incarnation_after_a_restart():
    """A client that outlives its server gets StaleIncarnation, never old pages."""
    first = TestServer(num_pages=16)
    address = first.address
    client = attnserve.Client(address, timeout=30)
    old = client.incarnation
    pages = client.allocate_pages(2)
    g = client.server_info
    assert first.stop() == 0
    with TestServer(num_pages=16, extra_flags=[f"--listen={address}"]) as second:
        assert second.address == address
        # The new server hands the same page ids to someone else.
        with attnserve.Client(address, timeout=30) as other:
            assert other.incarnation != old
            everything = other.allocate_pages(16)
            assert set(pages) <= set(everything)
            other.free_pages(everything)
        # Prefill: the server refuses the stale expected_incarnation.
        with pytest.raises(attnserve.StaleIncarnation) as e:
            client.prefill(0, q_rows(2, g), [0, 2], [0, 1], pages[:1], [2])
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "incarnation" in e.value.details
        # AllocatePages: the response's incarnation gives the restart away even
        # where the server does not check expected_incarnation on that RPC.
        with pytest.raises(attnserve.StaleIncarnation):
            client.allocate_pages(1)
        assert client.incarnation == old
        # After re-creating state: forget_incarnation() adopts the new one.
        client.forget_incarnation()
        fresh = client.allocate_pages(1)
        assert client.incarnation not in (0, old)
        client.free_pages(fresh)
        info = client.reconnect()
        assert client.incarnation == info.incarnation != old
    client.close()


def test_reconnect_moves_forks_and_their_leases_to_the_new_channel():
    """A KvManager works on a fork of the client (its own lease): after
    client.reconnect() (a transient failure, same server) the fork used the
    closed channel, so its calls raised gRPC's raw ValueError, its lease
    thread died without a word and the server freed the pages the manager
    still counted as its own. Now the fork moves with the client; after
    close(), its calls and its lease's renewals say the client is closed."""
    import threading
    import time
    with TestServer(num_layers=1, page_size=4, num_qo_heads=2, num_kv_heads=1,
                    head_dim=64) as srv:
        client = attnserve.Client(srv.address, timeout=10)
        admin = attnserve.Client(srv.address, timeout=10)
        mgr = attnserve.KvManager(client, lease_ttl=1)
        rng = np.random.default_rng(3)
        q = rng.standard_normal((3, 2, 64)).astype(np.float32)
        k = rng.standard_normal((3, 1, 64)).astype(np.float32)
        mgr.plan([1], [3])
        mgr.run(0, q, k, k)
        client.reconnect()
        time.sleep(2.5)  # past the ttl: only renewals on the new channel keep it
        assert mgr.lease_id in [lease.lease_id for lease in admin.list_holdings().leases]
        assert mgr._lease.error is None
        mgr.plan([1], [1])
        mgr.run(0, q[:1], k[:1], k[:1])
        client.close()
        with pytest.raises(attnserve.Cancelled, match="client is closed"):
            mgr.plan([1], [1])
        deadline = time.monotonic() + 5
        while mgr._lease._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not mgr._lease._thread.is_alive()
        assert isinstance(mgr._lease.error, attnserve.Cancelled)
        assert not [t for t in threading.enumerate()
                    if t.name == f"attnserve-lease-{mgr.lease_id:x}"]
        admin.close()


def test_every_request_that_names_pages_carries_the_incarnation(client):
    """What the server checks (FAILED_PRECONDITION on a stale value) needs the
    client to send expected_incarnation on every such request."""
    from attnserve.client import PrefillLayout
    from attnserve.v1 import attention_pb2 as pb
    g = client.server_info
    inc = client.incarnation
    assert inc == g.incarnation != 0
    k = np.ones((1, g.num_kv_heads, g.head_dim), np.float32)
    layout = PrefillLayout.encode([0, 1], [0, 1], [0], [1])
    requests = {
        "AllocatePages": (client._req_allocate(1), pb.AllocatePagesRequest),
        "FreePages": (client._req_free([0]), pb.FreePagesRequest),
        "WriteKV": (client._req_write_kv(0, [0], k, k), pb.WriteKVRequest),
        "ReadKV": (client._req_read_kv(0, [0], None, None), pb.ReadKVRequest),
        "Prefill": (client._req_prefill(0, q_rows(1, g), layout, None, None, None, None),
                    pb.PrefillRequest),
    }
    for name, ((method, body, _), cls) in requests.items():
        assert method == name
        assert cls.FromString(body).expected_incarnation == inc, name
    client.forget_incarnation()
    assert pb.WriteKVRequest.FromString(client._req_write_kv(0, [0], k, k)[1]) \
        .expected_incarnation == 0
    client.info()
    assert client.incarnation == inc


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tls"))
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
             "/CN=attnserve-test-ca", "-keyout", "ca.key", "-out", "ca.pem", cwd=d)
    for name, cn in (("server", "localhost"), ("client", "client")):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={cn}", "-keyout",
                 f"{name}.key", "-out", f"{name}.csr", cwd=d)
        with open(os.path.join(d, "san.ext"), "w") as f:
            f.write("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-days", "2", "-extfile", "san.ext", "-out", f"{name}.pem",
                 cwd=d)
    return d


def test_tls_and_mtls(certs):
    p = lambda name: os.path.join(certs, name)  # noqa: E731
    read = lambda name: open(p(name), "rb").read()  # noqa: E731
    probe = grpc.ssl_channel_credentials(read("ca.pem"), read("client.key"), read("client.pem"))
    flags = [f"--tls_cert={p('server.pem')}", f"--tls_key={p('server.key')}",
             f"--tls_client_ca={p('ca.pem')}"]
    with TestServer(num_layers=1, num_pages=8, extra_flags=flags,
                    probe_credentials=probe) as server:
        with attnserve.Client(server.address, tls_ca=p("ca.pem"), tls_cert=p("client.pem"),
                              tls_key=p("client.key"), timeout=30) as c:
            assert c.server_info.backend == "cpu"
            assert c.health() == "SERVING"
            pages = c.allocate_pages(1)
            c.free_pages(pages)
        # Refused at once (connect_timeout allows minutes), each with its cause.
        with pytest.raises(attnserve.Unavailable, match="wants a client certificate"):
            attnserve.Client(server.address, tls_ca=p("ca.pem"), connect_timeout=600)
        with pytest.raises(attnserve.Unavailable, match="if it is a TLS server"):
            attnserve.Client(server.address, connect_timeout=600)
        with pytest.raises(ValueError, match="tls_cert and tls_key"):
            attnserve.Client(server.address, tls_cert=p("client.pem"))


def test_only_idempotent_methods_are_retried_on_unavailable():
    """A stand-in server answers every call UNAVAILABLE and counts them: the
    client's retry policy (RETRY_SERVICE_CONFIG) tries the idempotent
    methods 4 times in all, the others once."""
    from concurrent import futures
    calls = {}

    class Draining(grpc.GenericRpcHandler):
        def service(self, details):
            method = details.method.rsplit("/", 1)[1]

            def refuse(request, context):
                calls[method] = calls.get(method, 0) + 1
                context.abort(grpc.StatusCode.UNAVAILABLE, "server is draining")
            return grpc.unary_unary_rpc_method_handler(refuse)

    server = grpc.server(futures.ThreadPoolExecutor(4), handlers=[Draining()])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        c = attnserve.Client(f"127.0.0.1:{port}", fetch_info=False, timeout=60)
        c._info = attnserve.ServerInfo("v", "cpu", "cpu", 1, 16, 16, 8, 2, 64, "bf16", 16,
                                       16384, 1 << 29, 1)
        q = np.zeros((1, 8, 64), np.float32)
        kv = np.zeros((1, 2, 64), np.float32)
        attempts = [
            ("GetServerInfo", lambda: c.info()),
            ("Prefill", lambda: c.prefill(0, q, [0, 1], [0, 0], [], [])),
            ("WriteKV", lambda: c.write_kv(0, [0], kv, kv)),
            ("ReadKV", lambda: c.read_kv(0, [0])),
            ("MergeStates", lambda: c.merge_states([(q, np.zeros((1, 8), np.float32))])),
            ("ListRegions", lambda: c.list_regions()),
            ("AllocatePages", lambda: c.allocate_pages(1)),
            ("FreePages", lambda: c.free_pages([0])),
            ("CreatePlan", lambda: c.create_plan([0, 1], [0, 0], [], [])),
            ("ReleasePlan", lambda: c.release_plan(1)),
            # The RPC itself (register_system_region first sends its memfd to
            # the region socket the server names).
            ("RegisterRegion",
             lambda: c._call(c._req_register_region("r", system=(bytes(16), 0, 4096)), None)),
            ("UnregisterRegion", lambda: c.unregister_region("r")),
        ]
        for method, call in attempts:
            with pytest.raises(attnserve.Unavailable, match="server is draining"):
                call()
        # Requests past gRPC's default retry buffer (256 KiB): a 2 MiB
        # Prefill and WriteKV are retried as well (before: tried once).
        big_q = np.zeros((2048, 8, 64), np.float32)
        big_kv = np.zeros((4096, 2, 64), np.float32)
        for call in (lambda: c.prefill(0, big_q, [0, 2048], [0, 0], [], []),
                     lambda: c.write_kv(0, list(range(4096)), big_kv, big_kv)):
            with pytest.raises(attnserve.Unavailable, match="server is draining"):
                call()
        c.close()
    finally:
        server.stop(None)
    retried = {"GetServerInfo", "Prefill", "WriteKV", "ReadKV", "MergeStates", "ListRegions"}
    expected = {m: 4 if m in retried else 1 for m, _ in attempts}
    expected["Prefill"] += 4
    expected["WriteKV"] += 4
    assert calls == expected


@pytest.mark.parametrize("change,message", [
    (dict(page_size=0), "ServerInfo.page_size=0 out of range [1, 128]"),
    (dict(num_layers=0), "ServerInfo.num_layers=0 out of range [1, 1024]"),
    (dict(num_kv_heads=0), "ServerInfo.num_kv_heads=0 out of range [1, 256]"),
    (dict(num_kv_heads=3), "ServerInfo.num_qo_heads=8 must be in [1, 256] and a multiple of "
                           "ServerInfo.num_kv_heads=3"),
    (dict(head_dim=100), "ServerInfo.head_dim=100 must be 64, 128 or 256"),
    (dict(num_pages=0), "ServerInfo.num_pages=0 < 1"),
    (None, ""),
])
def test_a_server_reporting_a_geometry_no_attnserve_serves_is_refused(change, message):
    """What the client computes with must be a geometry attnserve serves: a
    stand-in that reports another is refused at connect (and by info()),
    naming the field, as by the C++ client."""
    from concurrent import futures
    from attnserve.v1 import attention_pb2 as pb
    info = dict(num_layers=2, num_pages=64, page_size=16, num_qo_heads=8, num_kv_heads=2,
                head_dim=128, kv_dtype=pb.DTYPE_BF16, incarnation=7)
    if change:
        info.update(change)

    class Info(grpc.GenericRpcHandler):
        def service(self, details):
            return grpc.unary_unary_rpc_method_handler(
                lambda request, context: pb.ServerInfo(**info).SerializeToString())

    server = grpc.server(futures.ThreadPoolExecutor(2), handlers=[Info()])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        if change is None:
            assert attnserve.Client(f"127.0.0.1:{port}", timeout=10).info().page_size == 16
            return
        with pytest.raises(attnserve.FailedPrecondition) as e:
            attnserve.Client(f"127.0.0.1:{port}", timeout=10)
        assert message in str(e.value)
        assert "is it an attnserve server?" in str(e.value)
        c = attnserve.Client(f"127.0.0.1:{port}", fetch_info=False, timeout=10)
        with pytest.raises(attnserve.FailedPrecondition, match="ServerInfo."):
            c.info()
    finally:
        server.stop(0)


@pytest.mark.parametrize("target,message", [
    ("", "target is empty"),
    ("127.0.0.1:99999", "port 99999 out of range [1, 65535]"),
    ("127.0.0.1:0", "port 0 out of range [1, 65535]"),
])
def test_a_target_that_cannot_be_a_server_is_refused_before_connecting(target, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        attnserve.Client(target, connect_timeout=1)


def test_the_retry_policy_is_the_cpp_clients():
    import json
    import re as _re
    from attnserve.client import RETRY_SERVICE_CONFIG
    header = open(os.path.join(os.path.dirname(__file__), "..", "..", "common",
                               "transport.h")).read()
    cpp = _re.search(r'kClientServiceConfig\[\] = R"json\((.*?)\)json"', header, _re.S).group(1)
    assert json.loads(cpp) == json.loads(RETRY_SERVICE_CONFIG)


def test_a_prefill_over_unwritten_rows_is_refused(client):
    g = client.server_info
    pages = client.allocate_pages(1)
    q = q_rows(2, g)
    with pytest.raises(attnserve.FailedPrecondition) as e:
        client.prefill(0, q, [0, 2], [0, 1], pages, [16])
    assert not isinstance(e.value, attnserve.StaleIncarnation)
    assert (f"reads rows [0, 16) of page {pages[0]} (kv_indices[0]) in layer 0, but row 0 was "
            "never written there") in e.value.details
    client.free_pages(pages)
