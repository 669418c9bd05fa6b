"""The CPU kernels' tile parameters, chosen on the machine by timing, once per build.

The packed products (csrc/gemm.h, `gemm_packed`) keep a block of R rows x 32 columns of
accumulators in registers. The best R is a property of the CPU, not of the model: with AVX-512's
32 vector registers 6 to 12 rows fit, while AVX2 splits each 16-float vector in two of its 16
registers, so a block of 6 spills. The kernels were first tuned on one AMD EPYC; on another CPU
the value chosen there can be the slow one. So on first use the candidates are timed on shapes of
the decoding step and of a learner pass (the built-in model's and a 0.5B model's); the fastest
total (the default 6 unless another is 5% faster) is kept in a JSON file next to the compiled
library (whose cache key holds the CPU already, so the choice is remade for a new CPU or new kernel
sources), and the choice is logged once.

Every candidate computes each output element with the same additions in the same order (one
accumulator per element, summed over k in turn), so the choice changes the speed only, never a
number: tests/unit/kernels/test_tuning.py checks the products bit for bit.
"""

from __future__ import annotations

import json
import logging
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
# conversations), and the decoding step of a 0.5B-shaped model (hidden 896).
SHAPES = ((64, 128, 384), (64, 128, 1024), (960, 128, 512), (8192, 128, 384), (64, 896, 1152), (64, 896, 4864))
ROUNDS = 5
# Another row block replaces the default only when it is this much faster: closer timings are noise (on the
# AMD EPYC 6, 8, 10 and 12 were within 2% on these shapes, while 12 was 10% slower than 6 on the tool task's SFT
# step), and the default is the value the kernels were tuned and tested with longest.
MARGIN = 0.05
ENV = "REINFORGE_KERNEL_ROW_BLOCK"


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


def choose_row_block(ops: Any, library: Path) -> dict:
    """Set the kernels' row block: `$REINFORGE_KERNEL_ROW_BLOCK` when set, else the choice cached next to
    `library`, else the fastest candidate timed now (then cached). Returns the choice as a record
    (row_block, how it was chosen, the timings in ms when timed now or cached)."""
    forced = os.environ.get(ENV)
    if forced:
        if int(forced) not in ROW_BLOCKS:
            raise ValueError(f"{ENV}={forced}: the row block must be one of {', '.join(map(str, ROW_BLOCKS))}")
        choice = {"row_block": int(forced), "source": ENV}
    else:
        cache = library.with_name(library.stem + ".tuning.json")
        try:
            choice = {**json.loads(cache.read_text()), "source": "cached"}
        except (OSError, ValueError):
            seconds = time_row_blocks(ops)
            fastest = min(seconds, key=seconds.get)
            if seconds[fastest] > (1 - MARGIN) * seconds[DEFAULT_ROW_BLOCK]:
                fastest = DEFAULT_ROW_BLOCK
            choice = {"row_block": fastest, "ms": {str(r): round(s * 1e3, 3) for r, s in seconds.items()},
                      "threads": torch.get_num_threads()}
            tmp = cache.with_name(f"{cache.name}.{os.getpid()}.tmp")
            try:
                tmp.write_text(json.dumps(choice))
                os.replace(tmp, cache)       # atomic: concurrent processes at worst both time
            except OSError as err:           # a read-only cache: the choice holds for this process only
                tmp.unlink(missing_ok=True)
                log.warning("CPU kernels: could not cache the row block's choice (%s)", err)
            choice["source"] = "timed"
            log.info("CPU kernels: row block %d of the packed products, timed on this CPU (ms per candidate: "
                     "%s; cached in %s)", fastest, choice["ms"], cache)
        if choice.get("row_block") not in ROW_BLOCKS:
            choice = {"row_block": DEFAULT_ROW_BLOCK, "source": "default"}
    ops.set_row_block(choice["row_block"])
    return choice
