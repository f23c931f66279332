"""mxcomm: low-precision (MXFP8) expert-parallel communication primitives for MoE training.

Arrays in, arrays out (CuPy on a GPU, NumPy on a CPU: ``mxcomm._platform``); torch adapters live in
``mxcomm.torch`` (imported explicitly: torch is optional); communicators in ``mxcomm.comm``.
"""

__version__ = "0.1.0"

from . import _platform

# Where array work runs (MXCOMM_BACKEND), decided first: a bad value fails here, clearly.
_platform.backend()

# Importing a format's module registers its formats (mxcomm.formats), in this order.
from . import mxfp8, rowwise, block128  # noqa: I001 (the registry's order)
from . import colwise, comm
from .a2a import (a2a_combine, a2a_combine_backward, a2a_dispatch, a2a_dispatch_backward,
                  all_to_all_single)
from .formats import sqnr
from .layout import exchange_layout
from .mxfp8 import MXFP8Array, dequantize_mxfp8, quantize_mxfp8
from .permutation import permute, permute_backward, unpermute, unpermute_backward

__all__ = [
    "__version__", "comm", "rowwise", "block128", "colwise", "MXFP8Array", "quantize_mxfp8",
    "dequantize_mxfp8",
    "exchange_layout", "a2a_dispatch", "a2a_dispatch_backward", "permute", "permute_backward",
    "unpermute", "unpermute_backward", "a2a_combine", "a2a_combine_backward", "all_to_all_single",
    "sqnr",
]
