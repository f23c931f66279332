"""The ``hier`` transport (docs/design.md, "EP across nodes"): the pull inside each node, one
``alltoallv`` between nodes, in one exchange. Nodes are runs of consecutive ranks, so a rank's rows
for its node are one run ``[s0, s1)`` of its send order, those from it one ``[r0, r1)``::

    send order:     [ rows for earlier nodes | rows for this node | rows for later nodes ]
                      remote: alltoallv        pull (node plan)     remote: alltoallv
    caller stream:  produce(remote) begin produce(node peers) signal ... own rows  group  join
    side stream:                          wait(peer) pull(peer) ...                 done

The node's part is the pull transport on a *node plan* (the counts among the node's ranks) over rows
shifted by ``s0`` / ``r0``; the remote ``alltoallv`` is its ``beside``, running while the copy
engines pull. Every rank reserves the largest node staging of any rank (staging grows
collectively)."""

import collections
import re
import weakref

from ._grouped import land
from ._pull import PullTransport
from ._staged import Plan, call_tag, landed

#: The between-nodes part of a plan for ``alltoallv_plan``; ``generation`` None: no layout check
_Moves = collections.namedtuple("_Moves", "send_counts send_offsets recv_counts recv_offsets "
                                "generation", defaults=(None,))


class HierTransport:
    """Pull inside this rank's node, one ``alltoallv`` to the other nodes (collective to
    construct)."""

    name = "hier"

    def __init__(self, comm, nodes):
        self._comm = comm
        self.ranks = nodes.ranks(nodes.of_rank[comm.rank])
        node_comm = _NodeComm(comm, self.ranks)
        self._node_side = node_comm._side
        memory = type(comm)._new_peer_memory(node_comm)
        self._pull = node_comm._transport = PullTransport(node_comm, memory)
        self.memory = _NamedMemory(memory, node_comm.world_names)
        self._splits = weakref.WeakKeyDictionary()  # plan -> _Split
        # per rank, its node's ranks [first, end): nodes are runs of consecutive ranks
        self._spans = [(ranks[0], ranks[-1] + 1) for ranks in map(nodes.ranks, nodes.of_rank)]

    @property
    def kinds(self):
        return self._pull.kinds

    def run(self, rows, plan, outs, in_place, stream, landing=None):
        comm, split = self._comm, self._split(plan)
        if outs is None and not in_place:
            outs = comm._new_arrays(rows.arrays, plan.rows_received)
        staging = comm._new_arrays(rows.arrays, plan.rows_sent)  # the node's run stays unused
        for lo, hi in split.remote_sends:
            rows.produce(lo, hi, tuple(s[lo:hi] for s in staging), stream)

        def remote(stream):
            into = outs if landing is None and not in_place else \
                comm._new_arrays(rows.arrays, plan.rows_received)
            comm.alltoallv_plan(staging, into, split.moves, stream)
            for lo, hi in split.remote_receives:
                if in_place:
                    rows.consume(lo, hi, tuple(o[lo:hi] for o in into), stream)
                elif into is not outs:
                    land(into, outs, landing, lo, hi, stream)

        node_landing = None if in_place else split.landing(landing)
        self._pull.run(_Shifted(rows, split.s0, split.r0), split.node, outs, in_place, stream,
                       node_landing, beside=remote, tag=call_tag(plan))
        return outs

    def _split(self, plan):
        split = self._splits.get(plan)
        if split is None:
            split = self._splits[plan] = _Split(plan, self._spans)
        return split

    def close(self):
        self._splits.clear()
        self._pull.close()
        self._node_side.free()

    def abandon(self):
        """After an abort: the node's peer memory is kept (``PullTransport.abandon``)."""
        self._splits.clear()
        self._pull.abandon()


class _Split:
    """One plan cut into this node's part and the rest; ``spans``: per rank, its node's ranks
    ``[first, end)``.

    Attributes:
        node: the node plan, its staging the largest node staging of any rank.
        s0, r0: the first of this rank's rows for / from its node in send / receive order.
        remote_sends, remote_receives: the runs ``(lo, hi)`` that travel between nodes.
        moves: the ``alltoallv`` of the remote rows (the node's counts zeroed)."""

    __slots__ = ("node", "s0", "r0", "remote_sends", "remote_receives", "moves", "_landings")

    def __init__(self, plan, spans):
        a, b = spans[plan.rank]
        sent = plan.sent
        self.node = Plan(plan.rank - a, [row[a:b] for row in sent[a:b]])
        self.node._staging_rows = max(sum(row[lo:hi]) for row, (lo, hi) in zip(sent, spans))
        self.s0, s1 = plan.send_offsets[a], plan.send_offsets[b - 1] + plan.send_counts[b - 1]
        self.r0 = plan.recv_offsets[a]
        self.remote_sends = [(lo, hi) for lo, hi in ((0, self.s0), (s1, plan.rows_sent))
                             if hi > lo]
        self.remote_receives = [(plan.recv_offsets[p], plan.recv_offsets[p] + plan.recv_counts[p])
                                for p in range(plan.size)
                                if not a <= p < b and plan.recv_counts[p]]
        away = [not a <= p < b for p in range(plan.size)]
        self.moves = _Moves([c if x else 0 for c, x in zip(plan.send_counts, away)],
                            plan.send_offsets,
                            [c if x else 0 for c, x in zip(plan.recv_counts, away)],
                            plan.recv_offsets)
        self._landings = {}

    def landing(self, landing):
        """The node part's landing (received rows numbered from ``r0``)."""
        node = self._landings.get(landing)
        if node is None:
            rows = self.node.rows_received
            node = self._landings[landing] = tuple(
                (r - self.r0, at, n) for r, at, n in landed(landing, self.r0, self.r0 + rows))
        return node


class _Shifted:
    """A rows object seen from a node plan: send rows from ``s0``, received rows from ``r0``."""

    __slots__ = ("arrays", "kind", "_rows", "_s0", "_r0")

    def __init__(self, rows, s0, r0):
        self.arrays, self.kind = rows.arrays, rows.kind
        self._rows, self._s0, self._r0 = rows, s0, r0

    def produce(self, begin, end, slots, stream):
        self._rows.produce(begin + self._s0, end + self._s0, slots, stream)

    def consume(self, begin, end, rows, stream):
        self._rows.consume(begin + self._r0, end + self._r0, rows, stream)

    def keep(self, begin, end, at, slots, stream):
        self._rows.keep(begin + self._s0, end + self._s0, at + self._r0, slots, stream)


class _NodeComm:
    """The communicator as one node's peer memory sees it: ``rank``, ``size`` and side channel
    within the node, the rest the communicator's; errors name the communicator's ranks."""

    def __init__(self, comm, ranks):
        self._comm = comm
        self._ranks = ranks
        self.rank, self.size = ranks.index(comm.rank), len(ranks)
        self.world, self.world_rank = comm, comm.rank
        self._side = _NodeSide(comm._side, ranks)
        self._transport = None  # the node's PullTransport, set by HierTransport

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def world_names(self, error):
        """``error``, naming ranks within the node, renamed to the communicator's ranks."""
        def named(match):
            return match.group(1) + ", ".join(str(self._ranks[int(r)])
                                              for r in match.group(2).split(", "))
        error.args = (re.sub(r"\b(ranks? )(\d+(?:, \d+)*)", named, str(error)),)
        return error

    def _fail(self, error, raised=False):
        return self._comm._fail(self.world_names(error), raised=raised)


class _NamedMemory:
    """A node's peer memory whose device-wait failures name the communicator's ranks."""

    def __init__(self, memory, world_names):
        self._memory = memory
        failure = getattr(memory, "failure", None)  # the host's waits raise instead
        if failure is not None:
            def named_failure(kinds):
                error = failure(kinds)
                return None if error is None else world_names(error)
            self.failure = named_failure

    def __getattr__(self, name):
        return getattr(self._memory, name)


class _NodeSide:
    """A side channel whose collectives run over every rank and keep the entries of ``ranks``;
    ``mpi``: a split over the node's ranks (shared windows)."""

    def __init__(self, side, ranks):
        self._side = side
        self._ranks = ranks
        self.MPI = getattr(side, "MPI", None)
        self.mpi = side.mpi.Split(ranks[0], side.rank) if side.kind == "mpi" else None

    @property
    def collectives(self):
        return self._side.collectives

    @collectives.setter
    def collectives(self, value):
        self._side.collectives = value

    def allgather_bytes(self, payload, what):
        table = self._side.allgather_bytes(payload, what)
        n = len(payload)
        return b"".join(table[r * n:(r + 1) * n] for r in self._ranks)

    def allgather_world(self, payload, what):
        """:meth:`allgather_bytes` with every rank's entry, not the node's only."""
        return self._side.allgather_bytes(payload, what)

    def barrier(self, what="barrier"):
        self._side.barrier(what)

    def free(self):
        """Free the node's MPI communicator (after the windows over it)."""
        if self.mpi is not None:
            self.mpi.Free()
            self.mpi = None
