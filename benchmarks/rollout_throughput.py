"""New tokens per second: reinforge's native rollout engine vs transformers `generate`.

    .venv/bin/python benchmarks/rollout_throughput.py [--rounds 5] [--threads 2]
        [--shape builtin|qwen2.5-0.5b] [--device cpu|cuda] [--dtype float32|bfloat16]

Same model, prompts and sampling settings for both engines, in one process,
alternating runs (hf, native, hf, native, ...); the figure per engine is the
median over rounds of (completion tokens / seconds), where completion tokens
are the tokens each completion really has (up to and including <eos>).

Two scenarios on the built-in tiny Qwen2 (hidden 128, 4 layers, char
vocabulary), 32 prompts x 8 samples of the arithmetic task, temperature 1.0,
fp32:
- `fixed_length`: the random-init model never emits <eos>, so every row runs
  to max_new_tokens (32): pure per-token decoding speed, where dropping
  finished rows cannot help.
- `long_tail`: the same model with <eos> made likely in some contexts (its
  tied embedding row scaled up), so completion lengths are spread out, up to
  max_new_tokens (64): about half the rows end early (median ~60, many under
  30), the rest run to the limit. `generate` keeps finished rows in the batch
  until the longest ends; the native engine drops them.
The headline fields (`native_tokens_per_s`, `hf_tokens_per_s`, `ratio`) are
the `fixed_length` scenario's; the last line is one JSON object.

`--shape qwen2.5-0.5b --device cuda --dtype bfloat16` runs the same on a GPU with a random-init
Qwen2.5-0.5B-shaped model (train_throughput.py's `build_policy`; the char tokenizer encodes the
prompts, and the ids past its vocabulary decode to nothing). At that vocabulary a random model
almost never samples <eos>, so both scenarios run every row to its limit. On a CPU that shape runs 16
prompts x 2 samples by default (`--prompts`, `--group-size`): `generate` keeps every step's scores, at
151,936 tokens 10 GB for 256 rows of 64 steps.

`--vllm` adds vLLM (rollout.engine=vllm) as a third engine in the same alternation; run it with the
vLLM environment's python (`make vllm-env`, then `.venv-vllm/bin/python benchmarks/rollout_throughput.py
--vllm`). benchmarks/vllm_engine.py compares the three with top-p sampling and a model folder.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import transformers
from train_throughput import DTYPES, build_policy

from reinforge.models import resolve_device
from reinforge.rollout import HFEngine, NativeEngine, SamplingParams
from reinforge.tasks import build_task


def scenario(engines: dict, prompts: list[str], group_size: int, max_new_tokens: int, rounds: int) -> dict:
    params = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens)
    rates: dict[str, list[float]] = {name: [] for name in engines}
    lengths: dict[str, list[float]] = {name: [] for name in engines}
    for round_ in range(rounds + 1):        # round 0 warms both engines up and is not counted
        for name, engine in engines.items():
            torch.manual_seed(round_)
            start = time.perf_counter()
            rollout = engine.generate(prompts, group_size, params)
            seconds = time.perf_counter() - start
            if round_:
                rates[name].append(float(rollout.completion_mask.sum()) / seconds)
                lengths[name].extend(rollout.lengths.tolist())
    native, hf = statistics.median(rates["native"]), statistics.median(rates["hf"])
    vllm = {}
    if "vllm" in rates:
        vllm_rate = statistics.median(rates["vllm"])
        vllm = {"vllm_tokens_per_s": round(vllm_rate, 1), "native_over_vllm": round(native / vllm_rate, 3),
                "vllm_runs": [round(r, 1) for r in rates["vllm"]]}
    return {
        "native_tokens_per_s": round(native, 1),
        "hf_tokens_per_s": round(hf, 1),
        "ratio": round(native / hf, 3),
        **vllm,
        "max_new_tokens": max_new_tokens,
        "mean_length": {k: round(statistics.mean(v), 2) for k, v in lengths.items()},
        "max_length": {k: int(max(v)) for k, v in lengths.items()},
        "truncation_rate": {k: round(sum(x >= max_new_tokens for x in v) / len(v), 3) for k, v in lengths.items()},
        "native_runs": [round(r, 1) for r in rates["native"]],
        "hf_runs": [round(r, 1) for r in rates["hf"]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--eos-scale", type=float, default=12.0, help="long_tail: factor on the <eos> embedding row")
    parser.add_argument("--shape", choices=["builtin", "qwen2.5-0.5b"], default="builtin")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--vllm", action="store_true", help="add vLLM (rollout.engine=vllm; .venv-vllm's python)")
    parser.add_argument("--vllm-memory", type=float, default=None,
                        help="vLLM's gpu_memory_utilization (on a CPU its share of the machine's memory); default 0.1, "
                             "0.35 at the 0.5B shape, whose fp32 weights alone are ~2 GB of it")
    parser.add_argument("--prompts", type=int, default=None, help="default 32; 16 at the 0.5B shape on a CPU")
    parser.add_argument("--group-size", type=int, default=None, help="default 8; 2 at the 0.5B shape on a CPU")
    args = parser.parse_args()
    # transformers' generate keeps every step's scores: at the 0.5B shape's 151,936 tokens, 256 rows x 64 steps
    # are 10 GB of them, which with vLLM's reservation outgrows a 24 GB machine; on a CPU that shape runs 32 rows
    small = args.shape != "builtin" and args.device == "cpu"
    n_prompts = args.prompts or (16 if small else 32)
    group_size = args.group_size or (2 if small else 8)
    torch.set_num_threads(args.threads)

    policy = build_policy(args.shape, DTYPES[args.dtype], resolve_device(args.device), seed=0)
    config = policy.model.config
    prompts = [e.prompt for e in build_task("arithmetic").train_split(n_prompts)]
    engines = {"hf": HFEngine(policy), "native": NativeEngine(policy)}
    if args.vllm:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from reinforge.rollout.vllm_engine import VLLMEngine

        memory = args.vllm_memory if args.vllm_memory is not None else 0.35 if args.shape != "builtin" else 0.1
        engines["vllm"] = VLLMEngine(policy, gpu_memory_utilization=memory)
    fixed = scenario(engines, prompts, group_size, 32, args.rounds)
    with torch.no_grad():       # every engine reads it (vLLM's copy: published by its next generate)
        policy.model.get_output_embeddings().weight[policy.tokenizer.eos_token_id] *= args.eos_scale
    long_tail = scenario(engines, prompts, group_size, 64, args.rounds)
    print(json.dumps({
        "native_tokens_per_s": fixed["native_tokens_per_s"],
        "hf_tokens_per_s": fixed["hf_tokens_per_s"],
        "ratio": fixed["ratio"],
        **({"vllm_tokens_per_s": fixed["vllm_tokens_per_s"], "native_over_vllm": fixed["native_over_vllm"]}
           if args.vllm else {}),
        "fixed_length": fixed,
        "long_tail": long_tail,
        "prompts": n_prompts, "group_size": group_size, "threads": args.threads, "rounds": args.rounds,
        "model": {"shape": args.shape, "hidden": config.hidden_size, "layers": config.num_hidden_layers,
                  "vocab": config.vocab_size}, "device": str(policy.model.device), "dtype": args.dtype,
        "torch": torch.__version__, "transformers": transformers.__version__,
    }))


if __name__ == "__main__":
    main()
