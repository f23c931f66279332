"""Integrations of mxcomm into training frameworks (:mod:`mxcomm.integrations.torchtitan`); each
module imports its framework lazily."""

__all__ = []
