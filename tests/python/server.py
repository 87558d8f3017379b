"""Runs the real attnserve binary (CPU backend; backend="cuda" on a GPU machine) for the
Python tests.

Like tests/integration/test_server.h: the server listens on 127.0.0.1:0 for
gRPC and metrics, the line `listening grpc=HOST:PORT metrics=HOST:PORT` it
prints names the ports, and the health check (wait-for-ready, no sleeps)
says when it is SERVING. stop() sends SIGTERM and reaps the child.

    with TestServer(num_layers=2, extra_flags=["--tenant_max_pages=4"]) as server:
        client = attnserve.Client(server.address)
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import threading
import time

import grpc

from attnserve import _wire

_LISTENING = re.compile(r"listening grpc=(\S+) metrics=(\S+)")


def attnserve_bin() -> str:
    path = os.environ.get("ATTNSERVE_BIN")
    if not path:
        here = os.path.dirname(os.path.abspath(__file__))
        path = os.path.join(here, "..", "..", "build", "bin", "attnserve")
    if not os.access(path, os.X_OK):
        raise RuntimeError(f"no attnserve binary at {path} (set ATTNSERVE_BIN)")
    return path


class TestServer:
    __test__ = False  # not a pytest class

    def __init__(self, *, num_layers: int = 2, num_pages: int = 256, page_size: int = 16,
                 num_qo_heads: int = 8, num_kv_heads: int = 2, head_dim: int = 64,
                 kv_dtype: str = "bf16", extra_flags=(), start_timeout_s: float = 60,
                 probe_credentials: grpc.ChannelCredentials | None = None,
                 backend: str | None = None, attention: str = "gqa", kv_lora_rank: int = 0,
                 qk_rope_head_dim: int = 0):
        """attention="mla": a multi-head latent attention server of kv_lora_rank
        and qk_rope_head_dim (num_kv_heads and head_dim are not passed).
        backend: None takes $ATTNSERVE_TEST_BACKEND, else cpu (a GPU machine
        runs a suite's host paths against the CUDA backend with it set)."""
        if backend is None:
            backend = os.environ.get("ATTNSERVE_TEST_BACKEND", "cpu")
        self.geometry = dict(num_layers=num_layers, num_pages=num_pages, page_size=page_size,
                             num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                             head_dim=head_dim, kv_dtype=kv_dtype)
        if attention == "mla":
            del self.geometry["num_kv_heads"], self.geometry["head_dim"]
            self.geometry.update(attention="mla", kv_lora_rank=kv_lora_rank,
                                 qk_rope_head_dim=qk_rope_head_dim)
        args = [attnserve_bin(), "--listen=127.0.0.1:0", "--metrics_listen=127.0.0.1:0",
                "--backend=" + backend, "--drain_timeout_s=10"]
        args += [f"--{k}={v}" for k, v in self.geometry.items()]
        args += list(extra_flags)
        self._probe_credentials = probe_credentials  # TLS servers: the health probe's
        self._lines: list = []
        self._lock = threading.Lock()
        self._proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, text=True, bufsize=1)
        found: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=self._read, args=(found,), daemon=True)
        self._reader.start()
        try:
            self.address, self.metrics_address = found.get(timeout=start_timeout_s)
        except queue.Empty:
            self.stop()
            raise RuntimeError(f"attnserve printed no 'listening' line:\n{self.output()}")
        if self.address is None:
            code = self.stop()
            raise RuntimeError(f"attnserve exited ({code}) before listening:\n{self.output()}")
        self._wait_serving(time.monotonic() + start_timeout_s)

    def _read(self, found: queue.Queue) -> None:
        announced = False
        for line in self._proc.stdout:
            with self._lock:
                self._lines.append(line)
            m = _LISTENING.search(line)
            if m and not announced:
                announced = True
                found.put((m.group(1), m.group(2)))
        if not announced:
            found.put((None, None))

    def _wait_serving(self, deadline: float) -> None:
        if self._probe_credentials is not None:
            channel = grpc.secure_channel(self.address, self._probe_credentials)
        else:
            channel = grpc.insecure_channel(self.address)
        with channel:
            check = channel.unary_unary("/grpc.health.v1.Health/Check")
            last = None
            while time.monotonic() < deadline and self.alive():
                try:
                    raw = check(_wire.health_request(""), timeout=max(0.1, deadline - time.monotonic()),
                                wait_for_ready=True)
                    if _wire.health_status(raw) == "SERVING":
                        return
                except grpc.RpcError as e:
                    last = e
            self.stop()
            raise RuntimeError(f"attnserve never became SERVING ({last}):\n{self.output()}")

    def output(self) -> str:
        with self._lock:
            return "".join(self._lines)

    def alive(self) -> bool:
        return self._proc.poll() is None

    @property
    def pid(self) -> int:
        return self._proc.pid

    def pause(self, timeout: float = 30.0) -> None:
        """SIGSTOP, then waits until every thread of the server has stopped:
        a stop reaches a process's threads only once one of them runs, so
        on a loaded host a thread polling a channel may still answer for a
        while after the signal."""
        os.kill(self._proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + timeout
        while True:
            states = []
            for task in os.listdir(f"/proc/{self._proc.pid}/task"):
                try:
                    with open(f"/proc/{self._proc.pid}/task/{task}/stat") as f:
                        states.append(f.read().rsplit(")", 1)[1].split()[0])
                except FileNotFoundError:  # a thread that ended meanwhile
                    pass
            if states and all(st in "Tt" for st in states):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server's threads did not stop: {states}")
            time.sleep(0.001)

    def resume(self) -> None:
        os.kill(self._proc.pid, signal.SIGCONT)

    def rss_bytes(self) -> int:
        """The server's resident memory now (VmRSS)."""
        with open(f"/proc/{self._proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def metric(self, sample: str) -> float:
        """The value of one exposition sample, e.g. 'attnserve_queue_depth' or
        'attnserve_requests_total{code="OK",method="Prefill",shape="decode"}'; 0 when absent."""
        import urllib.request
        with urllib.request.urlopen(f"http://{self.metrics_address}/metrics", timeout=10) as r:
            text = r.read().decode()
        for line in text.splitlines():
            if line.startswith(sample + " "):
                return float(line.split()[-1])
        return 0.0

    def stop(self) -> int:
        """SIGTERM, then wait; the exit code (negative: killed by that signal)."""
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._reader.join(timeout=5)
        return self._proc.returncode

    def __enter__(self) -> "TestServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
