"""Peak memory of per-token log-probs + entropy + backward through the LM head: chunked
(`reinforge.learner.logprobs.chunked_token_logprobs_and_entropy`) against the naive full
[tokens x vocab] log-softmax, at Qwen2.5-0.5B's head size (hidden 896, vocab 151,936).

Method: each variant runs in a fresh subprocess of this script (torch's CPU allocations are not
seen by tracemalloc). After the inputs exist, the child reads its current RSS
(/proc/self/statm); after forward + backward it reads its peak RSS
(getrusage(RUSAGE_SELF).ru_maxrss). Peak growth = peak - RSS before: memory the computation
needed on top of its inputs, the parameter gradients included. The inputs are made in place
(no temporaries), so the peak before the run is the RSS before it, which the child checks.
Both children draw the same inputs from one seed and save their outputs; this process then
compares them on the full problem.

On a GPU (`--device cuda`) the inputs move there after they are made, and the peak growth is
torch.cuda.max_memory_allocated() after the run minus memory_allocated() before it (peak stats
reset in between): the caching allocator's view, which is what runs out.

Run: python benchmarks/logprob_memory.py [--tokens 4096] [--chunk-size 1024] [--device cpu|cuda]
The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from reinforge.learner.logprobs import chunked_token_logprobs_and_entropy


def current_rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def make_inputs(tokens: int, vocab: int, hidden: int, seed: int):
    """hidden [M, H] ~ N(0, 1) and weight [V, H] ~ N(0, 0.02^2) (logits of std ~0.6), targets [M],
    and the loss weights a, b [M]; all drawn in place, so no temporary raises the peak."""
    g = torch.Generator().manual_seed(seed)
    h = torch.empty(tokens, hidden).normal_(generator=g).requires_grad_()
    w = torch.empty(vocab, hidden).normal_(0.0, 0.02, generator=g).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), generator=g)
    a = torch.empty(tokens).normal_(generator=g)
    b = torch.empty(tokens).normal_(generator=g)
    return h, w, targets, a, b


def naive(h, w, targets):
    """The full [M, V] head, as `completion_token_stats` computes it (log-probs via log_softmax).
    Entropy as lse - sum p z, its formula: -(exp(log p) * log p).sum() is 1e-5 off the fp64
    value at this vocabulary in fp32 (the chunked path and lse - sum p z are ~1e-6 off)."""
    logits = h @ w.t()  # [M, V]
    z = logits.float()
    logp_all = torch.log_softmax(z, dim=-1)  # [M, V]
    logprobs = logp_all.gather(1, targets.unsqueeze(1)).squeeze(1)
    entropy = torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(dim=-1)
    return logprobs, entropy


def child(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    h, w, targets, a, b = make_inputs(args.tokens, args.vocab, args.hidden, args.seed)
    device = torch.device(args.device)
    if device.type == "cuda":
        h, w = (t.detach().to(device).requires_grad_() for t in (h, w))
        targets, a, b = (t.to(device) for t in (targets, a, b))
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        allocated_before = torch.cuda.memory_allocated(device) / 2**20
    rss_before, peak_before = current_rss_mb(), peak_rss_mb()
    start = time.perf_counter()
    if args.variant == "naive":
        logprobs, entropy = naive(h, w, targets)
    else:
        logprobs, entropy = chunked_token_logprobs_and_entropy(h, w, None, targets, chunk_size=args.chunk_size)
    (logprobs * a + entropy * b).sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    peak_after = peak_rss_mb()
    growth = (torch.cuda.max_memory_allocated(device) / 2**20 - allocated_before if device.type == "cuda"
              else peak_after - rss_before)
    torch.save({k: t.detach().cpu() for k, t in {"logprobs": logprobs, "entropy": entropy, "d_hidden": h.grad,
                                                  "d_weight": w.grad}.items()}, args.out)
    print(json.dumps({
        "variant": args.variant, "peak_growth_mb": growth, "rss_before_mb": rss_before,
        "peak_before_mb": peak_before, "peak_after_mb": peak_after, "seconds": seconds,
    }))


def run_child(variant: str, args: argparse.Namespace, out: Path) -> dict:
    cmd = [sys.executable, __file__, "--variant", variant, "--out", str(out), "--tokens", str(args.tokens),
           "--vocab", str(args.vocab), "--hidden", str(args.hidden), "--chunk-size", str(args.chunk_size),
           "--seed", str(args.seed), "--device", args.device]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    # The baseline is honest only if nothing before the run peaked above the RSS it started from.
    slack = report["peak_before_mb"] - report["rss_before_mb"]
    print(f"{variant:8s} peak growth {report['peak_growth_mb']:9.1f} MB  (RSS before {report['rss_before_mb']:.0f} MB,"
          f" earlier peak {slack:+.0f} MB above it)  {report['seconds']:.1f} s")
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--chunk-size", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: peak GPU memory instead of RSS")
    parser.add_argument("--variant", choices=["naive", "chunked"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        child(args)
        return

    start = time.perf_counter()
    print(
        f"tokens {args.tokens}, vocab {args.vocab}, hidden {args.hidden}, fp32, {args.device}, chunk_size "
        f"{args.chunk_size}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        reports = {v: run_child(v, args, Path(tmp) / f"{v}.pt") for v in ("naive", "chunked")}
        naive_out = torch.load(Path(tmp) / "naive.pt")
        chunked_out = torch.load(Path(tmp) / "chunked.pt")
    diffs = {k: (chunked_out[k] - naive_out[k]).abs().max().item() for k in naive_out}
    for k, d in diffs.items():
        print(f"max |chunked - naive| {k:9s} {d:.3g}  (max |naive| {naive_out[k].abs().max().item():.3g})")
    # Which of the two is off, where they differ: both against fp64 on the first 64 tokens.
    h, w, targets, _, _ = make_inputs(args.tokens, args.vocab, args.hidden, args.seed)
    rows = slice(0, 64)
    with torch.no_grad():
        logp_all = torch.log_softmax(h[rows].double() @ w.double().t(), dim=-1)  # [64, V]
        exact = {"logprobs": logp_all.gather(1, targets[rows].unsqueeze(1)).squeeze(1),
                 "entropy": -(logp_all.exp() * logp_all).sum(dim=-1)}
    del h, w, logp_all
    fp64_err = {v: max((out[k][rows].double() - exact[k]).abs().max().item() for k in exact)
                for v, out in (("naive", naive_out), ("chunked", chunked_out))}
    print(f"max |x - fp64| of logprobs, entropy on the first 64 tokens: naive {fp64_err['naive']:.3g}, "
          f"chunked {fp64_err['chunked']:.3g}")
    naive_mb, chunked_mb = reports["naive"]["peak_growth_mb"], reports["chunked"]["peak_growth_mb"]
    max_abs_diff = max(diffs.values())
    print(f"ratio chunked/naive {chunked_mb / naive_mb:.3f}; max abs diff {max_abs_diff:.3g} "
          f"({'<' if max_abs_diff < 1e-5 else 'NOT <'} 1e-5, full problem); {time.perf_counter() - start:.0f} s total")
    print(
        json.dumps(
            {
                "naive_peak_mb": round(naive_mb, 1), "chunked_peak_mb": round(chunked_mb, 1),
                "ratio": round(chunked_mb / naive_mb, 4), "max_abs_diff": max_abs_diff, "tokens": args.tokens,
                "vocab": args.vocab, "hidden": args.hidden, "chunk_size": args.chunk_size,
                "naive_err_vs_fp64": fp64_err["naive"],
                "chunked_err_vs_fp64": fp64_err["chunked"],
                "naive_seconds": round(reports["naive"]["seconds"], 1),
                "chunked_seconds": round(reports["chunked"]["seconds"], 1),
                "device": args.device,
                "method": (
                    "peak CUDA allocation growth per variant in a fresh subprocess: max_memory_allocated after "
                    "forward+backward minus memory_allocated after moving the inputs"
                    if args.device.startswith("cuda")
                    else "peak RSS growth per variant in a fresh subprocess: ru_maxrss after forward+backward minus "
                    "RSS (/proc/self/statm) after making the inputs"
                )
                + "; logprobs, entropy, d hidden, d weight "
                "compared on the full problem",
            }
        )
    )


if __name__ == "__main__":
    main()
