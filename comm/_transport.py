"""Which transport moves the staged exchange's rows, chosen once per communicator."""

import numpy

from ._grouped import GroupedTransport
from ._hier import HierTransport
from ._nodes import discover
from ._pull import PullTransport


def transport_of(nodes, votes, peer_memory=None):
    """The transport's name from the agreed ``_nodes.Nodes``, every rank's vote that it can map
    its node's peer memory, and the communicator's ``peer_memory`` (None, True or False):

    | nodes | peer memory on every rank | ``peer_memory`` | transport |
    | --- | --- | --- | --- |
    | one | yes | None or True | ``"pull"`` |
    | several, each a run of consecutive ranks | yes | True | ``"hier"`` |
    | otherwise | | | ``"grouped"`` |

    Across nodes ``hier`` is asked for, not chosen: on 2 emulated nodes × 2 H200s NCCL's own
    alltoallv (NVLink inside a node, its network between) ran the fp8 recipe's layer 1.66-1.71×
    over bf16 at 131072 rows where ``hier`` ran 1.49-1.52× (docs/design.md, "The choice")."""
    if not all(votes):
        return "grouped"
    if nodes.count == 1:
        return "pull"
    if nodes.consecutive and peer_memory:
        return "hier"
    return "grouped"


def choose(comm, peer_memory):
    """The transport of ``comm.exchange`` (:func:`transport_of`); collective: one host allgather,
    from the backends' constructors. ``peer_memory``: None uses peer memory where every rank can,
    True requires it, False never. The same round resolves ``small_exchange_bytes`` and
    ``medium_exchange_bytes`` (None: the backend's default on one node, else 0).

    Raises:
        RuntimeError (on every rank): ``peer_memory=True`` and some rank cannot map its peers'
            memory, or the nodes are not runs of consecutive ranks.
        ValueError (on every rank): the ranks gave different exchange limits."""
    nodes = comm._side.nodes
    if nodes is None:  # a communicator built without init: the launcher's nodes
        nodes = comm._side.nodes = discover(comm._side)
    one_node = nodes.count == 1
    if comm.small_exchange_bytes is None:
        comm.small_exchange_bytes = comm.SMALL_EXCHANGE_BYTES if one_node else 0
    if comm.medium_exchange_bytes is None:
        comm.medium_exchange_bytes = comm.MEDIUM_EXCHANGE_BYTES if one_node else 0
    here = peer_memory is not False and comm._peer_memory_here()
    table = comm.allgather(numpy.array([here, comm.small_exchange_bytes,
                                        comm.medium_exchange_bytes], numpy.int64),
                           "peer memory setup (vote)")
    votes = table[:, 0].tolist()
    for column, name in ((1, "small_exchange_bytes"), (2, "medium_exchange_bytes")):
        limits = table[:, column].tolist()
        if len(set(limits)) > 1:
            raise ValueError(f"{name} on rank {comm.rank}: the ranks must agree, but they gave "
                             f"{dict(enumerate(limits))} (rank: bytes)")
    name = transport_of(nodes, votes, peer_memory)
    if peer_memory and name == "grouped":
        ranks = [r for r, v in enumerate(votes) if not v]
        raise RuntimeError(f"peer_memory=True on rank {comm.rank}: ranks {ranks} cannot map "
                           f"their peers' memory, or the nodes "
                           f"{list(nodes.of_rank)} (node of each rank) are not runs of "
                           f"consecutive ranks (peer access between GPUs, on the host an MPI "
                           f"communicator)")
    if name == "pull":
        return PullTransport(comm, comm._new_peer_memory())
    if name == "hier":
        return HierTransport(comm, nodes)
    return GroupedTransport(comm)
