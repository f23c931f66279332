"""The layout exchange (step 0) on tensors.

Glossary: E experts, E_local experts per rank, W ranks.
"""

import torch

from .. import layout as _layout
from .._torch_arrays import _array, _stream, _tensor
from . import _ops


class TensorLayout(_layout.Layout):
    """:class:`mxcomm.layout.Layout` whose ``group_tensor`` is its (E,) int32
    ``num_tokens_per_expert_group``; unpacks as ``(group tensor, input_splits, output_splits)``."""

    @classmethod
    def of(cls, layout):
        """The array API's ``layout`` on tensors."""
        self = cls(layout.comm, layout.num_tokens_per_expert_group, layout.counts,
                   layout.num_local_experts)
        self.group_tensor = _tensor(layout.num_tokens_per_expert_group)
        return self

    def __iter__(self):
        return iter((self.group_tensor, self.input_splits, self.output_splits))

    def __getitem__(self, i):
        return (self.group_tensor, self.input_splits, self.output_splits)[i]


def exchange_layout(num_tokens_per_expert, comm):
    """Step 0 on tensors; see :func:`mxcomm.exchange_layout` (the one host synchronization).

    Args:
        num_tokens_per_expert: (E,) integer tensor (int64 from ``bincount`` is fine).
        comm: an mxcomm communicator, or a ProcessGroup or 1-D DeviceMesh (its
            :func:`communicator_for`).
    Returns:
        A :class:`TensorLayout` for the steps' calls (no host collective per call). While
        ``torch.compile`` traces: a :class:`LayoutHandle` (the op ``mxcomm::exchange_layout``),
        which the exchanges take with ``permute_align``.
    """
    if torch.compiler.is_compiling():
        import torch.distributed as dist
        size = comm.size() if isinstance(comm, dist.ProcessGroup) else \
            comm.size() if callable(comm.size) else comm.size  # W, traceable
        handle = torch.ops.mxcomm.exchange_layout(num_tokens_per_expert, _ops.group_key(comm))
        return _ops.LayoutHandle(handle, num_tokens_per_expert.shape[0] // size)
    if not hasattr(comm, "alltoallv"):  # a ProcessGroup or a DeviceMesh: its communicator
        comm = _ops.communicator_for(comm)
    _ops._registry.register(comm)  # found again by a compiled region's ops
    return _exchange_layout(num_tokens_per_expert, comm)


def _exchange_layout(num_tokens_per_expert, comm):
    """:func:`exchange_layout` in eager (and the op ``mxcomm::exchange_layout``'s body)."""
    device = num_tokens_per_expert.device
    made = []

    def upload(host):  # the group counts, copied by torch on its current stream, as an array
        t = torch.from_numpy(host)
        if device.type != "cpu":
            t = t.to(device, non_blocking=True)  # pageable: staged before this returns
        made.append(t)
        return _array(t, "num_tokens_per_expert_group")

    layout = _layout._exchange(_array(num_tokens_per_expert, "num_tokens_per_expert"), comm,
                               _stream(num_tokens_per_expert), TensorLayout, upload)
    layout.group_tensor = made[0]
    return layout


@torch.library.custom_op(f"{_ops.NAMESPACE}::exchange_layout", mutates_args=())
def _exchange_layout_op(num_tokens_per_expert: torch.Tensor, group: str) -> torch.Tensor:
    """Step 0 (``mxcomm.torch.exchange_layout``'s eager body) -> the layout's handle."""
    layout = _exchange_layout(num_tokens_per_expert, _ops._registry.communicator(group))
    return _ops._registry.add_layout(layout)


@_exchange_layout_op.register_fake
def _(num_tokens_per_expert, group):
    return torch.empty(1, dtype=torch.int64, device="cpu")
