"""Optimizer and learning-rate schedule."""

from __future__ import annotations

import math

import torch


def build_optimizer(model: torch.nn.Module, lr: float, weight_decay: float = 0.0) -> torch.optim.AdamW:
    """AdamW, with torch's fused kernel where the parameters' device has one (CPU and CUDA): one
    kernel for all parameters instead of several per tensor (~5x faster on the built-in model)."""
    params = [p for p in model.parameters() if p.requires_grad]
    fused = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params) or None
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.99), fused=fused)


def warmup_cosine(
    optimizer: torch.optim.Optimizer, warmup: int, total: int, final_fraction: float = 0.1
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up to the peak, then cosine decay to `final_fraction` of it at `total`."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return final_fraction + (1 - final_fraction) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def warmup_constant(optimizer: torch.optim.Optimizer, warmup: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0)
