"""Training throughput of reinforge's RL step parts on one device: rollout tokens/s of the native
engine and learner tokens/s and MFU of one policy update, on a random-init model.

    .venv/bin/python benchmarks/train_throughput.py [--shape builtin|qwen2.5-0.5b] [--device auto]
        [--dtype float32|bfloat16] [--prompts 32] [--group-size 8] [--prompt-length 64]
        [--max-new-tokens 256] [--repeats 3] [--peak-tflops X]

`qwen2.5-0.5b` is Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 query / 2 key-value heads,
MLP 4,864, vocabulary 151,936, tied embeddings), randomly initialised: what the GPU record of
issue 4 asks for. `builtin` is the built-in tiny Qwen2 (a quick run on a CPU).

- Rollout: `--prompts` prompts of `--prompt-length` random token ids, `--group-size` samples each,
  `--max-new-tokens` new tokens at temperature 1 through a native-engine decoding session; new
  tokens per second. A random model samples <eos> with probability ~1 / vocabulary per token: at
  Qwen's 151,936 every row runs to the limit, at the built-in 89 rows end early (mean ~80).
- Learner: one `policy_update` (dr_grpo's loss: no KL, so no reference model; one optimizer step,
  the default forward plan: the shared-prompt forward with the chunked fp32 head) on a batch of
  the same shape with completion lengths drawn long-tailed up to `--max-new-tokens` (k ~ P(k >= x)
  = 1 / (x + 1) times max/8, at least 1) and random advantages. `learner_tokens_per_s` counts the
  batch's prompt and completion tokens (each row's own); `mfu` divides the model FLOPs of the work
  the forward really does (each prompt once per group, then the completions) by the time and the
  device's peak: 6 x (matmul parameters) per token plus 12 x layers x heads x head_dim x (keys
  attended) per token for attention (PaLM, arXiv 2204.02311, app. B, with each token's own causal
  context). The peak is `--peak-tflops`, or for a known GPU its dense bf16/fp16 rate (H100/H200
  SXM: 989 TFLOP/s); none on a CPU (mfu is then null).

Each figure is the median of `--repeats` timed runs after one warm-up run. The last line is one
JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

from reinforge.config import build_config
from reinforge.jobs.start import objective_spec
from reinforge.learner import (
    ForwardPlan,
    LearnerBatch,
    UpdateSettings,
    build_optimizer,
    build_sequences,
    policy_update,
    warmup_constant,
)
from reinforge.models import Policy, build_tiny_qwen2, resolve_device
from reinforge.models.tokenizer import build_char_tokenizer
from reinforge.rollout import NativeEngine, SamplingParams
from reinforge.settings import ModelConfig

QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, vocab_size=151_936, max_position_embeddings=32_768, rope_theta=1_000_000.0,
                  rms_norm_eps=1e-6, tie_word_embeddings=True)
# Dense bf16/fp16 tensor-core peaks (vendor data sheets), by a name fragment of torch.cuda.get_device_name().
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build_policy(shape: str, dtype: torch.dtype, device: torch.device, seed: int) -> Policy:
    """The model, initialised on the CPU under `seed` and moved, with the char tokenizer (its pad and
    eos ids; the benchmark feeds token ids and never decodes text)."""
    if shape == "builtin":
        policy = build_tiny_qwen2(ModelConfig(max_positions=4096), seed)
        return Policy(policy.model.to(device=device, dtype=dtype), policy.tokenizer)
    return shaped_policy(QWEN25_05B, dtype, device, seed)


def shaped_policy(shape: dict, dtype: torch.dtype, device: torch.device, seed: int = 0) -> Policy:
    """A random-init Qwen2 of `shape` (initialised on the CPU under `seed`, then moved) with the char
    tokenizer, whose pad and <eos> ids it uses; ids past its vocabulary decode to nothing."""
    tokenizer = build_char_tokenizer()
    config = Qwen2Config(**shape, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=None)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    return Policy(model.to(device=device, dtype=dtype), tokenizer)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rollout_seconds(engine: NativeEngine, prompt_ids: list[list[int]], group_size: int, max_new_tokens: int,
                    seed: int) -> tuple[float, int]:
    """Seconds to decode every sample of `prompt_ids`, and the new tokens decoded."""
    params = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens)
    session = engine.session(params, slots=len(prompt_ids) * group_size, generator=torch.Generator().manual_seed(seed))
    device = engine.policy.model.device
    synchronize(device)
    start = time.perf_counter()
    session.add(prompt_ids, group_size, tags=range(len(prompt_ids) * group_size))
    tokens = 0
    while session.busy:
        tokens += sum(len(row.tokens) for row in session.step())
    synchronize(device)
    return time.perf_counter() - start, tokens


def learner_batch(prompt_ids: list[list[int]], group_size: int, max_new_tokens: int, vocab: int, pad: int,
                  g: torch.Generator) -> LearnerBatch:
    rows = [p for p in prompt_ids for _ in range(group_size)]
    u = torch.rand(len(rows), generator=g)
    lengths = ((1.0 / u - 1.0) * max_new_tokens / 8).floor().clamp(min=1, max=max_new_tokens).long()
    mask = (torch.arange(max_new_tokens)[None, :] < lengths[:, None]).float()
    ids = torch.randint(3, vocab, (len(rows), max_new_tokens), generator=g).masked_fill(mask == 0, pad)
    group_ids = torch.arange(len(prompt_ids)).repeat_interleave(group_size)
    sequences = build_sequences(rows, ids, mask, pad, group_ids=group_ids)
    return LearnerBatch(sequences=sequences, advantages=torch.randn(len(rows), generator=g), old_logprobs=None,
                        sampler_logprobs=torch.zeros_like(mask), group_ids=group_ids)


def model_flops(config: Qwen2Config, batch: LearnerBatch, group_size: int) -> float:
    """Training FLOPs of the shared-prompt forward and backward over `batch` (see the module docstring)."""
    e, layers, heads = config.hidden_size, config.num_hidden_layers, config.num_attention_heads
    head_dim = e // heads
    kv = config.num_key_value_heads
    per_layer = e * (heads * head_dim + 2 * kv * head_dim) + heads * head_dim * e + 3 * e * config.intermediate_size
    head_params = config.vocab_size * e                                  # the LM head is a matmul, the lookup is not
    seq = batch.sequences
    prompt_len = seq.starts.float()
    completion = seq.completion_mask.sum(dim=1)
    # Positions through the layers: each group's prompt once, and each row's completion but its last token
    # (it predicts nothing; the first is predicted by the prompt's last position). The head runs on the
    # positions that predict a completion token: one per completion token.
    run = (completion - 1).clamp(min=0)
    prompt_tokens = float(prompt_len[::group_size].sum())
    layer_tokens = prompt_tokens + float(run.sum())
    head_tokens = float(completion.sum())
    # Keys attended: prompt token i sees i + 1 keys; completion position j (0-based) sees prompt + j + 1.
    prompt_keys = float((prompt_len[::group_size] * (prompt_len[::group_size] + 1) / 2).sum())
    completion_keys = float((run * prompt_len + run * (run + 1) / 2).sum())
    dense = 6.0 * (layers * per_layer * layer_tokens + head_params * head_tokens)
    attention = 12.0 * layers * heads * head_dim * (prompt_keys + completion_keys)
    return dense + attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=["builtin", "qwen2.5-0.5b"], default="builtin")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-length", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the device's peak, for mfu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device, dtype = resolve_device(args.device), DTYPES[args.dtype]
    policy = build_policy(args.shape, dtype, device, args.seed)
    config = policy.model.config
    g = torch.Generator().manual_seed(args.seed)
    prompt_ids = torch.randint(3, config.vocab_size, (args.prompts, args.prompt_length), generator=g).tolist()

    engine = NativeEngine(policy)
    rollout = [rollout_seconds(engine, prompt_ids, args.group_size, args.max_new_tokens, args.seed + r)
               for r in range(args.repeats + 1)][1:]
    rollout_rate = statistics.median(tokens / seconds for seconds, tokens in rollout)

    cfg = build_config(["recipe=dr_grpo", f"rollout.max_new_tokens={args.max_new_tokens}"])
    spec, plan = objective_spec(cfg), ForwardPlan.from_config(cfg.train)
    optimizer = build_optimizer(policy.model, 1e-6)
    scheduler = warmup_constant(optimizer, 0)
    batch = learner_batch(prompt_ids, args.group_size, args.max_new_tokens, config.vocab_size,
                          policy.tokenizer.pad_token_id, g)
    learner = []
    for _ in range(args.repeats + 1):
        synchronize(device)
        start = time.perf_counter()
        policy_update(
            policy.model,
            optimizer,
            scheduler,
            batch,
            spec,
            UpdateSettings(forward=plan, max_length=args.max_new_tokens),
            torch.Generator().manual_seed(args.seed),
        )
        synchronize(device)
        learner.append(time.perf_counter() - start)
    learner_s = statistics.median(learner[1:])
    tokens = float(batch.sequences.attention_mask.sum())
    flops = model_flops(config, batch, args.group_size)
    peak = args.peak_tflops
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    if peak is None:
        peak = (
            next((tf for name, tf in PEAK_TFLOPS.items() if name in device_name), None)
            if dtype != torch.float32
            else None
        )
    print(json.dumps({
        "rollout_tokens_per_s": round(rollout_rate, 1),
        "learner_tokens_per_s": round(tokens / learner_s, 1),
        "learner_tflops": round(flops / learner_s / 1e12, 3),
        "mfu": None if peak is None else round(flops / learner_s / (peak * 1e12), 4),
        "learner_seconds": round(learner_s, 4),
        "rollout_seconds": round(statistics.median(s for s, _ in rollout), 4),
        "shape": args.shape, "parameters": sum(p.numel() for p in policy.model.parameters()),
        "dtype": args.dtype, "device": device_name, "peak_tflops": peak,
        "prompts": args.prompts, "group_size": args.group_size, "prompt_length": args.prompt_length,
        "max_new_tokens": args.max_new_tokens, "learner_batch_tokens": int(tokens),
        "completion_tokens": int(batch.sequences.completion_mask.sum()), "repeats": args.repeats,
        "torch": torch.__version__,
    }))


if __name__ == "__main__":
    main()
