"""Fused CPU kernels, compiled on first use with the machine's C++ compiler.

On a CPU, a small model's decoding step and the learner's forward and backward spend much of their
time outside the matmuls: dispatch and a memory pass per small op (norms, rotary, masking,
softmax, SwiGLU, sampling), and PyTorch ships no fused decode attention for CPU (its SDPA kernel
was 2x slower than plain matmuls at rollout shapes). reinforge carries its own, as torch ops of
the namespace `reinforge_kernels`:

- `csrc/decode.cpp`, the native engine (rollout.native): `decode_layer` (one decoder layer for one
  token of every row: the projections as ATen matmuls, everything between them fused, the
  attention reading each row's keys up to its position), `sample` (keyed inverse-CDF sampling,
  `sample_tokens` with `keyed_uniforms` in one pass) and `decode_attention`;
- `csrc/learner.cpp`, behind the autograd functions below (`rms_norm`, `swiglu`), which
  `rollout.native.decoder_layers` calls: the engine's prefill and the learner's shared-prompt
  forward, SFT included.

They are built against the installed torch on first use (~15 s) and cached under
`$REINFORGE_CACHE` (default `~/.cache/reinforge`), keyed by the sources, torch, the compiler and
the CPU (they are built with -march=native). They are optional: with no C++ compiler, a failed
build, or `REINFORGE_CPU_KERNELS=0`, `load_cpu_kernels()` is None and every caller runs its
PyTorch path, which computes the same numbers within float rounding (tests/test_cpu_kernels.py).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.cpp_extension import include_paths, library_paths

log = logging.getLogger(__name__)

SOURCES = (Path(__file__).parent / "csrc" / "decode.cpp", Path(__file__).parent / "csrc" / "learner.cpp")
# Head dims the kernel is compiled for (its per-head accumulators are sized at compile time).
HEAD_DIMS = (8, 16, 32, 64, 80, 96, 128, 256)
# -ffast-math lets the softmax's expf vectorise (glibc's libmvec); it is given to the compile only,
# since linking a shared library with it would set flush-to-zero for the whole process.
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c++17")


def _cpu_fingerprint() -> str:
    """What -march=native depends on: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(sorted({line for line in lines if line.startswith(("model name", "flags"))}))
    except OSError:
        return platform.processor() + platform.machine()


def _build(sources: tuple[Path, ...], compiler: str) -> Path:
    """The shared library of `sources`, from the cache or compiled now (atomically, so concurrent
    processes, e.g. pytest-xdist workers, at worst both compile)."""
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    texts = [f.read_text() for f in sorted(sources[0].parent.iterdir()) if f.suffix in (".cpp", ".h")]   # headers too
    key = hashlib.sha256("\0".join([*texts, torch.__version__, version, _cpu_fingerprint(), abi, *COMPILE_FLAGS])
                         .encode()).hexdigest()[:16]
    cache = Path(os.environ.get("REINFORGE_CACHE", Path.home() / ".cache" / "reinforge")) / "kernels"
    library = cache / f"reinforge_kernels-{key}.so"
    if library.exists():
        return library
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        includes = [f"-I{p}" for p in include_paths()]
        objects = [Path(tmp) / f"{source.stem}.o" for source in sources]
        for source, obj in zip(sources, objects, strict=True):
            subprocess.run([compiler, *COMPILE_FLAGS, abi, *includes, "-c", str(source), "-o", str(obj)],
                           capture_output=True, text=True, check=True)
        built = Path(tmp) / "kernels.so"
        libs = [f"-L{p}" for p in library_paths()]
        subprocess.run([compiler, "-shared", *map(str, objects), "-o", str(built), *libs, "-lc10", "-ltorch_cpu", "-lmvec"],
                       capture_output=True, text=True, check=True)
        os.replace(built, library)
    return library


@functools.cache
def load_cpu_kernels() -> Any | None:
    """The ops namespace `torch.ops.reinforge_kernels` (their signatures are at the end of
    csrc/decode.cpp and csrc/learner.cpp), or None where it cannot be built (the reason is logged once)."""
    if os.environ.get("REINFORGE_CPU_KERNELS", "1") == "0":
        return None
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        log.warning("no C++ compiler found: the native engine and the learner use their PyTorch paths on CPU (slower)")
        return None
    try:
        torch.ops.load_library(str(_build(SOURCES, compiler)))
    except (OSError, subprocess.CalledProcessError, RuntimeError) as err:
        detail = err.stderr.strip().splitlines()[-1:] if isinstance(err, subprocess.CalledProcessError) and err.stderr else err
        log.warning("building the CPU kernels failed (%s): the native engine and the learner use their PyTorch paths "
                    "(slower)", detail)
        return None
    return torch.ops.reinforge_kernels


def _plain(t: torch.Tensor) -> bool:
    """A dense CPU float32 tensor the kernels can read (not a DTensor shard or another subclass)."""
    return type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu" and t.dtype == torch.float32


class _RMSNorm(torch.autograd.Function):
    """RMSNorm of x [R, E] (Zhang and Sennrich, arXiv 1910.07467), forward and backward fused."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        y, rstd = load_cpu_kernels().rms_norm_forward(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = load_cpu_kernels().rms_norm_backward(dy.contiguous(), x, weight, rstd)
        return dx, dw, None


class _SwiGLU(torch.autograd.Function):
    """silu(gate) * up of [gate | up] [R, 2I] (Shazeer, arXiv 2002.05202), forward and backward fused."""

    @staticmethod
    def forward(ctx, gate_up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate_up)
        return load_cpu_kernels().swiglu_forward(gate_up)

    @staticmethod
    def backward(ctx, da: torch.Tensor):
        (gate_up,) = ctx.saved_tensors
        return load_cpu_kernels().swiglu_backward(da.contiguous(), gate_up)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`F.rms_norm(x, (E,), weight, eps)` of rows x [R, E]; on CPU in fp32 one fused kernel each way
    where the kernels build (same numbers within float rounding: tests/test_cpu_kernels.py)."""
    if x.dim() == 2 and _plain(x) and _plain(weight) and load_cpu_kernels() is not None:
        return _RMSNorm.apply(x.contiguous(), weight, eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def swiglu(gate_up: torch.Tensor, act) -> torch.Tensor:
    """act(gate) * up of [gate | up] [R, 2I], `act` the MLP's activation; for SiLU on CPU in fp32 one
    fused kernel each way where the kernels build."""
    if act is None and gate_up.dim() == 2 and _plain(gate_up) and load_cpu_kernels() is not None:
        return _SwiGLU.apply(gate_up.contiguous())
    gate, up = gate_up.chunk(2, dim=-1)
    return (F.silu(gate) if act is None else act(gate)) * up
