"""The EP token path as differentiable torch functions (torch autograd on top of the array API).

Glossary: M rows sent by this rank, N = M_recv rows received, P permuted rows, D hidden, H GEMM
output, E experts, E_local experts per rank, W ranks.

Tensors cross to arrays zero-copy: a CUDA tensor is seen as a CuPy array over its memory (built
from ``data_ptr``: CuPy's DLPack import costs 17-27 us of host time per tensor), a CPU tensor as a
NumPy array; bf16 as ml_dtypes' bf16, fp8 as uint8 bits. The exchanges' results are allocated by
torch (the engine's ``alloc``), so they come back as those tensors, with no DLPack export and no
second memory pool. Work is enqueued on torch's current CUDA stream; CPU tensors run with the host
backend and the MPI communicator, so CI exercises autograd too. Given a layout, a plain tensor whose
exchange is one ``alltoallv`` (a plain precision, or a small quantized exchange) or a staged one
whose result stays quantized skips all that: checked in O(1) against its route
(``mxcomm.route``), it is passed by its address, and results are allocated by torch
(docs/design.md, "One route").

Quantized values travel as a :class:`QuantizedTensor` (any format of ``mxcomm.formats``; its
``"mxfp8"`` case is :class:`MXFP8Tensor`), a bf16-typed wrapper holding e4m3 data and the format's
scales. It has to be bf16-typed: autograd casts a gradient to the dtype of the output it flows
into, so an fp8-typed output would receive fp8 gradients. Any torch op on it (``torch._grouped_mm``
included) runs on its dequantized bf16 values, with a straight-through gradient::

    forward:   x --a2a_dispatch--> MXFP8Tensor --permute--> MXFP8Tensor --GEMM--> bf16
                 --unpermute--> bf16 --a2a_combine--> out
    backward:  grad(out) --a2a_combine bwd--> MXFP8Tensor --unpermute bwd--> MXFP8Tensor
                 --GEMM bwd--> bf16 --permute bwd--> bf16 --a2a_dispatch bwd--> grad(x) bf16

The package's modules, one per autograd Function family: ``_quantized`` (QuantizedTensor),
``_tensors`` (tensors as the array API's rows, the exchanges on tensors), ``_layout`` (step 0),
``_a2a`` (steps 1 and 5), ``_permute`` (steps 2 and 4), ``_dropin`` (``all_to_all_single``),
``_ops`` (the custom ops through which ``torch.compile`` traces the token path: docs/design.md,
"torch.compile and custom ops"). torch is imported by this package, by mxcomm's private torch
helpers (``mxcomm._torch_arrays``: tensors as arrays and back; ``mxcomm._torch_gemm``: the fp8
grouped GEMM), by the integrations (``mxcomm.integrations``, lazily) and by the benchmarks; never by
``import mxcomm``.
"""

# the private names below are re-exported for the benchmarks' probes and the tests
from .._torch_arrays import _array, _stream, _tensor
from .._torch_gemm import WeightCache, fp8_gemm_available, grouped_mm
from . import _gemm_op  # noqa: F401 (registers mxcomm::grouped_mm, which grouped_mm calls)
from ._a2a import _A2ACombine, _A2ADispatch, a2a_combine, a2a_dispatch
from ._dropin import all_to_all_single, all_to_all_single_fn
from ._layout import TensorLayout, exchange_layout
from ._ops import LayoutHandle, communicator_for
from ._permute import _Permute, permute, unpermute
from ._quantized import MXFP8Tensor, QuantizedTensor, _quantized_tensor
from ._tensors import _Alloc, _exchange, _exchange_direct, _index_array

__all__ = ["QuantizedTensor", "MXFP8Tensor", "grouped_mm", "fp8_gemm_available",
           "TensorLayout", "LayoutHandle", "exchange_layout", "a2a_dispatch", "permute",
           "unpermute", "a2a_combine", "all_to_all_single", "all_to_all_single_fn",
           "communicator_for", "ExpertParallel", "EPHandle", "WeightCache"]

from .._torch_ep import EPHandle, ExpertParallel  # noqa: E402 (it builds on the above)
