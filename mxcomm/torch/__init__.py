"""The EP token path as differentiable torch functions (torch autograd on top of the array API).

Glossary: M rows sent by this rank, N = M_recv rows received, P permuted rows, D hidden, H GEMM
output, E experts, E_local experts per rank, W ranks.

Tensors cross to arrays zero-copy (``mxcomm._torch_arrays``); torch allocates the results, work
is enqueued on torch's current stream. Quantized values travel as a bf16-typed
:class:`QuantizedTensor` (``"mxfp8"``: :class:`MXFP8Tensor`), so autograd hands them bf16
gradients; any other torch op sees its dequantized values::

    forward:   x --a2a_dispatch--> MXFP8Tensor --permute--> MXFP8Tensor --GEMM--> bf16
                 --unpermute--> bf16 --a2a_combine--> out
    backward:  grad(out) --a2a_combine bwd--> MXFP8Tensor --unpermute bwd--> MXFP8Tensor
                 --GEMM bwd--> bf16 --permute bwd--> bf16 --a2a_dispatch bwd--> grad(x) bf16

One module per autograd Function family (docs/design.md, "Layers"). ``import mxcomm`` never
imports torch.
"""

# the private names below are re-exported for the benchmarks' probes and the tests
from .._torch_arrays import _Alloc, _array, _stream, _tensor
from .._torch_gemm import WeightCache, fp8_gemm_available, grouped_mm
from . import _gemm_op  # noqa: F401 (registers mxcomm::grouped_mm, which grouped_mm calls)
from ._dropin import all_to_all_single, all_to_all_single_fn
from ._layout import TensorLayout, exchange_layout
from ._ops import _A2A, LayoutHandle, _exchange_direct, a2a_combine, a2a_dispatch, communicator_for
from ._permute import permute, unpermute
from ._quantized import MXFP8Tensor, QuantizedTensor, _quantized_tensor
from ._tensors import _index_array

__all__ = ["QuantizedTensor", "MXFP8Tensor", "grouped_mm", "fp8_gemm_available",
           "TensorLayout", "LayoutHandle", "exchange_layout", "a2a_dispatch", "permute",
           "unpermute", "a2a_combine", "all_to_all_single", "all_to_all_single_fn",
           "communicator_for", "ExpertParallel", "EPHandle", "WeightCache"]

from .._torch_ep import EPHandle, ExpertParallel  # noqa: E402 (it builds on the above)
