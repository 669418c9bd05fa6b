r"""Where the time of one RL step and one SFT step goes, on whatever CPU runs it: a split by part, as JSON.

    .venv/bin/python benchmarks/step_profile.py [--steps 5] [--warmup 2] [--threads 2] [--recipe grpo] \
        [--task arithmetic] [--sft-only | --rl-only] [key=value ...]

The steps are those of `reinforge train` with its defaults (key=value: config overrides, as on its
command line; --recipe, --task and --threads set recipe, task.name and threads): the job's bootstrap
(`jobs.start`: prepare, load_policy, rollout_engine), then `run_sft` as the job's SFT stage calls it,
then `run_rl` (the one training loop) on the model SFT left. Nothing is re-implemented: the functions
the loop calls are wrapped for the run by timers (`PartClock`), and each step's wall time, from the end
of the step before to the end of this one (the loop's `on_step`), is cut into

RL step ("rl"):
  generation      NativeEngine.generate: prompt encoding, the decode steps, sampling, text decoding
                  (agent episodes: AgentEngine.generate, its tools' and environments' time included)
  prefill         the engine's prefill passes inside generation (and a multi-turn row's continuation)
  rewards         the composed reward (reward functions, verifiers, reward sources)
  curation        BatchCollector.collect: prompts drawn, group filters, rows selected and joined
  batch_building  build_sequences, and every (micro-)batch's rows cut and moved (SequenceBatch.rows / .to)
  old_logprobs    pi_old: the learner's no-grad forward where the loop takes it before the update
                  (the first mini-batch takes it from its own training forward: that is `forward`); 0 where
                  the sampler's log-probs are taken (train.old_logprobs=auto with the native engine, or rollout)
  reference       the reference model's log-probs (and an EMA reference's update); 0 without a KL term
  advantages      the credit assignment (group estimator, or the critic's GAE)
  forward         the learner's training forwards (token_stats in policy_update)
  loss            the objective's per-token terms and their reduction (objective_loss)
  backward        loss.backward()
  optimizer       gradient clipping and optimizer.step
  critic          the critic's update after the policy's (PPO, VAPO); 0 without a critic
  weight_sync     the weight-sync probe after an update (train.weight_sync.verify; .every: the native engine
                  in one process is probed after the first update and every 10th, 0 in other steps)
  update_other    the rest of policy_update: aggregation weights, slicing, mismatch metrics, zero_grad,
                  the scheduler
  rest            everything else (the loop, the learner step's glue, metrics): Python overhead

SFT step ("sft"): batch_building (the step's rows cut and moved), forward, backward, optimizer (clipping
and step), rest (the loss reduction, zero_grad, the scheduler, the loop).

A part's seconds are exclusive: a part timed inside another (prefill in generation, batch building in
the forward) counts for itself only, so no second is counted twice and `rest` is the wall time no part
covers. Inside old_logprobs, reference, critic, weight_sync and rewards nothing is split further: their
forwards and backwards are theirs. The job's own per-step work outside the loop (metrics.jsonl, the
periodic held-out evaluation, checkpoints) is not part of a step here.

`--warmup` steps run first and are left out; of the `--steps` timed steps, `parts` is the split of the
median one (by wall time, the lower median for an even count): its parts add up to its wall time
`step_seconds`. `part_medians` gives each part's own median over the timed steps (these need not add
up), `steps_s` every timed step's wall time. The RL step's figures depend on the model: completion
lengths (how many decode steps a batch needs) come from the model SFT left after warmup + steps SFT
steps (nearly the random init); pass model.path=DIR for a trained start model (e.g. the folder
benchmarks/time_to_accuracy.py trains, DIR/model). `completion_tokens` says how many tokens a step sampled.

The last line of stdout is one JSON object: rl and sft (each: step_seconds, parts {part: {seconds,
share}}, part_medians, steps_s and the step's settings), cpu (lscpu's model name), cpu_features (its
vector instruction sets), cpus, torch_threads, cpu_kernels (whether the native engine decodes with
reinforge's fused CPU kernels), kernel_tuning (the row block of their products chosen on this machine
and the ms each candidate took, reinforge/kernels/tuning.py), env (OMP_NUM_THREADS, OMP_WAIT_POLICY,
GOMP_SPINCOUNT (which `reinforge train` sets, 1000 or 20000 by the load at its start, when neither is set; this
script runs with what its environment has), MKL_NUM_THREADS,
REINFORGE_CPU_KERNELS as set), load_avg_start / load_avg_end (1, 5, 15 minutes),
torch, transformers, python.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import subprocess
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import transformers
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

import reinforge.jobs.rl as jobs_rl
import reinforge.learner.update as learner_update
import reinforge.loops.rl as loops_rl
import reinforge.loops.sft as loops_sft
from reinforge.agents.rollout import AgentEngine
from reinforge.config import build_config
from reinforge.curation.batches import BatchCollector
from reinforge.jobs.rl import run_rl, sft_examples
from reinforge.jobs.start import load_policy, prepare, rollout_engine
from reinforge.kernels import TUNING
from reinforge.learner import ForwardPlan, Reference, SequenceBatch
from reinforge.loops.credit import CriticCredit, GroupCredit
from reinforge.loops.sft import run_sft
from reinforge.rollout.native import NativeEngine
from reinforge.rollout.session import DecodeSession
from reinforge.rollout.weight_sync import WeightSyncCheck

RL_PARTS = ("generation", "prefill", "rewards", "curation", "batch_building", "old_logprobs", "reference",
            "advantages", "forward", "loss", "backward", "optimizer", "critic", "weight_sync", "update_other", "rest")
SFT_PARTS = ("batch_building", "forward", "backward", "optimizer", "rest")
# Settings of the environment that change the figures (None: not set).
ENV = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "MKL_NUM_THREADS", "REINFORGE_CPU_KERNELS")
# Parts that own everything inside them: a forward of the reference model is the reference's time.
OPAQUE = frozenset({"old_logprobs", "reference", "critic", "weight_sync", "rewards"})


class PartClock:
    """Exclusive seconds per part: a part's wall time less that of the parts timed inside it."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.stack: list[list] = []      # [part, start, seconds of the parts inside it]
        self.ticks: list[tuple[float, dict[str, float]]] = []

    def enter(self, part: str) -> None:
        self.stack.append([part, time.perf_counter(), 0.0])

    def exit(self) -> None:
        part, start, inner = self.stack.pop()
        elapsed = time.perf_counter() - start
        self.totals[part] += elapsed - inner
        if self.stack:
            self.stack[-1][2] += elapsed

    def opaque(self) -> bool:
        return any(entry[0] in OPAQUE for entry in self.stack)

    def timed(self, fn: Callable, part: str) -> Callable:
        """`fn`, its calls timed as `part` (inside an opaque part: not split out of it)."""
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if self.opaque():
                return fn(*args, **kwargs)
            self.enter(part)
            try:
                return fn(*args, **kwargs)
            finally:
                self.exit()
        return wrapper

    def returns_timed(self, fn: Callable, part: str) -> Callable:
        """`fn` (a factory), whose returned callable's calls are timed as `part`."""
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            return self.timed(fn(*args, **kwargs), part)
        return wrapper

    def tick(self) -> None:
        """A step ended (the loop's on_step, outside every part)."""
        if self.stack:
            raise RuntimeError(f"a step ended inside part {self.stack[-1][0]!r}: the step ends are not the loop's")
        self.ticks.append((time.perf_counter(), dict(self.totals)))

    def steps(self, warmup: int, parts: tuple[str, ...]) -> list[dict[str, float]]:
        """Each step after the first `warmup` (>= 1): its wall time ("wall") and seconds per part, `rest` the
        wall time no part covers."""
        out = []
        for (t0, before), (t1, after) in zip(self.ticks[warmup - 1:], self.ticks[warmup:], strict=False):
            unknown = set(after) - set(parts)
            if unknown:
                raise RuntimeError(f"parts {sorted(unknown)} are not in the split {parts}")
            step = {part: after.get(part, 0.0) - before.get(part, 0.0) for part in parts if part != "rest"}
            step["rest"] = (t1 - t0) - sum(step.values())
            step["wall"] = t1 - t0
            out.append(step)
        return out


@contextmanager
def patched(clock: PartClock, hooks: list[tuple[object, str, str]], factories: list[tuple[object, str, str]] = ()
            ) -> Iterator[None]:
    """The functions of `hooks` ((owner, attribute, part)) timed while inside; each factory of `factories`
    has its returned callables timed; every optimizer.step (torch's global step hooks) is `optimizer`."""
    saved, entered = [], []

    def before_step(*_) -> None:
        entered.append(not clock.opaque())
        if entered[-1]:
            clock.enter("optimizer")

    def after_step(*_) -> None:
        if entered.pop():
            clock.exit()

    handles = [register_optimizer_step_pre_hook(before_step), register_optimizer_step_post_hook(after_step)]
    try:
        for wrap, entries in ((clock.timed, hooks), (clock.returns_timed, factories)):
            for owner, attr, part in entries:
                own = attr in vars(owner)     # a class's own attribute, or one it inherits (deleted again after)
                original = getattr(owner, attr)
                saved.append((owner, attr, vars(owner)[attr] if own else None))
                setattr(owner, attr, wrap(original, part))
        yield
    finally:
        for handle in handles:
            handle.remove()
        for owner, attr, original in reversed(saved):
            if original is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, original)


def shared_hooks() -> list[tuple[object, str, str]]:
    """The parts RL and SFT share."""
    return [(SequenceBatch, "rows", "batch_building"), (SequenceBatch, "to", "batch_building"),
            (torch.Tensor, "backward", "backward"), (torch.nn.utils, "clip_grad_norm_", "optimizer")]


def rl_hooks() -> list[tuple[object, str, str]]:
    return [
        *shared_hooks(),
        (NativeEngine, "generate", "generation"), (NativeEngine, "_prefill", "prefill"),
        # Agent episodes (tools, environments): the episodes' loop with its sessions, the turns' continuations
        # (their passes, and each continued row's first token)
        (AgentEngine, "generate", "generation"), (DecodeSession, "extend_many", "prefill"),
        (BatchCollector, "collect", "curation"), (loops_rl, "build_sequences", "batch_building"),
        (loops_rl, "token_logprobs", "old_logprobs"), (learner_update, "_fill_old_logprobs", "old_logprobs"),
        (Reference, "logprobs", "reference"), (Reference, "after_update", "reference"),
        (GroupCredit, "assign", "advantages"), (CriticCredit, "assign", "advantages"),
        (CriticCredit, "after_update", "critic"),
        (learner_update, "token_stats", "forward"), (learner_update, "objective_loss", "loss"),
        (loops_rl, "policy_update", "update_other"), (WeightSyncCheck, "verify", "weight_sync"),
    ]


def median_step(steps: list[dict[str, float]], parts: tuple[str, ...]) -> dict:
    """The step of median wall time, split; each part's own median; every step's wall time."""
    chosen = sorted(steps, key=lambda s: s["wall"])[(len(steps) - 1) // 2]
    wall = chosen["wall"]
    return {
        "step_seconds": round(wall, 6),
        "parts": {p: {"seconds": round(chosen[p], 6), "share": round(chosen[p] / wall, 4)} for p in parts},
        "part_medians": {p: round(statistics.median(s[p] for s in steps), 6) for p in parts},
        "steps_s": [round(s["wall"], 6) for s in steps],
    }


def profile_sft(cfg, policy, engine, task, warmup: int, steps: int) -> dict:
    """`steps` SFT steps after `warmup`, as the job's SFT stage runs them (jobs/rl.py run_sft_stage)."""
    data, _ = sft_examples(cfg, engine, task)
    sft = cfg.sft.model_copy(update={"steps": warmup + steps})
    clock = PartClock()
    hooks = [*shared_hooks(), (loops_sft, "token_stats", "forward")]
    with patched(clock, hooks):
        run_sft(policy, data, sft, chat_template=cfg.prompt.chat_template, seed=cfg.seed,
                on_step=lambda step, loss: clock.tick(), forward=ForwardPlan.from_config(cfg.train),
                renderer=getattr(engine, "renderer", None))
    return {**median_step(clock.steps(warmup, SFT_PARTS), SFT_PARTS), "batch_size": cfg.sft.batch_size,
            "examples": len(data)}


def profile_rl(cfg, policy, engine, task, spec, warmup: int, steps: int) -> dict:
    """`steps` RL steps after `warmup`, through `run_rl` as the job calls it."""
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"steps": warmup + steps})})
    clock, tokens = PartClock(), []

    def on_step(record, state) -> None:
        clock.tick()
        rows = cfg.train.prompts_per_step * cfg.train.group_size
        tokens.append(record.metrics.get("response_length_mean", float("nan")) * rows)

    with patched(clock, rl_hooks(), factories=[(jobs_rl, "composed_scores", "rewards")]):
        run_rl(cfg, policy, engine, task, spec, on_step)
    split = median_step(clock.steps(warmup, RL_PARTS), RL_PARTS)
    return {**split, "recipe": cfg.recipe, "task": cfg.task.name, "engine": cfg.rollout.engine,
            "prompts_per_step": cfg.train.prompts_per_step, "group_size": cfg.train.group_size,
            "mini_batches": cfg.train.mini_batches, "max_new_tokens": cfg.rollout.max_new_tokens,
            "completion_tokens": round(statistics.median(tokens[warmup:]), 1)}


def cpu_model() -> str:
    """lscpu's "Model name" (else /proc/cpuinfo's, else the platform's)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_features() -> list[str]:
    """The vector instruction sets the kernels and BLAS may use, of /proc/cpuinfo's flags (Linux; else [])."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return []
    return [flag for flag in ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile") if flag in flags]


def uses_kernels(engine) -> bool:
    """Whether the native engine decodes with reinforge's fused CPU kernels: they built on this machine
    (REINFORGE_CPU_KERNELS unset, a C++ compiler) and fit the model; else its PyTorch path."""
    while not hasattr(engine, "kernels") and hasattr(engine, "engine"):      # an agent engine's native engine
        engine = engine.engine
    return getattr(engine, "kernels", None) is not None


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="timed steps of each kind")
    parser.add_argument("--warmup", type=int, default=2, help="steps run first and left out (at least 1)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: the config's)")
    parser.add_argument("--recipe", default=None, help="the RL recipe (default: reinforge train's)")
    parser.add_argument("--task", default=None, help="task.name (default: reinforge train's)")
    only = parser.add_mutually_exclusive_group()
    only.add_argument("--sft-only", action="store_true", help="profile the SFT step alone")
    only.add_argument("--rl-only", action="store_true", help="profile the RL step alone (from the loaded model)")
    parser.add_argument("overrides", nargs="*", help="config overrides (key=value), as `reinforge train` takes")
    args = parser.parse_args(argv)
    if args.warmup < 1 or args.steps < 1:
        parser.error("--warmup and --steps must be at least 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    load_start = load_average()
    overrides = ["log.progress=false", *args.overrides,
                 *([f"recipe={args.recipe}"] if args.recipe else []),
                 *([f"task.name={args.task}"] if args.task else []),
                 *([f"threads={args.threads}"] if args.threads else [])]
    cfg = build_config(overrides)
    task, spec = prepare(cfg)
    policy = load_policy(cfg, task)          # seeded, on cfg.threads threads
    engine = rollout_engine(cfg, policy, task)
    result: dict = {}
    if not args.rl_only:
        result["sft"] = profile_sft(cfg, policy, engine, task, args.warmup, args.steps)
    if not args.sft_only:
        result["rl"] = profile_rl(cfg, policy, engine, task, spec, args.warmup, args.steps)
    result.update({
        "steps": args.steps, "warmup": args.warmup, "overrides": args.overrides,
        "cpu": cpu_model(), "cpu_features": cpu_features(), "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cpu_kernels": uses_kernels(engine), "kernel_tuning": dict(TUNING),
        "env": {key: os.environ.get(key) for key in ENV},
        "load_avg_start": load_start, "load_avg_end": load_average(),
        "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
    })
    print(json.dumps(result))


if __name__ == "__main__":
    main()
