"""New tokens per second: reinforge's native engine vs vLLM (rollout.engine=vllm) vs transformers `generate`.

    make vllm-env
    .venv-vllm/bin/python benchmarks/vllm_engine.py [--rounds 3] [--threads 1] [--shape builtin|qwen2.5-0.5b]
        [--prompts 32] [--group-size 8] [--max-new-tokens 32] [--vocab N] [--top-p 0.9]

Same model folder, prompts and sampling (temperature 1.0, top-p 0.9 or --top-p, fp32) for the three engines, in one
process, alternating runs (native, vllm, hf, native, ...); round 0 warms each engine up (vLLM's first
`generate` on a new machine takes ~40 s, later ones reuse its cache) and is not counted. The figure per
engine is the median over rounds of completion tokens (up to and including <eos>) / seconds.

The built-in shape here is the default built-in Qwen2 (128 wide, 4 layers, char vocabulary) with 4
attention heads instead of 8: vLLM's CPU attention needs a head size of 32 or more. `qwen2.5-0.5b` is a
random-init model of that shape (train_throughput.py's), for which a few prompts are enough on a CPU;
`--vocab N` gives it an N-token vocabulary instead of Qwen2.5's 151,936 (the char tokenizer's ids are
below 100, so any N >= 100 serves the prompts).
The last line is one JSON object. It needs vLLM: run it with the vLLM environment's python.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch  # noqa: E402
import transformers  # noqa: E402
from train_throughput import QWEN25_05B, shaped_policy  # noqa: E402

from reinforge.models import build_tiny_qwen2  # noqa: E402
from reinforge.rollout import HFEngine, NativeEngine, SamplingParams  # noqa: E402
from reinforge.rollout.vllm_engine import VLLMEngine  # noqa: E402
from reinforge.settings import ModelConfig  # noqa: E402
from reinforge.tasks import build_task  # noqa: E402


def build(shape: str, vocab: int | None = None):
    if shape == "builtin":
        return build_tiny_qwen2(ModelConfig(num_heads=4, num_kv_heads=4, max_positions=256), seed=0)
    return shaped_policy({**QWEN25_05B, **({"vocab_size": vocab} if vocab else {})}, torch.float32,
                         torch.device("cpu"), seed=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--shape", choices=["builtin", "qwen2.5-0.5b"], default="builtin")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--memory", type=float, default=0.1, help="vLLM's gpu_memory_utilization (CPU memory here)")
    parser.add_argument("--top-p", type=float, default=0.9, help="nucleus sampling's p (1.0: plain sampling)")
    parser.add_argument("--vocab", type=int, default=None,
                        help="qwen2.5-0.5b: another vocabulary size (e.g. 1000: the decoder's share of the step "
                             "without Qwen2.5's 136 M-parameter head)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)    # before vLLM starts: it pins the thread count afterwards

    policy = build(args.shape, args.vocab)
    prompts = [e.prompt for e in build_task("arithmetic").train_split(args.prompts)]
    start = time.perf_counter()
    vllm = VLLMEngine(policy, gpu_memory_utilization=args.memory, max_model_len=256)
    vllm_start_s = time.perf_counter() - start
    engines = {"native": NativeEngine(policy), "vllm": vllm, "hf": HFEngine(policy)}
    params = SamplingParams(temperature=1.0, top_p=args.top_p, max_new_tokens=args.max_new_tokens)
    rates: dict[str, list[float]] = {name: [] for name in engines}
    warmup: dict[str, float] = {}
    for round_ in range(args.rounds + 1):
        for name, engine in engines.items():
            t = time.perf_counter()
            rollout = engine.generate(prompts, args.group_size, params, generator=torch.Generator().manual_seed(round_))
            seconds = time.perf_counter() - t
            if round_:
                rates[name].append(float(rollout.completion_mask.sum()) / seconds)
            else:
                warmup[name] = round(seconds, 2)
    median = {name: statistics.median(r) for name, r in rates.items()}
    config = policy.model.config
    print(json.dumps({
        "native_tokens_per_s": round(median["native"], 1),
        "vllm_tokens_per_s": round(median["vllm"], 1),
        "hf_tokens_per_s": round(median["hf"], 1),
        "native_over_vllm": round(median["native"] / median["vllm"], 2),
        "vllm_over_hf": round(median["vllm"] / median["hf"], 2),
        "runs": {name: [round(x, 1) for x in r] for name, r in rates.items()},
        "vllm_start_s": round(vllm_start_s, 2), "warmup_s": warmup,
        "prompts": args.prompts, "group_size": args.group_size, "max_new_tokens": args.max_new_tokens,
        "threads": args.threads, "rounds": args.rounds, "sampling": {"temperature": 1.0, "top_p": args.top_p},
        "model": {"shape": args.shape, "hidden": config.hidden_size, "layers": config.num_hidden_layers,
                  "heads": config.num_attention_heads, "vocab": config.vocab_size},
        "torch": torch.__version__, "transformers": transformers.__version__,
        "vllm": __import__("vllm").__version__,
    }))


if __name__ == "__main__":
    main()
