"""Entropy-steered experts: a token whose previous-step entropy is low runs fewer of its
routed experts (an experiment, off by default; config.py)."""

from etjax.experts.config import ExpertConfig

__all__ = ["ExpertConfig"]
