"""The CPU kernels' tile parameters, chosen on the machine by timing, once per build.

The packed products (csrc/gemm.h, `gemm_packed`) keep a block of R rows x 32 columns of
accumulators in registers. The best R is a property of the CPU, not of the model: with AVX-512's
32 vector registers 6 to 12 rows fit, while AVX2 splits each 16-float vector in two of its 16
registers, so a block of 6 spills. The kernels were first tuned on one AMD EPYC; on another CPU
the value chosen there can be the slow one. So on first use the candidates are timed on shapes of
the decoding step and of a learner pass (the built-in model's), and apart on wide products (K > 256,
panels larger than L1: a 0.5B model's, where larger blocks re-read each panel fewer times); the fastest
total of each (the default 6 unless another is 5% faster) is kept in a JSON file next to the compiled
library (whose cache key holds the CPU already, so the choice is remade for a new CPU or new kernel
sources), and the choice is logged once.

Every candidate computes each output element with the same additions in the same order (one
accumulator per element, summed over k in turn), so the choice changes the speed only, never a
number: tests/unit/kernels/test_tuning.py checks the products bit for bit.

Then, for the learner's passes, the packed products against ATen's (MKL's sgemm) on the plain weights
(csrc/gemm.h, `product`): the panels were written where MKL re-packed every weight at every decoding
call, on an AMD EPYC; on an Intel Xeon with AVX-512, MKL ran the learner's products 20-40% faster
than the panels. ATen is chosen only when it is MARGIN faster (the geometric mean over the shapes).
This changes float rounding (another summation order), not the function: the kernels' outputs agree
to ~1e-6 either way (tests/unit/kernels/test_tuning.py), as they agree with the PyTorch layers. The
rollout engine always runs the packed products (see USES).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

ROW_BLOCKS = (2, 3, 4, 6, 8, 10, 12)       # csrc/gemm.h, ROW_BLOCKS
DEFAULT_ROW_BLOCK = 6
# (rows, K, N) of products the kernels run: the built-in model's decoding step (64 rows; qkv, MLP up),
# learner passes over 960 and 8192 tokens of it (an RL batch; an SFT batch of the tool task's
# conversations). K <= 256: panels that fit in L1 (csrc/gemm.h, WIDE_K).
SHAPES = ((64, 128, 384), (64, 128, 1024), (960, 128, 512), (8192, 128, 384))
# Wide products (K > 256: each block of rows reads the panel again from L2), which get a row block of their own:
# a 0.5B-shaped model's decoding steps (hidden 896, MLP 4,864) at 32 and 64 rows, and the built-in model's MLP
# down projection in a learner pass (K 512).
WIDE_SHAPES = ((32, 896, 1152), (32, 896, 4864), (32, 4864, 896), (64, 896, 4864), (960, 512, 128))
WIDE_K = 256                                # csrc/gemm.h, WIDE_K
ROUNDS = 5
# Another row block replaces the default only when it is this much faster: closer timings are noise (on the
# AMD EPYC 6, 8, 10 and 12 were within 2% on these shapes, while 12 was 10% slower than 6 on the tool task's SFT
# step), and the default is the value the kernels were tuned and tested with longest.
MARGIN = 0.05
ENV = "REINFORGE_KERNEL_ROW_BLOCK"
# The learner's products, timed packed against plain (csrc/gemm.h, `product`): passes over many tokens, with w^T
# (the forward's) and with w (the backward's input gradients). The rollout engine keeps the packed products
# whatever this says: they sum each row in one order whatever the other rows, so a prompt's samples do not
# depend on the batch it shares, bit for bit, which MKL's row-count-dependent kernels would not keep.
USES = {
    "learner": ((960, 128, 384, False), (960, 128, 1024, False), (960, 512, 128, False), (960, 128, 1024, True),
                (8192, 128, 1024, False)),
}
# How many times a packed weight serves before the weights change: packing is part of the packed products'
# cost. A learner forward packs for its passes and its backward, once per optimizer step.
PACK_USES = {"learner": 1}
# More rounds than the row block's: the choice rests on fewer timings, one per shape and backend.
PRODUCT_ROUNDS = 9
BACKENDS = ("packed", "aten")
PRODUCTS_ENV = "REINFORGE_KERNEL_PRODUCTS"


def time_row_blocks(ops: Any, shapes=SHAPES, rounds: int = ROUNDS) -> dict[int, float]:
    """Seconds of one pass over `shapes` per row block: the fastest of `rounds` passes, the candidates
    taking turns within each round so that load that comes and goes favours none of them."""
    gen = torch.Generator().manual_seed(0)
    cases = []
    for m, k, n in shapes:
        a = torch.randn(m, k, generator=gen)
        cases.append((a, ops.pack_weight(torch.randn(n, k, generator=gen)), n))
    best = {r: float("inf") for r in ROW_BLOCKS}
    for _ in range(rounds):
        for r in ROW_BLOCKS:
            start = time.perf_counter()
            for a, packed, n in cases:
                ops.packed_matmul(a, packed, None, n, r)
            best[r] = min(best[r], time.perf_counter() - start)
    return best


def time_products(ops: Any, uses=USES, rounds: int = PRODUCT_ROUNDS) -> dict[str, dict[str, list[float]]]:
    """Seconds of each use's products per backend and shape (use -> backend -> [s per shape]): the fastest of
    `rounds`, the backends taking turns within each round; a packed product's seconds include its share of
    packing the weight (PACK_USES). (m, k, n, transposed): transposed products take a [k, n] weight, as the
    backward's input gradients do (pack_weight's `transposed`; plain: its view w^T)."""
    gen = torch.Generator().manual_seed(0)
    cases = {use: [(torch.randn(m, k, generator=gen),
                    torch.randn(k, n, generator=gen) if transposed else torch.randn(n, k, generator=gen), n, transposed)
                   for m, k, n, transposed in shapes] for use, shapes in uses.items()}
    best = {use: {b: [float("inf")] * len(shapes) for b in BACKENDS} for use, shapes in uses.items()}
    for _ in range(rounds):             # rounds outermost: load that comes and goes meets both backends alike
        for use, shapes in cases.items():
            for i, (a, w, n, transposed) in enumerate(shapes):
                start = time.perf_counter()
                packed = ops.pack_weight(w, transposed)
                pack = time.perf_counter() - start
                start = time.perf_counter()
                ops.packed_matmul(a, packed, None, n, 0)
                seconds = time.perf_counter() - start + pack / PACK_USES.get(use, 1)
                best[use]["packed"][i] = min(best[use]["packed"][i], seconds)
                start = time.perf_counter()
                ops.packed_matmul(a, w.t() if transposed else w, None, n, 0)
                best[use]["aten"][i] = min(best[use]["aten"][i], time.perf_counter() - start)
    return best


def aten_over_packed(per_shape: dict[str, list[float]]) -> float:
    """The geometric mean over shapes of ATen's time over the packed products': each shape counts alike,
    so the largest (8,192 rows, ~9x the others' time) does not decide alone."""
    ratios = [a / p for a, p in zip(per_shape["aten"], per_shape["packed"], strict=True)]
    return math.exp(sum(math.log(r) for r in ratios) / len(ratios))


def choose(ops: Any, library: Path) -> dict:
    """Set the kernels' row blocks (narrow and wide products) and choose each use's products (the learner's):
    each from its environment variable when set (`$REINFORGE_KERNEL_ROW_BLOCK`, both row blocks;
    `$REINFORGE_KERNEL_PRODUCTS` = packed or aten), else the choice cached next to `library`, else timed now
    (then cached). Returns the choice as a record: row_block, row_block_wide, products {use: backend}, how each
    was chosen, and the timings in ms when timed."""
    forced = os.environ.get(ENV)
    forced_products = os.environ.get(PRODUCTS_ENV)
    if forced and int(forced) not in ROW_BLOCKS:
        raise ValueError(f"{ENV}={forced}: the row block must be one of {', '.join(map(str, ROW_BLOCKS))}")
    if forced_products and forced_products not in BACKENDS:
        raise ValueError(f"{PRODUCTS_ENV}={forced_products}: one of {', '.join(BACKENDS)}")
    if forced:      # nothing timed: the forced row block, and packed products unless those are forced too
        choice = {"row_block": int(forced), "row_block_wide": int(forced), "source": ENV,
                  "products": dict.fromkeys(USES, "packed")}
    else:
        cache = library.with_name(library.stem + ".tuning.json")
        try:
            choice = {**json.loads(cache.read_text()), "source": "cached"}
        except (OSError, ValueError):
            choice = {}
        if not _complete(choice):       # none cached, or cached before a choice this version makes
            choice = _timed(ops, cache)
    ops.set_row_block(choice["row_block"])
    ops.set_row_block(choice["row_block_wide"], True)
    if forced_products:
        choice.update(products=dict.fromkeys(USES, forced_products), products_source=PRODUCTS_ENV)
    return choice


def _complete(choice: dict) -> bool:
    """Whether a cached choice holds both row blocks and a backend for every use."""
    products = choice.get("products")
    return (choice.get("row_block") in ROW_BLOCKS and choice.get("row_block_wide") in ROW_BLOCKS
            and isinstance(products, dict) and set(products) == set(USES)
            and set(products.values()) <= set(BACKENDS))


def _timed(ops: Any, cache: Path) -> dict:
    """Time the row blocks, then (at the chosen ones) each use's backends; cache and log the choice."""
    seconds, wide = time_row_blocks(ops), time_row_blocks(ops, WIDE_SHAPES)
    fastest, fastest_wide = _fastest(seconds), _fastest(wide)
    ops.set_row_block(fastest)
    ops.set_row_block(fastest_wide, True)
    per_use = time_products(ops)
    ratios = {use: aten_over_packed(s) for use, s in per_use.items()}
    products = {use: "aten" if r < 1 - MARGIN else "packed" for use, r in ratios.items()}
    choice = {"row_block": fastest, "ms": _ms(seconds), "row_block_wide": fastest_wide, "ms_wide": _ms(wide),
              "products": products, "aten_over_packed": {use: round(r, 3) for use, r in ratios.items()},
              "products_ms": {use: {b: round(sum(t) * 1e3, 3) for b, t in s.items()} for use, s in per_use.items()},
              "threads": torch.get_num_threads()}
    tmp = cache.with_name(f"{cache.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(choice))
        os.replace(tmp, cache)       # atomic: concurrent processes at worst both time
    except OSError as err:           # a read-only cache: the choice holds for this process only
        tmp.unlink(missing_ok=True)
        log.warning("CPU kernels: could not cache the tuning choice (%s)", err)
    log.info("CPU kernels: row block %d of the packed products (ms per candidate: %s), %d of wide ones (%s); "
             "products per use %s (ATen's time over the packed products', geometric mean over shapes: %s); timed on "
             "this CPU, cached in %s", fastest, choice["ms"], fastest_wide, choice["ms_wide"], products,
             choice["aten_over_packed"], cache)
    return dict(choice, source="timed")


def _ms(seconds: dict[int, float]) -> dict[str, float]:
    """Each row block's seconds in ms, as the cached JSON holds them."""
    return {str(r): round(s * 1e3, 3) for r, s in seconds.items()}


def _fastest(seconds: dict[int, float]) -> int:
    """The fastest row block, unless it is within MARGIN of the default."""
    fastest = min(seconds, key=seconds.get)
    return fastest if seconds[fastest] <= (1 - MARGIN) * seconds[DEFAULT_ROW_BLOCK] else DEFAULT_ROW_BLOCK
