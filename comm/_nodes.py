"""Node membership: which ranks share a node, agreed on every rank, with an emulation override.

A *node* is a set of ranks that may map each other's memory (CUDA IPC, an MPI shared window) and
between which NCCL takes its intra-node transports. ``discover`` finds them in one side-channel
round, in this order:

1. the override ``node_size`` (``init(node_size=...)``, else ``$MXCOMM_NODE_SIZE``): ranks split
   into consecutive groups of ``node_size`` (the last may be smaller), *emulated* nodes inside
   real ones. For NCCL to see the same split, the NCCL backend sets ``NCCL_HOSTID=node<k>``
   (NCCL's host hash, ``getHostHash`` in NCCL's ``src/misc/utils.cc``, reads it instead of the
   host name and boot id) before NCCL is built; a ``NCCL_HOSTID`` already set must split the
   ranks alike.
2. ``NCCL_HOSTID``, where every rank has it: the ranks NCCL puts on one host.
3. the launcher: host name and boot id (``_board.node_key``).

Every verdict comes from the gathered table, so a disagreement is the same ``ValueError`` on
every rank.
"""

import dataclasses
import hashlib
import os

import numpy

from ._board import node_key

#: The environment's default of ``init``'s ``node_size``.
NODE_SIZE_ENV = "MXCOMM_NODE_SIZE"
#: NCCL's override of its host hash (src/misc/utils.cc, ``getHostHash``).
NCCL_HOSTID_ENV = "NCCL_HOSTID"
_KEY = 20  # bytes of a host key (sha1)


@dataclasses.dataclass(frozen=True)
class Nodes:
    """Which node each rank is on (the same record on every rank).

    Attributes:
        of_rank: W ints, the node of each rank, numbered by their first rank.
        emulated: True when the split came from ``node_size`` (nodes inside a real one).
    """

    of_rank: tuple
    emulated: bool = False

    @property
    def count(self):
        """The number of nodes."""
        return max(self.of_rank) + 1

    def export_hostid(self, rank):
        """Set ``NCCL_HOSTID=node<k>`` for ``rank`` of emulated nodes (NCCL built later in this
        process sees the split); nothing for real ones."""
        if self.emulated:
            os.environ[NCCL_HOSTID_ENV] = f"node{self.of_rank[rank]}"

    def ranks(self, node):
        """The ranks of ``node``, ascending."""
        return [r for r, n in enumerate(self.of_rank) if n == node]

    @property
    def consecutive(self):
        """Whether every node's ranks are consecutive (launchers place ranks by node), so each
        rank's rows for one node, and from it, are one run of its send and receive order."""
        return all(b - a in (0, 1) for a, b in zip(self.of_rank, self.of_rank[1:]))


def _node_size_here(node_size):
    """This rank's override: ``node_size``, else ``$MXCOMM_NODE_SIZE``, as an int (0: none; -1:
    the variable is not an int, reported by ``discover`` on every rank)."""
    if node_size is not None:
        return node_size
    text = os.environ.get(NODE_SIZE_ENV, "").strip()
    if not text:
        return 0
    try:
        return int(text)
    except ValueError:
        return -1


def _numbered(keys):
    """Node numbers of ``keys`` (one per rank), by their first rank."""
    first = {}
    return tuple(first.setdefault(k, len(first)) for k in keys)


def discover(side, node_size=None):
    """The :class:`Nodes` of the side channel's ranks (collective: one allgather).

    Args:
        side: the host side channel.
        node_size: None (``$MXCOMM_NODE_SIZE``, else no override) or a positive int: emulated
            nodes of that many consecutive ranks (:meth:`Nodes.export_hostid` then tells NCCL).
    Returns:
        :class:`Nodes`.
    Raises:
        ValueError (on every rank): the ranks gave different node sizes, or one that is not a
            positive int; an emulated node spans two real hosts; ``NCCL_HOSTID`` set on some
            ranks only, or splitting the ranks unlike ``node_size``; a ``NCCL_HOSTID`` node
            spanning two real hosts.
        TimeoutError: a rank did not join within the side channel's timeout.
    """
    hostid = os.environ.get(NCCL_HOSTID_ENV)
    mine = numpy.zeros(2 + 2 * _KEY // 8, numpy.int64)
    mine[0] = _node_size_here(node_size)
    mine[1] = hostid is not None
    words = node_key() + (hashlib.sha1(hostid.encode()).digest() if hostid is not None
                          else bytes(_KEY)) + bytes(-2 * _KEY % 8)
    mine[2:] = numpy.frombuffer(words, numpy.int64)
    table = side.allgather_array(mine, "node discovery")
    sizes = table[:, 0].tolist()
    rank, where = side.rank, f"on rank {side.rank}"
    hosts = [table[r, 2:].tobytes()[:_KEY] for r in range(side.size)]
    hostids = [table[r, 2:].tobytes()[_KEY:2 * _KEY] if table[r, 1] else None
               for r in range(side.size)]
    if len(set(sizes)) > 1 or sizes[0] < 0:
        raise ValueError(f"node_size {where}: the ranks must give the same positive int (init's "
                         f"node_size, else ${NODE_SIZE_ENV}; 0: none), but they gave "
                         f"{dict(enumerate(sizes))} (rank: size; -1: not an int)")
    if any(h is None for h in hostids) and not all(h is None for h in hostids):
        raise ValueError(f"${NCCL_HOSTID_ENV} {where}: set on ranks "
                         f"{[r for r, h in enumerate(hostids) if h is not None]} only; NCCL "
                         f"would see a mix of host ids and host names")
    real = _numbered(hosts)
    if sizes[0]:
        nodes = Nodes(tuple(r // sizes[0] for r in range(side.size)), emulated=True)
        if hostids[0] is not None and _numbered(hostids) != nodes.of_rank:
            raise ValueError(f"node_size {where}: ${NCCL_HOSTID_ENV} puts the ranks on nodes "
                             f"{list(_numbered(hostids))}, node_size={sizes[0]} on "
                             f"{list(nodes.of_rank)}; NCCL and mxcomm must see one split")
    else:
        nodes = Nodes(_numbered(hostids) if hostids[0] is not None else real)
    for node in range(nodes.count):
        machines = {real[r] for r in nodes.ranks(node)}
        if len(machines) > 1:
            why = f"node_size={sizes[0]}" if sizes[0] else f"${NCCL_HOSTID_ENV}"
            raise ValueError(f"{why} {where}: node {node} (ranks {nodes.ranks(node)}) spans "
                             f"{len(machines)} hosts; an emulated node must lie inside one")
    return nodes
