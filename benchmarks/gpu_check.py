"""The GPU check: one process that proves reinforge's CUDA path and measures it, for a GPU lent for
minutes. One JSON line per part, then a summary line; every line names the card.

    benchmarks/gpu_check.sh [--budget-s 470]        # on the GPU machine: installs gpu-bundle/, runs this
    python benchmarks/gpu_check.py --device cpu --dry-run   # every part at tiny shapes on a CPU

Parts, in this order, each under its own time budget (a part over it, or failing, prints its line with
`ok: false` and the error, and the next part runs):

- `card`: the device, torch and transformers; the memory bandwidth of a device-to-device copy (bytes read
  plus bytes written per second) and the bf16 matrix-product rate (an n x n x n product, 2 n^3 FLOPs),
  both measured here: the bounds the figures below are read against.
- `cuda_tests`: the tests marked `cuda` (tests/e2e/test_device_paths.py: native engine vs transformers in fp32
  and bf16, sampler vs learner log-probs, LoRA, chunked head vs naive, an update's gradient vs the CPU in
  fp32, the weight-sync probe over a run), in this process through pytest; on a CPU their `cpu` cases.
- `rollout`: a random-init Qwen2.5-0.5B-shaped model in bf16 (benchmarks/train_throughput.py's shape),
  256 rows (32 prompts x 8, 64 prompt tokens): new tokens per second of the native engine and of
  transformers `generate` (its own, without the scores reinforge's HF engine keeps) on the same prompts
  and settings (every row runs to `max_new_tokens`: a random
  model at this vocabulary almost never samples <eos>). The native decode step's time comes from two runs
  that differ only in new tokens (prefill cancels); `decode_vs_bound` divides its tokens/s by the
  bandwidth bound: (weight bytes + KV bytes read and written per step) / the copy bandwidth of `card`.
  `step_ms_1_row` is the decode step of one row: a step that costs as much at 1 row as at 256 is
  paying for launches and Python, not for memory.
- `learner`: one policy update (dr_grpo, the default forward plan) of the same model on 256 rows with
  long-tailed completions up to 256 tokens: learner tokens/s, and the model FLOPs (6 x matmul parameters
  x positions run plus attention, train_throughput.model_flops) per second against the measured bf16 rate
  (`mfu_measured`) and against the data sheet's (`mfu_datasheet`, H100/H200 SXM 989 TFLOP/s dense); then
  the same figures under `compiled` with train.compile=true (the layers through torch.compile), whose
  first update, compiling, is timed apart (`compile_warmup_seconds`) and not in `update_seconds`.
- `profile`: torch.profiler over 2 decode steps of the rollout part's model and rows (its CUDA graphs
  captured) and over one learner micro-step (forward and backward of the learner part's first micro-batch):
  kernels, launches and host syncs per step, the top 15 device kernels and CPU ops by their own time.
- `default_job`: the README's `make run` job (SFT -> held-out eval -> GRPO -> held-out eval) at its
  default size with model.device set: pass@1 before and after, wall time, RL step time.

Every part reports its peak device memory (`peak_memory_gib`, torch.cuda.max_memory_allocated since the
part began; on a CPU the process's peak RSS so far). The summary compares the figures with the targets
(learner MFU >= 0.40 of the data sheet's rate, native decode >= 0.5 of the bound, native rollout >= 2x
`generate`); those do not decide `ok`, which says that every part ran and every test passed. Exit code 0
when ok, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import signal
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
import transformers  # noqa: E402
from train_throughput import (  # noqa: E402
    PEAK_TFLOPS,
    QWEN25_05B,
    learner_batch,
    model_flops,
    rollout_seconds,
    shaped_policy,
)

from reinforge.config import build_config  # noqa: E402
from reinforge.jobs.start import objective_spec  # noqa: E402
from reinforge.jobs.train import run  # noqa: E402
from reinforge.learner import ForwardPlan, UpdateSettings, build_optimizer, policy_update, warmup_constant  # noqa: E402
from reinforge.models import resolve_device  # noqa: E402
from reinforge.rollout import NativeEngine  # noqa: E402
from reinforge.rollout.stopping import completion_mask  # noqa: E402

# The part sizes: on the GPU the (a Qwen2.5-0.5B shape, 256 rows); --dry-run a tiny model with
# the same code paths, so that the script runs end to end on a CPU in the test suite.
FULL = dict(shape=QWEN25_05B, prompts=32, group_size=8, prompt_length=64, short=32, long=128,
            learner_new_tokens=256, copy_mib=1024, matmul=8192, repeats=2)
DRY = dict(shape=dict(QWEN25_05B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=512),
           prompts=4, group_size=2, prompt_length=16, short=4, long=12, learner_new_tokens=16, copy_mib=8, matmul=256,
           repeats=1)
# conftest.MICRO's job: the default job's code at a size that runs in seconds.
DRY_JOB = ["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1",
           "model.intermediate_size=64", "sft.steps=3", "sft.batch_size=8", "sft.num_examples=32", "train.steps=3",
           "train.prompts_per_step=4", "train.group_size=4", "train.micro_batch_size=8", "rollout.max_new_tokens=4",
           "eval.num_prompts=6", "eval.num_samples=4"]
# Seconds per part on an H100 (the last part gets what is left of --budget-s, 450 s by default); with the
# process's start and the bundle's install the whole check fits 8 minutes.
BUDGETS = {"card": 30, "cuda_tests": 120, "rollout": 70, "learner": 110, "profile": 40, "default_job": 200}


class OutOfTime(BaseException):
    """A part ran past its budget (a BaseException: the code under test may catch Exception)."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    def stop(signum, frame):
        raise OutOfTime(f"over its budget of {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.001))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.processor() or 'x86_64'})"


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)     # KiB on Linux


def sig(x: float, digits: int = 4) -> float:
    """x to `digits` significant figures (a CPU's TFLOP/s are small, a GPU's tokens/s large)."""
    return float(f"{x:.{digits}g}")


def timed(fn: Callable[[], object], device: torch.device, repeats: int, warm_up: bool = True) -> float:
    """The median seconds of `repeats` calls of fn (after one warm-up call unless `warm_up` is False)."""
    if warm_up:
        fn()
    seconds = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def part_card(device: torch.device, size: dict, state: dict) -> dict:
    n = size["matmul"]
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    matmul_s = timed(lambda: a @ b, device, 5)
    src = torch.empty(size["copy_mib"] * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_s = timed(lambda: dst.copy_(src), device, 5)
    state["bf16_tflops"] = 2 * n**3 / matmul_s / 1e12
    state["bandwidth_gbs"] = 2 * src.numel() / copy_s / 1e9            # bytes read + bytes written
    props = {}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        props = {"memory_gib": round(p.total_memory / 2**30, 1), "multiprocessors": p.multi_processor_count,
                 "capability": f"{p.major}.{p.minor}"}
    return {"bf16_matmul_tflops": sig(state["bf16_tflops"]), "matmul_n": n,
            "copy_bandwidth_gbs": sig(state["bandwidth_gbs"]), "copy_mib": size["copy_mib"],
            "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "cuda": torch.version.cuda, **props}


class _Outcomes:
    """pytest plugin: each test's outcome, and a skip for every test once the part's deadline has passed."""

    def __init__(self, deadline: float):
        self.deadline, self.passed, self.failed, self.skipped = deadline, [], {}, []

    def pytest_runtest_setup(self, item):
        import pytest

        if time.monotonic() > self.deadline:
            pytest.skip("the GPU check's budget for the tests is spent")

    def pytest_runtest_logreport(self, report):
        if report.failed:
            self.failed[report.nodeid] = str(report.longrepr).strip().splitlines()[-1][:300]
        elif report.skipped and report.when in ("setup", "call"):
            self.skipped.append(report.nodeid)
        elif report.passed and report.when == "call":
            self.passed.append(report.nodeid)


def part_cuda_tests(device: torch.device, size: dict, state: dict) -> dict:
    import pytest

    marker = "cuda" if device.type == "cuda" else "not cuda"
    plugin = _Outcomes(time.monotonic() + state["budget"] - 5)
    select = ["-k", state["tests_k"]] if state["tests_k"] else []
    code = pytest.main(["-q", "-p", "no:cacheprovider", "-m", marker, *select, "--rootdir", str(ROOT),
                        str(ROOT / "tests" / "e2e" / "test_device_paths.py")], plugins=[plugin])
    out = {"marker": marker, "passed": len(plugin.passed), "failed": len(plugin.failed),
           "skipped": len(plugin.skipped), "failures": plugin.failed, "pytest_exit": int(code)}
    if code != 0 or not plugin.passed or plugin.skipped:
        raise AssertionError(json.dumps(out))
    return out


def _weights_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step reads of the weights: every parameter once (the tied embedding as the LM head;
    the input lookup reads only the rows' embeddings)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def part_rollout(device: torch.device, size: dict, state: dict) -> dict:
    policy = shaped_policy(size["shape"], torch.bfloat16, device)
    config = policy.model.config
    g = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(3, config.vocab_size, (size["prompts"], size["prompt_length"]), generator=g).tolist()
    rows = size["prompts"] * size["group_size"]
    engine = NativeEngine(policy)
    short, long = size["short"], size["long"]

    def native(prompts, group, tokens, seed=0) -> tuple[float, int]:
        return rollout_seconds(engine, prompts, group, tokens, seed)

    native(prompt_ids, size["group_size"], short)                      # warm-up: allocator, kernels
    runs = {"short": [], "long": []}
    for r in range(size["repeats"]):
        for name, tokens in (("short", short), ("long", long)):
            runs[name].append(native(prompt_ids, size["group_size"], tokens, seed=r))
    seconds = {k: statistics.median(s for s, _ in v) for k, v in runs.items()}
    new_tokens = {k: statistics.median(t for _, t in v) for k, v in runs.items()}
    native_rate = new_tokens["long"] / seconds["long"]
    step_s = (seconds["long"] - seconds["short"]) / (long - short)
    # None when timing noise outweighs the extra tokens (a busy CPU in a dry run)
    decode_rate = rows / step_s if step_s > 0 else None
    one = [native(prompt_ids[:1], 1, tokens) for tokens in (short, long)]
    step_ms_1_row = 1e3 * (one[1][0] - one[0][0]) / (long - short)

    def rounded(x, digits=1):
        return None if x is None else round(x, digits)

    # transformers' own `generate`, sampling as the engine does, without the per-step scores that
    # reinforge's HF engine keeps for its log-probs ([rows, vocabulary] fp32 a step: 20 GB here).
    ids = torch.tensor(prompt_ids, device=device)
    eos = policy.tokenizer.eos_token_id

    def generate() -> int:
        torch.manual_seed(0)
        with torch.no_grad():
            out = policy.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                        temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=long,
                                        num_return_sequences=size["group_size"], pad_token_id=eos, eos_token_id=eos)
        mask, _ = completion_mask(out[:, ids.shape[1]:].cpu(), [eos])
        return int(mask.sum())

    hf_tokens = generate()                                            # warm-up, and the tokens it makes
    hf_s = timed(generate, device, size["repeats"], warm_up=False)
    hf_rate = hf_tokens / hf_s

    # The bound: each decode step reads every weight once and, per row, the keys and values of its
    # context (positions), and writes one position's; averaged over the steps short..long.
    kv_heads, head_dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    per_position = config.num_hidden_layers * 2 * kv_heads * head_dim * 2          # bf16 keys + values, bytes
    context = size["prompt_length"] + (short + long) / 2
    step_bytes = _weights_bytes(policy.model) + rows * (context + 1) * per_position
    bound_rate = rows / (step_bytes / (state["bandwidth_gbs"] * 1e9))
    return {"model": "qwen2.5-0.5b shape" if size is FULL else "tiny", "dtype": "bfloat16",
            "parameters": sum(p.numel() for p in policy.model.parameters()), "rows": rows,
            "prompt_length": size["prompt_length"], "max_new_tokens": long,
            "native_tokens_per_s": round(native_rate, 1), "hf_generate_tokens_per_s": round(hf_rate, 1),
            "native_vs_generate": round(native_rate / hf_rate, 3),
            "native_decode_tokens_per_s": rounded(decode_rate), "decode_step_ms": round(1e3 * step_s, 3),
            "step_ms_1_row": round(step_ms_1_row, 3), "bandwidth_bound_tokens_per_s": round(bound_rate, 1),
            "decode_vs_bound": None if decode_rate is None else sig(decode_rate / bound_rate, 3),
            "step_bytes": int(step_bytes), "native_seconds": round(seconds["long"], 4), "hf_seconds": round(hf_s, 4),
            **_fast_paths(device, engine)}


def _fast_paths(device: torch.device, engine: NativeEngine | None = None) -> dict:
    """Which CUDA fast paths were still on after a part (each turns itself off, logged, on a failure):
    the engine's decode graphs, the 16-bit LM-head GEMMs with fp32 output (and adding into the weight
    gradient), SDPA's fused kernels for grouped-query attention. None on a CPU, which runs none of them."""
    from reinforge.learner import head_gemms, logprobs
    from reinforge.models import attention, decoder

    if device.type != "cuda":
        return {"fast_paths": None}
    paths = {"head_fp32_output_gemm": logprobs._FP32_OUT_MM["on"] and decoder._FP32_OUT_MM["on"],
             "grouped_decode_attention": attention._GROUPED_DECODE["on"],
             "expanded_kv_attention": attention._EXPAND_KV["on"],
             # None: no LM-head backward ran yet; False: each chunk's weight gradient added after its GEMM
             "head_grad_accumulating_gemm": head_gemms._ADDMM32["on"]}
    if engine is not None:
        paths["decode_graphs"] = engine.graph_mode == "capture"
    return {"fast_paths": paths}


def _update_config(prompt_length: int, new_tokens: int):
    """The update's settings (dr_grpo, the default forward plan). The config's own model is never built here;
    its positions are the shaped model's, so the config check sees prompts and completions that fit."""
    return build_config(["recipe=dr_grpo", f"rollout.max_new_tokens={new_tokens}",
                         f"model.max_positions={prompt_length + new_tokens}"])


def part_learner(device: torch.device, size: dict, state: dict) -> dict:
    start = time.monotonic()
    policy = shaped_policy(size["shape"], torch.bfloat16, device)
    config = policy.model.config
    g = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(3, config.vocab_size, (size["prompts"], size["prompt_length"]), generator=g).tolist()
    new_tokens = size["learner_new_tokens"]
    batch = learner_batch(prompt_ids, size["group_size"], new_tokens, config.vocab_size,
                          policy.tokenizer.pad_token_id, g)
    cfg = _update_config(size["prompt_length"], new_tokens)
    spec, plan = objective_spec(cfg), ForwardPlan.from_config(cfg.train)
    optimizer = build_optimizer(policy.model, 1e-6)
    scheduler = warmup_constant(optimizer, 0)

    def update(forward: ForwardPlan) -> None:
        settings = UpdateSettings(forward=forward, max_length=new_tokens)
        policy_update(policy.model, optimizer, scheduler, batch, spec, settings, torch.Generator().manual_seed(0))

    tokens = float(batch.sequences.attention_mask.sum())
    flops = model_flops(config, batch, size["group_size"])
    name = device_name(device)
    datasheet = next((tf for key, tf in PEAK_TFLOPS.items() if key in name), None) if device.type == "cuda" else None

    def figures(seconds: float) -> dict:
        achieved = flops / seconds / 1e12
        return {"update_seconds": round(seconds, 4), "learner_tokens_per_s": round(tokens / seconds, 1),
                "model_tflops": sig(achieved), "mfu_measured": sig(achieved / state["bf16_tflops"], 4),
                "mfu_datasheet": None if datasheet is None else round(achieved / datasheet, 4)}

    eager = figures(timed(lambda: update(plan), device, size["repeats"]))
    out = {"model": "qwen2.5-0.5b shape" if size is FULL else "tiny", "dtype": "bfloat16",
           "rows": len(batch.group_ids), "micro_batches": len(plan.micro_batches(batch.sequences, device=device)),
           "batch_tokens": int(tokens), "completion_tokens": int(batch.sequences.completion_mask.sum()), **eager,
           "datasheet_tflops": datasheet, "measured_bf16_tflops": sig(state["bf16_tflops"])}
    out["compiled"] = _compiled_update(lambda: update(replace(plan, compile=True)), device, size, figures,
                                       state["budget"] - (time.monotonic() - start) - 2)
    return {**out, **_fast_paths(device)}


def _compiled_update(update: Callable[[], None], device: torch.device, size: dict, figures: Callable[[float], dict],
                     seconds_left: float) -> dict:
    """The update with train.compile: its first call (compiling the layers, `compile_warmup_seconds`) apart,
    then the timed updates. `in_effect` False: the setting does nothing on this device (a CPU); `layers_compiled`
    False: compiling failed and the layers ran eagerly. Out of the part's time, the error instead of figures."""
    from reinforge.models.compiled_layers import compiled_layers_on

    out: dict = {"in_effect": device.type == "cuda"}
    try:
        with time_limit(seconds_left):
            synchronize(device)
            start = time.perf_counter()
            update()
            synchronize(device)
            out["compile_warmup_seconds"] = round(time.perf_counter() - start, 2)
            out.update(figures(timed(update, device, size["repeats"], warm_up=False)))
    except (Exception, OutOfTime) as err:
        traceback.print_exc(file=sys.stderr)
        out["error"] = f"{type(err).__name__}: {err}"[:500]
    out["layers_compiled"] = out["in_effect"] and compiled_layers_on()
    return out


def _profile_tables(prof, steps: int, top: int = 15) -> dict:
    """The profiler's top `top` device kernels and CPU ops by their own time, and the kernels per step."""
    from torch.autograd import DeviceType

    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    cpu_ops = [e for e in events if e.device_type == DeviceType.CPU]

    def rows(evts, attr):
        chosen = sorted(evts, key=lambda e: getattr(e, attr), reverse=True)[:top]
        return [{"name": e.key[:90], "ms": round(getattr(e, attr) / 1e3, 4), "calls": e.count} for e in chosen]

    device_attr = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
    kernel_ms = sum(getattr(e, device_attr) for e in kernels) / 1e3
    launches = sum(e.count for e in cpu_ops if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC",
                                                            "cuLaunchKernelEx"))
    graph_launches = sum(e.count for e in cpu_ops if e.key == "cudaGraphLaunch")
    syncs = sum(e.count for e in cpu_ops if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize",
                                                       "cudaMemcpyAsync"))
    return {"kernels_per_step": round(sum(e.count for e in kernels) / steps, 1) if kernels else None,
            "kernel_ms_per_step": round(kernel_ms / steps, 4) if kernels else None,
            "kernel_launches_per_step": round(launches / steps, 1),
            "graph_launches_per_step": round(graph_launches / steps, 1),
            "syncs_and_copies_per_step": round(syncs / steps, 1),
            "cpu_ops_per_step": round(sum(e.count for e in cpu_ops) / steps, 1),
            "top_kernels": rows(kernels, device_attr), "top_cpu_ops": rows(cpu_ops, "self_cpu_time_total")}


def part_profile(device: torch.device, size: dict, state: dict) -> dict:
    """torch.profiler over 2 decode steps of the native engine (the rollout part's model and rows, after
    enough steps that its decode graphs are captured) and over 1 learner micro-step (forward and backward
    of the learner part's first micro-batch): what the time goes to."""
    from torch.profiler import ProfilerActivity, profile

    from reinforge.learner import token_stats
    from reinforge.rollout import SamplingParams
    from reinforge.rollout.graphs import CAPTURE_AFTER

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    policy = shaped_policy(size["shape"], torch.bfloat16, device)
    config = policy.model.config
    g = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(3, config.vocab_size, (size["prompts"], size["prompt_length"]), generator=g).tolist()
    rows, steps = size["prompts"] * size["group_size"], 2
    engine = NativeEngine(policy)
    warm = CAPTURE_AFTER + 2
    session = engine.session(SamplingParams(temperature=1.0, max_new_tokens=warm + steps + 2), slots=rows,
                             generator=torch.Generator().manual_seed(0))
    session.add(prompt_ids, size["group_size"], tags=range(rows))
    for _ in range(warm):
        session.step()
    synchronize(device)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            session.step()
        synchronize(device)
    decode = {"rows": rows, "steps": steps, "graph_mode": engine.graph_mode, **_profile_tables(prof, steps)}
    del session

    new_tokens = size["learner_new_tokens"]
    batch = learner_batch(prompt_ids, size["group_size"], new_tokens, config.vocab_size,
                          policy.tokenizer.pad_token_id, g)
    plan = ForwardPlan.from_config(_update_config(size["prompt_length"], new_tokens).train)
    micro = plan.micro_batches(batch.sequences, device=device)[0]       # the update's own plan on this device
    seq = batch.sequences.rows(micro)

    def micro_step() -> None:
        stats = token_stats(policy.model, seq, 1.0, plan)
        (stats.logprobs.sum() + 0.01 * stats.entropy.sum()).backward()
        policy.model.zero_grad(set_to_none=True)

    micro_step()                                                       # warm-up: allocator, kernels
    synchronize(device)
    with profile(activities=activities) as prof:
        micro_step()
        synchronize(device)
    learner = {"rows": len(micro), "micro_batches": len(plan.micro_batches(batch.sequences, device=device)),
               "tokens": int(seq.attention_mask.sum()), **_profile_tables(prof, 1)}
    return {"decode": decode, "learner_micro_step": learner}


def part_default_job(device: torch.device, size: dict, state: dict) -> dict:
    out_dir = Path(tempfile.mkdtemp(prefix="gpu-check-job-"))
    overrides = [f"model.device={device}", f"output_dir={out_dir}", "log.progress=false",
                 *(DRY_JOB if size is DRY else [])]
    start = time.perf_counter()
    try:
        result = run(build_config(overrides))
    except OutOfTime as late:
        # How far it got: the held-out pass@1 before RL and the steps done, from its metrics.
        raise OutOfTime(f"{late}; reached: {json.dumps(_job_progress(out_dir))}") from None
    progress = _job_progress(out_dir)
    evals = result.summary["eval"]
    return {"overrides": overrides[:1] + overrides[3:], "wall_seconds": round(time.perf_counter() - start, 1),
            "pass@1_before": evals["start"]["pass@1"], "pass@1_after": evals["final"]["pass@1"],
            "rl_steps": result.summary["rl_steps"], "sft_steps": result.summary["sft"]["steps"], **progress}


def _job_progress(out_dir: Path) -> dict:
    path = out_dir / "metrics.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    rl = [x for x in lines if x.get("stage") == "rl"]
    evals = [x["eval/pass@1"] for x in lines if x.get("stage") == "eval" and "eval/pass@1" in x]
    out: dict = {"rl_steps_done": len(rl), "eval_pass@1": evals}
    if rl:
        out["rl_step_seconds_median"] = round(statistics.median(x["step_seconds"] for x in rl), 4)
        out["rl_generation_seconds_median"] = round(statistics.median(x["generation_seconds"] for x in rl), 4)
    return out


PARTS: dict[str, Callable[[torch.device, dict, dict], dict]] = {
    "card": part_card, "cuda_tests": part_cuda_tests, "rollout": part_rollout, "learner": part_learner,
    "profile": part_profile, "default_job": part_default_job,
}


def targets(lines: dict[str, dict]) -> dict:
    rollout, learner = lines.get("rollout", {}), lines.get("learner", {})

    def at_least(value, bound):
        return None if value is None else bool(value >= bound)

    # the better of the eager and the compiled (train.compile) update
    mfu = max((m for m in (learner.get("mfu_datasheet"), learner.get("compiled", {}).get("mfu_datasheet"))
               if m is not None), default=None)
    return {"learner_mfu_datasheet>=0.40": at_least(mfu, 0.40),
            "native_decode_vs_bound>=0.5": at_least(rollout.get("decode_vs_bound"), 0.5),
            "native_vs_generate>=2": at_least(rollout.get("native_vs_generate"), 2.0)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="auto", help="auto (cuda when there is one), cuda, cuda:N or cpu")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes: every part's code in seconds")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {','.join(PARTS)}")
    parser.add_argument("--budget-s", type=float, default=450.0, help="the whole check's seconds at most")
    parser.add_argument("--tests-k", default="", help="cuda_tests: only the tests pytest's -k selects")
    args = parser.parse_args(argv)
    os.chdir(ROOT)
    t0 = time.monotonic()
    device = resolve_device(args.device)
    size = DRY if args.dry_run else FULL
    name = device_name(device)
    wanted = [p for p in args.parts.split(",") if p]
    unknown = [p for p in wanted if p not in PARTS]
    if unknown:
        parser.error(f"unknown parts {unknown}: choose from {','.join(PARTS)}")
    if "card" not in wanted:
        wanted.insert(0, "card")           # the other parts read its bandwidth and matmul rate
    state: dict = {"tests_k": args.tests_k}
    lines: dict[str, dict] = {}
    for part in wanted:
        left = args.budget_s - (time.monotonic() - t0)
        budget = min(BUDGETS[part], left)
        state["budget"] = budget
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        start = time.monotonic()
        line: dict = {"part": part, "device": name}
        try:
            if budget <= 0:
                raise OutOfTime("no time left in the check's budget")
            with time_limit(budget), contextlib.redirect_stdout(sys.stderr):
                figures = PARTS[part](device, size, state)
            line.update(ok=True, **figures)
        except (Exception, OutOfTime) as err:
            traceback.print_exc(file=sys.stderr)
            line.update(ok=False, error=f"{type(err).__name__}: {err}"[:2000])
        line.update(seconds=round(time.monotonic() - start, 2), budget_s=round(budget, 1),
                    peak_memory_gib=peak_memory_gib(device))
        lines[part] = line
        print(json.dumps(line), flush=True)
    failed = [p for p, line in lines.items() if not line["ok"]]
    summary = {"part": "summary", "device": name, "ok": not failed, "failed": failed,
               "parts": {p: line["ok"] for p, line in lines.items()}, "targets": targets(lines),
               "dry_run": args.dry_run, "seconds": round(time.monotonic() - t0, 1), "torch": torch.__version__,
               "transformers": transformers.__version__}
    print(json.dumps(summary), flush=True)
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
