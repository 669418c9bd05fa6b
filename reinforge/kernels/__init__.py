"""Fused CPU kernels, compiled on first use with the machine's C++ compiler.

On a CPU, a small model's decoding step and the learner's forward and backward spend much of their
time outside the matmuls: dispatch and a memory pass per small op (norms, rotary, masking,
softmax, SwiGLU, sampling), and PyTorch ships no fused decode attention for CPU (its SDPA kernel
was 2x slower than plain matmuls at rollout shapes). reinforge carries its own, as torch ops of
the namespace `reinforge_kernels`:

- `csrc/decode.cpp`, the native engine (rollout.native, rollout.session): `decode_layer` (one decoder layer for one
  token of every row: the projections against weights packed once per generation by
  `pack_weight`, everything between them fused, the attention reading each row's keys up to its
  position), `sample` (keyed inverse-CDF sampling, `sample_tokens` with `keyed_uniforms` in one
  pass; with top-p, the nucleus by a radix select instead of a sort), `decode_step` (the whole step in
  one call: embedding, every layer, final norm, head and sampling; csrc/sampling.h holds the sampler's
  row loop both share) and `decode_attention`;
- `csrc/learner.cpp`, behind the autograd functions below: `train_layer` (one decoder layer of a
  learner pass, forward and backward one op each, attention over a `PassGeometry`), which
  `models.decoder.run_pass` calls for the engine's prefill and the learner's shared-prompt
  forward (SFT included), and `rms_norm` and `swiglu`, which the PyTorch layers
  (`models.decoder.decoder_layers`) call where `train_layer` does not apply.

They are built against the installed torch on first use (~20 s on 2 cores) and cached under
`$REINFORGE_CACHE` (default `~/.cache/reinforge`), keyed by the sources, torch, the compiler and
the CPU (they are built with -march=native). They are optional: with no C++ compiler, a failed
build, or `REINFORGE_CPU_KERNELS=0`, `load_cpu_kernels()` is None and every caller runs its
PyTorch path, which computes the same numbers within float rounding (tests/unit/kernels/test_cpu_kernels.py).
On first use on a machine the products' row block, and for the learner's passes the packed products or
ATen's, are chosen by timing (kernels/tuning.py).
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.cpp_extension import include_paths, library_paths

from reinforge.kernels.tuning import choose

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).parent / "csrc" / name for name in ("decode.cpp", "step.cpp", "learner.cpp"))
# Head dims the kernel is compiled for (its per-head accumulators are sized at compile time).
HEAD_DIMS = (8, 16, 32, 64, 80, 96, 128, 256)
# -ffast-math lets the softmax's expf vectorise (glibc's libmvec); it is given to the compile only,
# since linking a shared library with it would set flush-to-zero for the whole process.
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c++17")
# The machine's choice of the kernels' tile parameters once they are loaded (kernels/tuning.py), for reports.
TUNING: dict = {}


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
        # the sources compile side by side (one process each), then link
        jobs = [(subprocess.Popen([compiler, *COMPILE_FLAGS, abi, *includes, "-c", str(source), "-o", str(obj)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), source)
                for source, obj in zip(sources, objects, strict=True)]
        for job, source in jobs:
            out, err = job.communicate()
            if job.returncode:
                raise subprocess.CalledProcessError(job.returncode, f"{compiler} -c {source}", out, err)
        built = Path(tmp) / "kernels.so"
        libs = [f"-L{p}" for p in library_paths()]
        subprocess.run(
            [compiler, "-shared", *map(str, objects), "-o", str(built), *libs, "-lc10", "-ltorch_cpu", "-lmvec"],
            capture_output=True,
            text=True,
            check=True,
        )
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
        library = _build(SOURCES, compiler)
        torch.ops.load_library(str(library))
    except (OSError, subprocess.CalledProcessError, RuntimeError) as err:
        detail = (
            err.stderr.strip().splitlines()[-1:]
            if isinstance(err, subprocess.CalledProcessError) and err.stderr
            else err
        )
        log.warning("building the CPU kernels failed (%s): the native engine and the learner use their PyTorch paths "
                    "(slower)", detail)
        return None
    TUNING.update(choose(torch.ops.reinforge_kernels, library))
    return torch.ops.reinforge_kernels


def plain_products(use: str) -> bool:
    """Whether the kernels' products of `use` run through ATen on the plain weights rather than against
    packed panels (csrc/gemm.h, `product`), as chosen on this machine (kernels/tuning.py): "learner" (its
    passes); "engine" (the rollout engine's prefill and decoding, which keep the packed products for their
    batch-invariant sums) never. False before the kernels are loaded."""
    return TUNING.get("products", {}).get(use) == "aten"


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
    where the kernels build (same numbers within float rounding: tests/unit/kernels/test_cpu_kernels.py)."""
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


@dataclass(frozen=True)
class PassGeometry:
    """Which keys each token of a learner pass attends to (csrc/learner.cpp, `Geometry`): B
    right-padded rows of `positions` tokens; token t of row b sits at rotary position pos0[b] + t and
    sees the first pre_len[b] keys of prefix slot slot[b] (another pass's keys: a shared prompt),
    then its own keys 0..t (causal: a real token never sees its row's padding, and no one reads a
    padded token's output). rot [L, D/2, 2]: (cos, sin) of each rotary pair at positions 0..L-1.
    slot and pre_len are None without a prefix."""

    positions: int
    rot: torch.Tensor
    pos0: torch.Tensor
    slot: torch.Tensor | None = None
    pre_len: torch.Tensor | None = None


class _TrainLayer(torch.autograd.Function):
    """One pre-norm decoder layer (rotary attention over a `PassGeometry`, SwiGLU MLP) on tokens x
    [B S, E]: (x_out [B S, E], its rotated keys and values [B, S, kv, D]); forward and backward are
    one op each (csrc/learner.cpp, train_layer_forward / train_layer_backward). `packs`: the
    layer's projections packed for the forward's products and for the backward's (`pack_weight`)."""

    @staticmethod
    def forward(ctx, x, input_norm, qkv_w, qkv_b, o_w, o_b, post_norm, gate_up_w, down_w, pk, pv, packs,
                geometry: PassGeometry, heads: int, kv_heads: int, eps: float):
        record = _layer_forward(x, input_norm, qkv_b, o_b, post_norm, packs[0], geometry, pk, pv, heads, kv_heads, eps)
        return _keep_for_backward(ctx, x, record, input_norm, qkv_b, o_b, post_norm, down_w, pk, pv, packs, geometry,
                                  heads, kv_heads, eps)

    @staticmethod
    def backward(ctx, dx_out, dk, dv):
        if ctx.intact is not None and not ctx.intact():
            raise RuntimeError("the rollout engine decoded into the activation record between this learner pass's "
                               "forward and its backward; run the backward before the next generation, or set "
                               "train.reuse_activations=false")
        x, q, k, v, attn, lse, x_mid, gate_up, input_norm, post_norm, pk, pv = ctx.saved_tensors
        g, bwd, (qkv_bias, o_bias) = ctx.geometry, ctx.packs, ctx.biases
        if dx_out is None:
            dx_out = torch.zeros_like(x)
        dx, d_in, d_qkv_w, d_qkv_b, d_o_w, d_o_b, d_post, d_gate_up_w, d_down_w, dpk, dpv = (
            load_cpu_kernels().train_layer_backward(
                dx_out.contiguous(), dk, dv, x, q, k, v, attn, lse, x_mid, gate_up, input_norm, bwd.qkv, qkv_bias,
                bwd.o, o_bias, post_norm, bwd.gate_up, bwd.down, g.rot, g.pos0, pk, pv, g.slot, g.pre_len, ctx.heads,
                ctx.kv_heads, g.positions, ctx.eps, *ctx.gate_up_in_place,
            )
        )
        return (
            dx, d_in, d_qkv_w, d_qkv_b if qkv_bias else None, d_o_w, d_o_b if o_bias else None, d_post, d_gate_up_w,
            d_down_w, dpk if pk is not None else None, dpv if pv is not None else None, None, None, None, None, None,
        )


@dataclass(frozen=True)
class LayerRecord:
    """One decoder layer's activations at a pass's tokens [B, S] as the rollout engine's decoding kept them
    (csrc/decode_layer.h, `Record`), each contiguous in the layout `_TrainLayer` saves for its backward:
    q [B, S, H, D] and k, v [B, S, kv, D] rotated, attn [B S, H D], lse [B, S, H], x_mid and x_out [B S, E],
    gate_up [B S, 2I]."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    attn: torch.Tensor
    lse: torch.Tensor
    x_mid: torch.Tensor
    gate_up: torch.Tensor
    x_out: torch.Tensor
    # With gate_up_rows [B S]: gate_up is the record's own rows [n, width], token m's gate|up at row gate_up_rows[m]
    # from column gate_up_offset, read there by the backward (copied out, it was most of the gather's time), and
    # `intact` says whether those rows still hold this record (the engine has not decoded into them since).
    gate_up_rows: torch.Tensor | None = None
    gate_up_offset: int = 0
    intact: Callable[[], bool] | None = None


def _layer_forward(x, input_norm, qkv_b, o_b, post_norm, fwd, g: PassGeometry, pk, pv, heads: int, kv_heads: int,
                   eps: float) -> LayerRecord:
    """One fused layer's forward (csrc/learner.cpp, train_layer_forward) with everything its backward reads, from
    the projections packed for it (`fwd`)."""
    x_out, k, v, q, attn, lse, x_mid, gate_up = load_cpu_kernels().train_layer_forward(
        x, input_norm, fwd.qkv, qkv_b, fwd.o, o_b, post_norm, fwd.gate_up, fwd.down, g.rot, g.pos0, pk, pv, g.slot,
        g.pre_len, heads, kv_heads, g.positions, eps)
    return LayerRecord(q=q, k=k, v=v, attn=attn, lse=lse, x_mid=x_mid, gate_up=gate_up, x_out=x_out)


def _keep_for_backward(ctx, x, r: LayerRecord, input_norm, qkv_b, o_b, post_norm, down_w, pk, pv, packs,
                       geometry: PassGeometry, heads: int, kv_heads: int, eps: float):
    """`_TrainLayer`'s forward's bookkeeping for its backward, of a layer's forward `r` (its own, or the rollout's
    record): (x_out, keys, values)."""
    ctx.save_for_backward(x, r.q, r.k, r.v, r.attn, r.lse, r.x_mid, r.gate_up, input_norm, post_norm, pk, pv)
    ctx.geometry, ctx.packs, ctx.heads, ctx.kv_heads, ctx.eps = geometry, packs[1], heads, kv_heads, eps
    ctx.biases = (qkv_b is not None, o_b is not None)
    # () : gate_up is the [B S, 2I] tensor saved; else the record's rows it is read in (`LayerRecord.gate_up_rows`)
    ctx.gate_up_in_place = () if r.gate_up_rows is None else (r.gate_up_rows, r.gate_up_offset, down_w.shape[1])
    ctx.intact = r.intact
    ctx.set_materialize_grads(False)    # k and v have no gradient unless another pass reads them
    return r.x_out, r.k, r.v


class _ReplayLayer(_TrainLayer):
    """`_TrainLayer` whose forward is the rollout's: on-policy, at the weights that sampled the tokens, the layer's
    activations were computed by the engine's decoding already (the same operations, equal to float rounding), so
    the forward hands back the record and keeps it for the backward, which is `_TrainLayer`'s."""

    @staticmethod
    def forward(ctx, x, input_norm, qkv_w, qkv_b, o_w, o_b, post_norm, gate_up_w, down_w, pk, pv, packs,
                geometry: PassGeometry, heads: int, kv_heads: int, eps: float, record: LayerRecord):
        return _keep_for_backward(ctx, x, record, input_norm, qkv_b, o_b, post_norm, down_w, pk, pv, packs, geometry,
                                  heads, kv_heads, eps)

    @staticmethod
    def backward(ctx, dx_out, dk, dv):
        return (*_TrainLayer.backward(ctx, dx_out, dk, dv), None)


def replay_layer(x: torch.Tensor, layer, packs: tuple[Any, Any], geometry: PassGeometry,
                 prefix: tuple[torch.Tensor, torch.Tensor] | None, heads: int, kv_heads: int, eps: float,
                 record: LayerRecord) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`train_layer` with the forward taken from `record` (see `_ReplayLayer`): x [B S, E] is the layer's input
    (the embedding, or the previous layer's recorded output), whose gradient the backward returns."""
    pk, pv = prefix if prefix is not None else (None, None)
    return _ReplayLayer.apply(x.contiguous(), layer.input_norm, layer.qkv, layer.qkv_bias, layer.o, layer.o_bias,
                              layer.post_norm, layer.gate_up, layer.down, pk, pv, packs, geometry, heads, kv_heads,
                              eps, record)


def record_layer(x: torch.Tensor, layer, packs: tuple[Any, Any | None], geometry: PassGeometry,
                 prefix: tuple[torch.Tensor, torch.Tensor] | None, heads: int, kv_heads: int,
                 eps: float) -> LayerRecord:
    """`train_layer`'s forward outside autograd, keeping all that its backward reads: the rollout engine's prefill,
    whose prompts the learner's prompt pass may then replay (models/replay.py, `PromptRecord`)."""
    pk, pv = prefix if prefix is not None else (None, None)
    return _layer_forward(x.contiguous(), layer.input_norm, layer.qkv_bias, layer.o_bias, layer.post_norm, packs[0],
                          geometry, pk, pv, heads, kv_heads, eps)


def fused_layer_ok(layer, head_dim: int, x: torch.Tensor) -> bool:
    """Whether `train_layer` runs this layer (a `models.decoder.LayerWeights`) on x: CPU fp32, SiLU
    MLP, no per-head q/k norm, a compiled head dim, and the kernels built."""
    weights = [layer.input_norm, layer.qkv, layer.o, layer.post_norm, layer.gate_up, layer.down,
               *(t for t in (layer.qkv_bias, layer.o_bias) if t is not None)]
    return (layer.act is None and layer.q_norm is None and head_dim in HEAD_DIMS and _plain(x)
            and all(_plain(t) for t in weights) and load_cpu_kernels() is not None)


def train_layer(x: torch.Tensor, layer, packs: tuple[Any, Any | None], geometry: PassGeometry,
                prefix: tuple[torch.Tensor, torch.Tensor] | None, heads: int, kv_heads: int,
                eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decoder layer of a learner pass, fused (see `_TrainLayer`; check `fused_layer_ok` first):
    x [B S, E] -> (x_out [B S, E], keys, values [B, S, kv, D]). `packs`: the layer's projections
    packed for w^T products and, where a backward will run, for w products
    (`models.decoder.DecoderWeights.packed`). `prefix`: the keys and values [P, Lp, kv, D] that
    `geometry.slot` indexes."""
    pk, pv = prefix if prefix is not None else (None, None)
    return _TrainLayer.apply(x.contiguous(), layer.input_norm, layer.qkv, layer.qkv_bias, layer.o, layer.o_bias,
                             layer.post_norm, layer.gate_up, layer.down, pk, pv, packs, geometry, heads, kv_heads, eps)
