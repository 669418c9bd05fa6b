r"""Seconds per RL step of reinforge against TRL's GRPOTrainer, on the same problem in one process.

One RL step = one generation batch + one optimizer step. Both sides get:
- the built-in tiny Qwen2 (default `ModelConfig`, ~1 M parameters, fp32) with the same initial
  weights (TRL trains a deep copy) and the char tokenizer (a `PreTrainedTokenizerFast`);
- prompts of the built-in arithmetic task's train split, plain text (the char tokenizer has no
  chat template, so reinforge's `prompt.chat_template=auto` adds none either);
- 8 prompts x 8 samples, 16 new tokens, temperature 1.0, one forward/backward of all 64
  completions, AdamW (betas 0.9/0.99, no weight decay), lr 5e-5 constant, grad clip 1.0;
- the same shaped reward (`shaped_reward`): 1 for the exact answer, else 0.5 x the fraction of
  the gold answer's digits found in the completion. The task's exact-match reward gives a random
  model all-zero advantages; partial credit makes both sides do real update work.

The same loss. reinforge's `dr_grpo` recipe against TRL `loss_type="dr_grpo"`,
`scale_rewards="none"`, `epsilon=0.2`, `beta=0.0`:
  advantage  A_i = R_i - mean_g(R)                     (reinforge `dr_grpo`; TRL scale_rewards="none")
  loss       -sum_{i,t} m_it min(r A_i, clip(r, 0.8, 1.2) A_i) / (N * 16)
             (reinforge `ppo_clip` + `seq_mean_token_sum_norm` with max_length = max_new_tokens;
             TRL `dr_grpo` divides by batch rows x max_completion_length)
  KL         none on either side (recipe kl_coef 0; TRL beta 0 loads no reference model).
`grpo` would need overrides on both sides to agree (its recipe has a k3 KL of 0.04, and its std
epsilon is 1e-6 where TRL's is 1e-4); `dr_grpo` matches with no override at all.
Neither runs a forward for pi_old, since each batch gets exactly one optimizer step: TRL takes
pi.detach() from the update's own forward, reinforge the sampler's log-probs (`train.old_logprobs=auto`:
its native engine's are the learner's to float rounding); both compute the per-token entropy in the loss
forward (for metrics).
reinforge additionally runs each prompt once for its 8 completions in that forward
(`train.shared_prefix`), samples with its native engine (`rollout.engine`), and takes that forward from the
engine's own decoding and prefill (`train.reuse_activations`: the same layers at the same weights, equal to
float rounding; only the backward runs over them); `--engine hf --no-shared-prefix` measures it without any
of the three.

Method. Each framework runs its own real training loop (`reinforge.jobs.rl.run_rl`;
`GRPOTrainer.train`) in the main thread of a child process of its own, and the parent
alternates them: `--rounds` rounds of one reinforge child and one TRL child (the order flipped
every other round, `trl_common.alternate`), each running a warm-up step and then `--steps` timed
steps from the same initial weights. (Child processes,
not threads of one process: torch ops issued from a second Python thread ran ~1.8x slower here,
for either framework.) reinforge's child starts as `reinforge train` does (reinforge/cli.py imported
before torch: its OpenMP wait setting), TRL's in the caller's environment (`trl_common.side_command`;
the JSON's `openmp` gives both). A step's time is the wall time between consecutive step ends
(reinforge's `on_step`, TRL's `on_step_end`): generation, reward, advantage, pi_old where the
loop computes it, update and each loop's own bookkeeping. The figure per side is the median of
its rounds x steps timed steps.

Install and run (TRL lives in its own virtual environment, not the project's .venv):

    python -m venv .venv-bench
    .venv-bench/bin/pip install torch==2.13.0 -e . -r benchmarks/requirements.txt
    .venv-bench/bin/python benchmarks/vs_trl.py [--engine hf] [--no-shared-prefix] \
        [--steps 5] [--rounds 6] [--threads 2]

The last line of stdout is one JSON object: reinforge_s_per_step, trl_s_per_step, ratio
(reinforge / trl; below 1 means reinforge is faster), the settings and library versions.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from reinforge.config import Config, build_config
from reinforge.jobs.rl import run_rl
from reinforge.jobs.start import objective_spec, prepare, seed_everything
from reinforge.loops.loop import StepRecord
from reinforge.models import build_tiny_qwen2
from reinforge.models.tokenizer import build_char_tokenizer
from reinforge.rollout import build_engine
from reinforge.tasks.arithmetic import ArithmeticTask
from reinforge.verifiers.arithmetic import verify_integer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trl_common import alternate, openmp_env, quiet, trl_grpo_args, trl_loss, versions  # noqa: E402

PROMPTS_PER_STEP, GROUP_SIZE, MAX_NEW_TOKENS, TEMPERATURE, LR = 8, 8, 16, 1.0, 5e-5
RECIPE = "dr_grpo"
SIDES = ("reinforge", "trl")


def shaped_reward(answer: str, completion: str) -> float:
    """1.0 for the exact answer, else 0.5 x the fraction of the gold digits (as a multiset) that
    the completion contains: a random model gets partial credit often enough for groups to vary."""
    if verify_integer(completion, answer):
        return 1.0
    gold = re.sub(r"\D", "", answer)
    found = sum(min(gold.count(d), completion.count(d)) for d in set(gold))
    return 0.5 * found / max(1, len(gold))


class ShapedArithmeticTask(ArithmeticTask):
    """The arithmetic task with `shaped_reward`: how it reaches `run_rl`, which calls task.reward."""

    def reward(self, example, completion: str) -> float:
        return shaped_reward(example.answer, completion)


class StepClock:
    """Wall-clock time at each step end, from the start of the loop."""

    def __init__(self):
        self.ends = [time.perf_counter()]

    def tick(self) -> None:
        self.ends.append(time.perf_counter())

    def timed(self) -> list[float]:
        """Seconds of each step after the first (warm-up) one."""
        return [b - a for a, b in zip(self.ends[1:], self.ends[2:], strict=False)]


def reinforge_config(args: argparse.Namespace) -> Config:
    overrides = [
        f"recipe={RECIPE}", f"seed={args.seed}", f"threads={args.threads}", "log.progress=false",
        f"train.steps={1 + args.steps}", f"train.prompts_per_step={PROMPTS_PER_STEP}",
        f"train.shared_prefix={str(args.shared_prefix).lower()}",
        f"train.group_size={GROUP_SIZE}", "train.ppo_epochs=1", "train.mini_batches=1",
        f"train.micro_batch_size={PROMPTS_PER_STEP * GROUP_SIZE}", f"train.lr={LR}", "train.warmup_steps=0",
        f"rollout.max_new_tokens={MAX_NEW_TOKENS}", f"rollout.temperature={TEMPERATURE}",
    ]
    if args.engine is not None:
        overrides.append(f"rollout.engine={args.engine}")
    cfg = build_config(overrides)
    # The model must hold the longest train prompt plus the completion.
    task, _ = prepare(cfg)
    longest = max(len(e.prompt) for e in task.train_split(cfg.train.num_prompts)) + MAX_NEW_TOKENS
    if longest > cfg.model.max_positions:
        cfg = build_config([*overrides, f"model.max_positions={longest}"])
    return cfg


def trl_trainer(cfg: Config, model, dataset, clock: StepClock, rewards: list[dict], output_dir: str):
    """TRL's GRPOTrainer on the same problem. TRL is imported here, not at the top: the reinforge
    side runs (and is tested, tests/e2e/test_benchmarks.py) in the project's venv, which has no TRL."""
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    class TRLStepClock(TrainerCallback):
        """One tick per optimizer step (= one generation here)."""

        def on_step_end(self, args, state, control, **kwargs):
            clock.tick()

    def reward_fn(prompts, completions, completion_ids, answer, **kwargs) -> list[float]:
        values = [shaped_reward(a, c) for a, c in zip(answer, completions, strict=True)]
        rewards.append(batch_stats(values, [len(ids) for ids in completion_ids]))
        return values

    args = GRPOConfig(**trl_grpo_args(cfg, objective_spec(cfg), output_dir))
    return quiet(GRPOTrainer(model=model, reward_funcs=reward_fn, args=args, train_dataset=dataset,
                             processing_class=build_char_tokenizer(), callbacks=[TRLStepClock()]))


def batch_stats(rewards: list[float], lengths: list[float]) -> dict[str, float]:
    """Mean reward, fraction of groups with no reward variance (zero advantage), mean completion tokens."""
    groups = [rewards[i:i + GROUP_SIZE] for i in range(0, len(rewards), GROUP_SIZE)]
    return {"reward_mean": statistics.fmean(rewards),
            "zero_variance_groups": statistics.fmean(float(max(g) == min(g)) for g in groups),
            "response_length_mean": statistics.fmean(lengths)}


def mean_of(records: list[dict], key: str) -> float:
    return round(statistics.fmean(r[key] for r in records), 4)


def run_side(args: argparse.Namespace) -> dict:
    """One child: a warm-up step and `args.steps` timed steps of one framework, in this main thread."""
    cfg = reinforge_config(args)
    _, spec = prepare(cfg)
    task = ShapedArithmeticTask(**cfg.task.options)
    torch.set_num_threads(cfg.threads)
    seed_everything(cfg.seed)
    policy = build_tiny_qwen2(cfg.model, cfg.seed)       # the same initial weights on both sides
    clock, records = StepClock(), []
    if args.side == "reinforge":
        def on_step(record: StepRecord, _state) -> None:
            clock.tick()
            records.append(record.metrics)

        engine = build_engine(cfg.rollout, policy, chat_template=cfg.prompt.chat_template)
        run_rl(cfg, policy, engine, task, spec, on_step)
        extra = {key: statistics.median(r[key] for r in records[1:]) for key in ("generation_seconds", "step_seconds")}
    else:
        from datasets import Dataset

        dataset = Dataset.from_list([{"prompt": e.prompt, "answer": e.answer}
                                     for e in task.train_split(cfg.train.num_prompts)])
        with tempfile.TemporaryDirectory() as output_dir:
            trl_trainer(cfg, policy.model, dataset, clock, records, output_dir).train()
        extra = {}
    return {"times": clock.timed(), "threads": torch.get_num_threads(), "engine": cfg.rollout.engine,
            "openmp": openmp_env(),
            "model_params": sum(p.numel() for p in policy.model.parameters()), **extra,
            **{key: mean_of(records, key) for key in ("reward_mean", "zero_variance_groups", "response_length_mean")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", default=None, help="reinforge rollout.engine (default: the configured default)")
    parser.add_argument("--no-shared-prefix", dest="shared_prefix", action="store_false",
                        help="reinforge's plain learner forward (train.shared_prefix=false)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per child (K)")
    parser.add_argument("--rounds", type=int, default=6, help="rounds of one reinforge and one TRL child (R)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)   # set for the child processes
    args = parser.parse_args()
    if args.side:
        print(json.dumps(run_side(args)))
        return

    passed = list(sys.argv[1:])
    runs = alternate(__file__, passed, SIDES, args.rounds)
    times = {side: [t for run in runs[side] for t in run["times"]] for side in SIDES}
    reinforge_s, trl_s = statistics.median(times["reinforge"]), statistics.median(times["trl"])
    first = runs["reinforge"][0]
    result = {
        "reinforge_s_per_step": round(reinforge_s, 4),
        "trl_s_per_step": round(trl_s, 4),
        "ratio": round(reinforge_s / trl_s, 4),
        "engine": first["engine"], "shared_prefix": args.shared_prefix, "steps": args.steps, "rounds": args.rounds,
        "threads": {side: sorted({run["threads"] for run in runs[side]}) for side in SIDES},
        "openmp": {side: runs[side][0]["openmp"] for side in SIDES},
        "recipe": RECIPE, "trl_loss": trl_loss(objective_spec(reinforge_config(args))),
        "prompts_per_step": PROMPTS_PER_STEP, "group_size": GROUP_SIZE, "max_new_tokens": MAX_NEW_TOKENS,
        "temperature": TEMPERATURE, "dtype": "float32", "model_params": first["model_params"],
        "reinforge_steps_s": [round(t, 4) for t in times["reinforge"]],
        "trl_steps_s": [round(t, 4) for t in times["trl"]],
        # reinforge's own timers (its step_seconds leaves out the loop's between-step bookkeeping)
        **{f"reinforge_{key}_median": round(statistics.median(run[key] for run in runs["reinforge"]), 4)
           for key in ("step_seconds", "generation_seconds")},
        **{f"{side}_{key}": round(statistics.fmean(run[key] for run in runs[side]), 4)
           for side in SIDES for key in ("reward_mean", "zero_variance_groups", "response_length_mean")},
        **versions(),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
