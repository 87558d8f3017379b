"""The cluster client's servers: who they are, what each holds, and what
their answers say about them (restarts, lost leases, unreachability, a
dns:/// name's addresses changing). Cluster (cluster.py) holds the
sequences and their steps over these; client/cluster_servers.cc is the C++
twin.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from typing import Optional

import grpc

from attnserve.client import Client
from attnserve.errors import (AttnserveError, DataLoss, DeadlineExceeded, SequencesLost,
                              StaleIncarnation, Unavailable)
from attnserve.kv_manager import KvManager


@dataclass
class ClusterServer:
    """What one server looks like to the cluster (Cluster.servers())."""

    address: str
    active: bool          # takes new sequences (listed, reachable)
    incarnation: int
    restarts: int         # restarts seen
    free_pages: int       # estimate: its last info, less what we allocated since
    pages_held: int       # held by this cluster's sequences
    sequences: int        # sequences with keys there
    leaked_pages: int = 0  # its KvManager's leaked_pages (without leases)


class _Server:
    def __init__(self, address: str, client: Client, kv: KvManager):
        self.address = address
        self.client = client
        self.kv = kv
        self.listed = True
        self.reachable = True
        self.gone = False
        self.epoch = 0
        self.free_base = client.server_info.free_pages
        self.held_base = 0
        # The incarnation the cluster's KV scales were last given to (FP8).
        self.scales_incarnation: Optional[int] = None
        # time.monotonic() of the first of the calls failing with UNAVAILABLE
        # or DEADLINE_EXCEEDED since the last success; None while it answers.
        self.unreachable_since: Optional[float] = None

    @property
    def usable(self) -> bool:
        return self.listed and self.reachable and not self.gone

    def free_estimate(self) -> int:
        return self.free_base - (self.kv.num_pages - self.held_base)


def _geometry(info) -> dict:
    return dict(num_layers=info.num_layers, page_size=info.page_size,
                num_qo_heads=info.num_qo_heads, num_kv_heads=info.num_kv_heads,
                head_dim=info.head_dim, kv_dtype=info.kv_dtype,
                q_dtype=info.q_dtype or info.kv_dtype, attention=info.attention,
                qk_head_dim=info.qk_head_dim, v_head_dim=info.v_head_dim)


def getaddrinfo_resolver(host: str, port: str) -> list:
    """host:port as sorted, distinct "ip:port" / "[ipv6]:port" addresses."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_ADDRCONFIG)
    except socket.gaierror as e:
        raise AttnserveError(f"cannot resolve {host}:{port}: {e}",
                             grpc.StatusCode.UNAVAILABLE) from None
    out = set()
    for family, _, _, _, addr in infos:
        out.add(f"[{addr[0]}]:{port}" if family == socket.AF_INET6 else f"{addr[0]}:{port}")
    return sorted(out)



class _ServerSet:
    """Cluster's servers: the methods that add, read, lose and close them.

    Works on the Cluster's state: _servers (list of _Server), _seqs
    ({seq_id: _Sequence}: the shards each server holds), _geometry, _first_info,
    _kv_scales, _client_kwargs, _kv_options, _dns, _resolver,
    _refreshed_at, server_lost_after and _pool.
    """

    def _add_server(self, address: str) -> int:
        client = Client(address, **self._client_kwargs)
        g = _geometry(client.server_info)
        if self._geometry is None:
            self._geometry = g
            self._first_info = client.server_info
        else:
            diff = [f"{k}={g[k]} (the others have {v})" for k, v in self._geometry.items()
                    if g[k] != v]
            if diff:
                client.close()
                raise ValueError(f"server {address} has another geometry: {', '.join(diff)}; "
                                 "every server of a cluster must have the same layers, page "
                                 "size, attention, heads, head dims and dtype")
        if self._kv_scales:
            try:
                client.set_kv_scales(self._kv_scales)
            except BaseException:
                client.close()
                raise
        self._servers.append(_Server(address, client, KvManager(client, **self._kv_options)))
        self._servers[-1].scales_incarnation = client.incarnation
        return len(self._servers) - 1

    def set_kv_scales(self, scales) -> None:
        """Every server's KV scales (FP8 servers; as Client.set_kv_scales:
        {layer: (k_scale, v_scale)}), kept and given again to servers that
        join or restart. Raises the first server's error; servers that took
        them keep them."""
        for s in self._servers:
            if not s.gone:
                s.client.set_kv_scales(scales)
                s.scales_incarnation = s.client.incarnation
        for layer, pair in dict(scales).items():
            self._kv_scales[int(layer)] = pair

    def _apply_scales(self, i: int, incarnation: int) -> None:
        """The cluster's KV scales to server i when it has not had them since
        it started (incarnation): a restarted server starts at 1.0."""
        s = self._servers[i]
        if self._kv_scales and s.scales_incarnation != incarnation:
            s.client.set_kv_scales(self._kv_scales)
            s.scales_incarnation = incarnation

    @property
    def server_info(self):
        """The first member's ServerInfo (the geometry every server shares;
        a server that left the cluster for another geometry is no member)."""
        for s in self._servers:
            if not s.gone:  # (one back with another geometry is gone at once)
                return s.client.server_info
        return self._first_info

    @property
    def num_servers(self) -> int:
        return len(self._servers)

    def client(self, server: int) -> Client:
        return self._servers[server].client

    def kv_manager(self, server: int) -> KvManager:
        return self._servers[server].kv

    def servers(self) -> list:
        counts = [0] * len(self._servers)
        for s in self._seqs.values():
            for sh in s.shards:
                counts[sh.server] += 1
        return [ClusterServer(address=s.address, active=s.usable,
                              incarnation=s.client.incarnation, restarts=s.epoch,
                              free_pages=s.free_estimate(), pages_held=s.kv.num_pages,
                              sequences=counts[i], leaked_pages=s.kv.leaked_pages)
                for i, s in enumerate(self._servers)]

    def close(self) -> None:
        """Revokes every server's KvManager lease (best effort) and closes
        the clients."""
        for s in self._servers:
            if not s.gone:
                s.kv.close()
            s.client.close()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _read_info(self, i: int, info) -> None:
        s = self._servers[i]
        s.free_base = info.free_pages
        s.held_base = s.kv.num_pages

    def _lose_server(self, i: int, why: str, gone: bool = False) -> list:
        """Server i's sequences are lost (why: "restarted"; "lease", its
        KvManager's lease expired; or "unreachable"; gone: it left the
        cluster); returns them."""
        s = self._servers[i]
        lost = []
        for sid, seq in self._seqs.items():
            kept = [sh for sh in seq.shards if sh.server != i]
            if len(kept) != len(seq.shards):
                seq.shards = kept  # the rest waits for finish()
                seq.lost = True
                lost.append(sid)
        # An unreachable server may still hold the pages: with the lease it
        # frees them when the lease ends; without, they count as leaked.
        if why == "unreachable":
            s.kv.abandon()
            s.reachable = False
        else:
            # A lost lease leaves the server up: the leases the manager still
            # has to revoke (a release()'s or plan's RevokeLease that failed,
            # or abandoned while the server seemed unreachable) may live.
            s.kv.reset(restarted=why == "restarted")
        s.epoch += 1
        s.unreachable_since = None
        s.gone = s.gone or gone
        if why == "restarted":
            s.client.forget_incarnation()
            if not s.gone:
                # It answered a moment ago (with its new incarnation): it takes
                # new sequences, its free pages read here or at the next refresh.
                s.reachable = True
                try:
                    info = s.client.info()  # learns the new incarnation
                    if _geometry(info) != self._geometry:
                        # Back with another geometry: it leaves the cluster
                        # (as the C++ cluster's, whose clients keep theirs).
                        s.gone = True
                        s.reachable = False
                    else:
                        self._read_info(i, info)
                        self._apply_scales(i, info.incarnation)
                except AttnserveError:
                    s.reachable = False  # no new sequences before it has the scales
        return lost

    def _observe(self, i: int, error: Optional[AttnserveError], lost: list) -> bool:
        """What a call to server i's KvManager answered says about the server:
        success (None) marks it answering; a restart, a lost lease or an
        unreachability past server_lost_after loses its sequences, added to
        `lost` (returns True: the failure is accounted for by the loss)."""
        s = self._servers[i]
        if error is None:
            s.unreachable_since = None
            return False
        if isinstance(error, StaleIncarnation):
            lost += self._lose_server(i, "restarted")
            return True
        if isinstance(error, DataLoss):
            lost += self._lose_server(i, "lease")
            return True
        if isinstance(error, (Unavailable, DeadlineExceeded)):
            now = time.monotonic()
            if s.unreachable_since is None:
                s.unreachable_since = now
            if (self.server_lost_after is not None
                    and now - s.unreachable_since >= self.server_lost_after):
                lost += self._lose_server(i, "unreachable")
                return True
        return False

    def _resolve(self) -> None:
        if self._dns is None:
            return
        now = set(self._resolver(*self._dns))
        lost, problems = [], []
        for i, s in enumerate(self._servers):
            if s.gone:
                continue
            s.listed = s.address in now
            if s.listed:
                continue
            # Left the name: kept while it answers with the same incarnation
            # (a readiness blip); otherwise its KV is gone with it.
            why = "unreachable"
            try:
                if s.client.info().incarnation == s.client.incarnation:
                    continue
                why = "restarted"
            except AttnserveError:
                pass
            lost += self._lose_server(i, why, gone=True)
        for a in sorted(now):
            if any(s.address == a and not s.gone for s in self._servers):
                continue
            try:
                self._add_server(a)
            except (AttnserveError, ValueError) as e:
                problems.append(f"{a}: {e}")
        if lost:
            raise SequencesLost(lost, "their server left the cluster", method="refresh")
        if problems:
            raise ValueError("left out: " + "; ".join(problems))

    def refresh(self) -> None:
        """Resolves a dns:/// target again (new servers join; one that left and
        cannot be reached loses its sequences) and reads every server's info
        (free pages; a changed incarnation loses its sequences). Raises
        SequencesLost naming the sequences found lost, ValueError naming a new
        server with another geometry (it is left out)."""
        self._refreshed_at = time.monotonic()
        lost, error = [], None
        try:
            self._resolve()
        except SequencesLost as e:
            lost += e.seq_ids
        except (ValueError, AttnserveError) as e:
            error = e
        for i, s in enumerate(self._servers):
            if s.gone:
                continue
            expected = s.client.incarnation
            try:
                info = s.client.info()
            except AttnserveError as e:
                s.reachable = False
                self._observe(i, e, lost)  # unreachable too long: its sequences are lost
                continue
            s.reachable = True
            s.unreachable_since = None
            if _geometry(info) != self._geometry:
                # Back with another geometry (also when its incarnation was
                # forgotten, and so cannot be compared): it leaves the cluster.
                lost += self._lose_server(i, "restarted", gone=True)
            elif expected and info.incarnation != expected:
                lost += self._lose_server(i, "restarted")
            else:
                self._read_info(i, info)
                try:
                    self._apply_scales(i, info.incarnation)
                except AttnserveError as e:
                    s.reachable = False  # takes no new sequences without the scales
                    error = error or e
        if lost:
            raise SequencesLost(lost, "their server restarted or left", method="refresh")
        if error is not None:
            raise error
