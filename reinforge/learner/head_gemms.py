"""The bf16 LM head's backward GEMMs on CUDA (learner/logprobs.py): a chunk's fp32 logit gradient split into
two bf16 parts through cuBLAS's 16-bit GEMMs with fp32 accumulation and output, and the weight gradient
accumulated across chunks in fp32. On the CPU (tests) the same products through the upcast fp32 GEMM."""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("reinforge.learner.logprobs")   # one logger for the head's fast paths and their fallbacks

# The weight gradient accumulated by cuBLAS itself (`torch.addmm(..., out_dtype=torch.float32, out=acc)`: beta = 1
# on the fp32 accumulator) instead of a fresh [V, H] fp32 product per chunk added after it; None until checked
# once on the device against the product plus the add (`accumulate_mm32`).
_ADDMM32 = {"on": None}


def split_grads(dz: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, need_h: bool,
                 grad_weight: torch.Tensor | None) -> torch.Tensor | None:
    """dz W (fp32, returned) and dz^T h (added to the fp32 `grad_weight`, unless None) for a chunk's fp32 logit
    gradient dz [C, V] (overwritten) and bf16 hidden [C, H] and weight [V, H], through bf16 GEMMs with fp32
    accumulation and output: dz = hi + lo, two bf16 numbers per entry (hi its rounding, lo the rest's), exact
    to ~2^-16 of each entry (2 x 8 significant bits), and the products of bf16 numbers exact in fp32. The
    gradients come back in bf16 (rounding 2^-9), so this is the fp32 head's gradient within a fraction of
    that rounding, at the tensor cores' rate. hi and lo are the halves of one [2C, V] bf16 buffer, so each
    product is one GEMM over both."""
    c = dz.shape[0]
    parts = dz.new_empty(2 * c, dz.shape[1], dtype=weight.dtype)    # [hi; lo]
    hi, lo = parts[:c], parts[c:]
    hi.copy_(dz)
    lo.copy_(dz.sub_(hi))             # dz - hi in fp32 (hi widened exactly), then rounded
    grad_h = None
    try:
        if need_h:
            both = mm32(parts, weight)   # [2C, H]: hi W over lo W
            grad_h = both[:c].add_(both[c:])
        if grad_weight is not None:
            h = hidden.to(weight.dtype)
            accumulate_mm32(grad_weight, parts.t(), torch.cat([h, h]))
    except (RuntimeError, TypeError):
        dz.add_(hi)   # dz back for the caller's fallback: hi is dz's rounding, so dz - hi was exact (Sterbenz)
        raise
    return grad_h


def accumulate_mm32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b for fp32 `acc` and 16-bit a, b: on CUDA cuBLAS's 16-bit GEMM with fp32 output adding into
    `acc` (`_ADDMM32`, checked once against the product plus the add), else the fp32 product, then the add."""
    if acc.device.type == "cuda" and _ADDMM32["on"] is None:
        _ADDMM32["on"] = addmm32_works(acc.device, a.dtype)
    if acc.device.type == "cuda" and _ADDMM32["on"]:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.add_(mm32(a, b))


def addmm32_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)` adds the fp32 product of 16-bit a, b
    into acc on `device`, here checked on small integers (exact in every order) against the product plus the
    add; logged when it does not."""
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randint(-8, 9, shape, generator=g).to(device=device, dtype=dtype) for shape in ((64, 96), (96, 32)))
    acc = torch.randint(-8, 9, (64, 32), generator=g).to(device=device, dtype=torch.float32)
    want = acc + a.float() @ b.float()
    try:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    except (RuntimeError, TypeError, NotImplementedError) as err:
        log.warning("LM head backward: the 16-bit GEMM adding into an fp32 gradient is unavailable (%s: %s); adding "
                    "each chunk's product instead", type(err).__name__, str(err)[:200])
        return False
    if not torch.equal(acc, want):
        log.warning("LM head backward: the 16-bit GEMM adding into an fp32 gradient gave other numbers than the "
                    "product plus the add; adding each chunk's product instead")
        return False
    return True


def mm32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b of 16-bit matrices in fp32: on CUDA the 16-bit GEMM with fp32 output, elsewhere (tests) the
    upcast fp32 product, the same products."""
    if a.device.type == "cuda":
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())
