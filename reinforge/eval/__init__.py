"""Evaluation utilities."""

from reinforge.eval.passk import pass_at_k, pass_at_k_curve

__all__ = ["pass_at_k", "pass_at_k_curve"]
