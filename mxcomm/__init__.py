"""mxcomm: low-precision (MXFP8) expert-parallel communication primitives for MoE training."""

__version__ = "0.1.0"
