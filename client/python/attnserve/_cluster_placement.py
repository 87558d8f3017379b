"""Where a Cluster's step puts each sequence's new tokens, and what each
server then attends (the Python twin of client/cluster_placement.cc): pure
functions of the sequences' shards and the servers' free pages, with no
RPC. attnserve.cluster calls them from plan(); docs/cluster.md, "Placement"."""

from __future__ import annotations

import math
from dataclasses import dataclass

import grpc

from attnserve.errors import AttnserveError, ResourceExhausted


@dataclass
class Shard:
    """Positions [start, start + length) of a sequence, on server `server`."""

    server: int
    start: int
    length: int


def causal_spread(n: int, k: int) -> list:
    """How a step spreads n new tokens of one sequence over k servers, in
    position order: each server gets the same share of the causal attention
    among the new tokens (the keys [a, n) take (n - a)^2 / 2 of the n^2 / 2
    triangle, so the last m of k shards start at n (1 - sqrt(m / k)); the
    first shard is the smallest). Sums to n."""
    k = max(k, 1)
    sizes, prev = [], 0
    for j in range(1, k + 1):
        bound = n if j == k else int(math.floor(n * (1 - math.sqrt((k - j) / k)) + 0.5))
        sizes.append(max(0, bound - prev))
        prev = max(prev, bound)
    return sizes


def _carries_sinks(shard: Shard) -> bool:
    """Whether a sequence's attention sinks enter its softmax on the server of
    this shard: on the one holding its first keys only, so that the merge by
    LSE of its servers' states counts them exactly once."""
    return shard.start == 0


def place_tokens(seq_ids, lens, seqs, free, page_size, split_min_tokens, max_servers_per_sequence):
    """Per sequence, [(server, count)] in position order: its new tokens go
    first to the server holding its last shard, then to the servers with the
    most free pages that hold none of it (at most max_servers_per_sequence
    in all, 0: any), spread by causal_spread when there are at least
    split_min_tokens (0: never), each server taking what its free pages
    hold. free (pages per server, -1: not usable) is reduced as it goes;
    seqs maps a known id to its record (.shards)."""
    ps = page_size
    chunks = []
    for sid, n in zip(seq_ids, lens):
        seq = seqs.get(sid)
        shards = seq.shards if seq is not None else []
        order = [shards[-1].server] if shards else []
        tail_len = shards[-1].length if shards else 0
        holding = {sh.server for sh in shards}
        others = sorted((i for i in range(len(free)) if free[i] >= 0 and i not in holding),
                        key=lambda i: -free[i])
        room = (max_servers_per_sequence - len(shards) if max_servers_per_sequence else len(others))
        order += others[:max(0, room)]
        if not order:
            raise AttnserveError("no server of the cluster is reachable",
                                 grpc.StatusCode.UNAVAILABLE, "plan")
        spread = split_min_tokens > 0 and n >= split_min_tokens
        sizes = causal_spread(n, len(order) if spread else 1)
        want = sizes + [0] * (len(order) - len(sizes))
        carry, mine = 0, []
        for j, srv in enumerate(order):
            tail = j == 0 and bool(shards)
            base = tail_len if tail else 0
            cap = max(0, free[srv]) * ps + (-(-base // ps) * ps - base)
            desired = want[j] + carry
            take = min(desired, cap)
            carry = desired - take
            if take > 0 or (j == 0 and n == 0 and not shards):
                mine.append((srv, take))
                free[srv] -= -(-(base + take) // ps) - -(-base // ps)
        if carry > 0:
            limit = (f", or max_servers_per_sequence={max_servers_per_sequence}"
                     if max_servers_per_sequence else "")
            # Servers with free pages that hold an earlier range of the
            # sequence cannot take its new tokens: a sequence's positions on
            # one server are one contiguous range (docs/cluster.md, "Placement").
            held = sorted({sh.server for sh in shards[:-1]
                           if free[sh.server] > 0 and sh.server != shards[-1].server})
            why = (f"; the servers with free pages ({', '.join(map(str, held))}, as servers() lists "
                   "them) hold earlier positions of it, and a sequence's positions on one server "
                   "are one range: finish it and start it again, or add a server") if held else ""
            raise ResourceExhausted(f"sequence {sid!r}: {carry} of its {n} new tokens fit "
                                    f"on no server (too few free pages{limit}){why}", method="plan")
        chunks.append(mine)
    return chunks


def share_step(seq_ids, lens, seqs, chunks, num_servers, causal):
    """Each server's share of the step: every shard of a sequence (old and
    new) attends with the step's rows of that sequence that can see some of
    it. Returns (per_server: per server [(b, appended, offset, end, skip,
    carries_sinks)], shards_after, length_after)."""
    per_server = [[] for _ in range(num_servers)]
    shards_after, length_after = [], []
    for b, (sid, n) in enumerate(zip(seq_ids, lens)):
        seq = seqs.get(sid)
        shards = [Shard(sh.server, sh.start, sh.length) for sh in seq.shards] if seq else []
        start = seq.length if seq else 0
        appended = [0] * len(shards)
        offset = 0
        for srv, count in chunks[b]:
            if shards and shards[-1].server == srv:
                shards[-1].length += count
                appended[-1] = count
            else:
                shards.append(Shard(srv, start + offset, count))
                appended.append(count)
            offset += count
        length_after.append(start + n)
        shards_after.append(shards)
        for sh, a in zip(shards, appended):
            end = sh.start + sh.length
            # The step's row r is position start + r: it sees this shard
            # from position sh.start on (causal); the rows before stay away.
            skip = min(max(sh.start - start, 0), n) if causal else 0
            per_server[sh.server].append((b, a, max(0, end - a - start), end, skip,
                                          _carries_sinks(sh)))
    return per_server, shards_after, length_after
