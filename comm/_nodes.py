"""Node membership: which ranks may map each other's memory, agreed in one side-channel round from,
in order: ``node_size`` (``init``'s, else ``$MXCOMM_NODE_SIZE``: *emulated* nodes of consecutive
ranks inside real ones); ``NCCL_HOSTID`` where every rank sets it; else host name and boot id.
NCCL's host hash (``getHostHash``, ``src/misc/utils.cc``) reads ``NCCL_HOSTID``, so the NCCL
backend sets it for an emulation."""

import dataclasses
import hashlib
import os

import numpy

from ._board import node_key

NODE_SIZE_ENV = "MXCOMM_NODE_SIZE"
NCCL_HOSTID_ENV = "NCCL_HOSTID"
_KEY = 20  # bytes of a host key (sha1)


@dataclasses.dataclass(frozen=True)
class Nodes:
    """Which node each rank is on: ``of_rank``, W ints numbered by their first rank; ``emulated``:
    the split came from ``node_size``."""

    of_rank: tuple
    emulated: bool = False

    @property
    def count(self):
        return max(self.of_rank) + 1

    def export_hostid(self, rank):
        """Set ``NCCL_HOSTID=node<k>`` for ``rank`` of emulated nodes, for NCCL built later."""
        if self.emulated:
            os.environ[NCCL_HOSTID_ENV] = f"node{self.of_rank[rank]}"

    def ranks(self, node):
        return [r for r, n in enumerate(self.of_rank) if n == node]

    @property
    def consecutive(self):
        """Whether every node's ranks are consecutive (a rank's rows for one node are one run)."""
        return all(b - a in (0, 1) for a, b in zip(self.of_rank, self.of_rank[1:]))


def _node_size_here(node_size):
    """This rank's node size (0: none; -1: ``$MXCOMM_NODE_SIZE`` not an int)."""
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
    first = {}
    return tuple(first.setdefault(k, len(first)) for k in keys)


def discover(side, node_size=None):
    """The :class:`Nodes` of the side channel's ranks (collective: one allgather).

    Raises:
        ValueError (on every rank): different or non-positive node sizes; ``NCCL_HOSTID`` on some
            ranks only, or splitting unlike ``node_size``; a node spanning two hosts.
        TimeoutError: a rank did not join within the side channel's timeout."""
    hostid = os.environ.get(NCCL_HOSTID_ENV)
    mine = numpy.zeros(2 + 2 * _KEY // 8, numpy.int64)
    mine[0] = _node_size_here(node_size)
    mine[1] = hostid is not None
    words = node_key() + (hashlib.sha1(hostid.encode()).digest() if hostid is not None
                          else bytes(_KEY)) + bytes(-2 * _KEY % 8)
    mine[2:] = numpy.frombuffer(words, numpy.int64)
    table = side.allgather_array(mine, "node discovery")
    sizes = table[:, 0].tolist()
    where = f"on rank {side.rank}"
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
