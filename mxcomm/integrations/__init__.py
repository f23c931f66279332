"""Integrations of mxcomm into training frameworks; each module imports its framework lazily.

- :mod:`mxcomm.integrations.torchtitan`: torchtitan's MoE token dispatcher with the EP dispatch
  and combine in low precision (torchtitan 0.3), and the one-line patch for torchtitan 0.2.x.
"""

__all__ = []
