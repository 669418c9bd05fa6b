r"""Wall time to a better model: reinforge's default RL recipe against TRL's GRPOTrainer, from the same start.

The start model is the built-in job's cold-start SFT model (`reinforge train train.steps=0`: SFT on the
arithmetic task's noisy teacher traces), saved as a Hugging Face folder; `--start-model DIR` reuses
DIR/model when it exists, else the parent trains it there first (untimed). Both sides load that folder
and train on the built-in 3-digit arithmetic task until the held-out pass@1 reaches
`threshold = start pass@1 + --gain` (0.15).

What each side runs:
- reinforge: the RL stage of `reinforge train` with its defaults (recipe grpo), as `run_rl` runs it in
  the pipeline, with model.path=DIR/model and sft.enabled=false.
- TRL: GRPOTrainer with every setting mirrored from that resolved config where TRL has the knob
  (`trl_common.trl_grpo_args`, `trl_loss`):
    train.prompts_per_step x group_size (32 x 8)   generation batch of 256 completions,
                                                  num_generations = group_size = 8
    train.mini_batches = 2                        steps_per_generation = 2, per_device_train_batch_size
                                                  = 128 completions, gradient_accumulation_steps = 1
                                                  (two optimizer steps per generation, the second on
                                                  samples one update stale: TRL computes pi_old with
                                                  an extra forward after generation, reinforge takes
                                                  its engine's log-probs, the learner's to rounding:
                                                  train.old_logprobs=auto; the first mini-batch's
                                                  forward is its engine's decoding and prefill
                                                  too: train.reuse_activations)
    train.ppo_epochs = 1                          num_iterations = 1
    train.lr 5e-5, warmup 0, constant             learning_rate, lr_scheduler_type=constant
    AdamW betas (0.9, 0.99), weight_decay 0       optim=adamw_torch, adam_beta1/2, weight_decay
    train.grad_clip 1.0                           max_grad_norm
    rollout.max_new_tokens 8, temperature 1.0     max_completion_length, temperature (top_p 1, no top_k)
    advantage grpo: (R - mean_g) / (std_g + eps)  scale_rewards="group" (eps 1e-4 in TRL, 1e-6 in
                                                  reinforge; not a TRL knob)
    ppo_clip, eps_low = eps_high = 0.2            epsilon = epsilon_high = 0.2
    aggregation seq_mean_token_mean               loss_type="grpo" (mean over rows of the token mean)
    k3 KL in the loss, coef 0.04, fixed reference beta=0.04 (TRL's KL is k3 in the loss; its reference
                                                  is loaded from the same folder)
    reward: the task's verifier (1 exact, else 0) a reward function calling the same task.reward
    prompts: the task's train split (1000)        the same prompts as a dataset; each side shuffles
                                                  them with its own RNG (TRL's sampler, reinforge's pool)
  Where TRL cannot match: the std epsilon above; TRL samples with transformers' `generate`, reinforge
  with its own engine (rollout.engine=native), the same distribution; reinforge runs each prompt once
  for its 8 completions in the learner forward (train.shared_prefix) where TRL runs all 256 rows.

Evaluation, the same for both: every `--eval-every` RL steps (one step = one generation batch; for TRL
every eval_every x steps_per_generation optimizer steps) the side's current weights are copied into a
separate copy of the model and scored by reinforge's evaluator (reinforge/eval/evaluate.py) on the
task's held-out split: eval.num_prompts (200) prompts x eval.num_samples (8) samples at the rollout
temperature, under eval.seed (its own RNG: the training's draws are untouched); pass@1 is the sampled
one. The clock is paused while it runs: a side's seconds are the wall time of its training loop
(`run_rl`; `GRPOTrainer.train`) from its call to the end of the first step whose evaluation reaches
the threshold, evaluation time excluded. Building the trainer (model and reference loading) is outside
both clocks. Each side runs in a child process of its own, one at a time, with `--threads` torch
threads; the parent alternates them in `--rounds` rounds (default 3; 1 with --only), the order flipped
every other round (reinforge, TRL, TRL, reinforge, ...: trl_common.alternate), so that load which comes
and goes on the machine falls on both sides alike instead of on whichever ran second. Each round's
ratio pairs the two runs next to each other in time (`ratio_each`). reinforge's child starts as `reinforge
train` does (its OpenMP wait setting), TRL's in the caller's environment (`trl_common.side_command`, `openmp`).

    .venv-bench/bin/python benchmarks/time_to_accuracy.py [--start-model DIR] [--seed 0] [--threads 2] \
        [--eval-every 1] [--gain 0.15] [--max-seconds 900] [--max-steps 400] [--rounds 3] [key=value ...]

key=value: reinforge config overrides for both sides (e.g. train.prompts_per_step=16), applied before
the mirroring. The last line of stdout is one JSON object: reinforge_seconds, trl_seconds, ratio
(reinforge / trl), threshold, start_pass1 and both curves ([seconds, step, pass@1] per evaluation);
*_seconds_interpolated and ratio_interpolated place each crossing on the straight line between the
evaluations around it. The headline figures are medians over rounds; per round: *_seconds_each,
ratio_each and ratio_interpolated_each (reinforge / TRL of round r, in the order the rounds ran) and
both sides' curves (*_curves).
A side that does not reach the threshold within --max-seconds of training (or --max-steps) has
seconds null, and the ratio is null.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from reinforge.config import Config, build_config
from reinforge.eval.evaluate import evaluate
from reinforge.jobs.rl import run_rl
from reinforge.jobs.start import objective_spec, prepare, seed_everything
from reinforge.jobs.train import run
from reinforge.models import load_policy
from reinforge.rollout import SamplingParams, build_engine

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trl_common import alternate, openmp_env, quiet, trl_grpo_args, trl_loss, versions  # noqa: E402

SIDES = ("reinforge", "trl")


class Clock:
    """Wall time with pauses: `seconds()` leaves out the time between each `pause()` and `resume()`."""

    def __init__(self):
        self.paused_total, self.paused_at, self.t0 = 0.0, None, time.perf_counter()

    def pause(self) -> float:
        self.paused_at = time.perf_counter()
        return self.seconds()

    def resume(self) -> None:
        self.paused_total += time.perf_counter() - self.paused_at
        self.paused_at = None

    def seconds(self) -> float:
        now = self.paused_at if self.paused_at is not None else time.perf_counter()
        return now - self.t0 - self.paused_total


class Evaluator:
    """reinforge's held-out evaluation of given weights, in a model of its own (the sides' training
    models and engines are never touched)."""

    def __init__(self, cfg: Config, task):
        self.cfg, self.task = cfg, task
        self.policy = load_policy(cfg.model, cfg.seed)
        self.engine = build_engine(cfg.rollout, self.policy, chat_template=cfg.prompt.chat_template)
        self.examples = task.eval_split(cfg.eval.num_prompts)

    def __call__(self, state_dict: dict) -> dict:
        self.policy.model.load_state_dict(state_dict)
        result = evaluate(self.engine, self.task, self.examples, num_samples=self.cfg.eval.num_samples,
                          sampling=SamplingParams.from_config(self.cfg.rollout), seed=self.cfg.eval.seed)
        return {"pass@1": result.pass_at_1, "greedy_accuracy": result.greedy_accuracy}


class Curve:
    """The evaluations of one side: [seconds, step, pass@1] each, and whether to stop."""

    def __init__(self, evaluator: Evaluator, threshold: float, max_seconds: float):
        self.evaluator, self.threshold, self.max_seconds = evaluator, threshold, max_seconds
        self.points: list[list] = []
        self.reached_at: float | None = None
        self.clock = Clock()

    def evaluate(self, step: int, state_dict: dict) -> bool:
        """Score the weights with the clock paused; True when training should stop (threshold reached,
        or past --max-seconds)."""
        seconds = self.clock.pause()
        pass1 = self.evaluator(state_dict)["pass@1"]
        self.points.append([round(seconds, 3), step, round(pass1, 4)])
        print(json.dumps({"seconds": round(seconds, 2), "step": step, "pass@1": pass1}), file=sys.stderr, flush=True)
        if pass1 >= self.threshold:
            self.reached_at = seconds
        self.clock.resume()
        return self.reached_at is not None or seconds >= self.max_seconds

    def over_time(self) -> bool:
        return self.clock.seconds() >= self.max_seconds


def crossing(curve: list[list], threshold: float) -> float | None:
    """Seconds at which the curve's straight line between evaluations first reaches the threshold: the
    first evaluation at or past it, moved back towards the one before in proportion; None if none did.
    A step of a coarse evaluation grid (--eval-every 5) is ~20% of the time to threshold here, and which
    evaluation first crosses can hang on 0.001 of pass@1: the interpolation makes the ratio less coarse."""
    if curve and curve[0][2] >= threshold:
        return curve[0][0]
    for (t0, _, p0), (t1, _, p1) in zip(curve, curve[1:], strict=False):
        if p1 >= threshold:
            return t0 + (threshold - p0) / (p1 - p0) * (t1 - t0)
    return None


class Stop(Exception):
    """Ends reinforge's loop from its on_step."""


def side_config(args: argparse.Namespace, side: str | None = None) -> Config:
    """The RL stage's config of `reinforge train` from the start model; --reinforge settings only for that side."""
    return build_config([
        f"model.path={Path(args.start_model) / 'model'}", "sft.enabled=false", f"seed={args.seed}",
        f"threads={args.threads}", "log.progress=false", f"train.steps={args.max_steps}", *args.overrides,
        *(args.reinforge if side == "reinforge" else []),
    ])


def run_reinforge(cfg: Config, task, spec, curve: Curve, every: int) -> None:
    policy = load_policy(cfg.model, cfg.seed)
    engine = build_engine(cfg.rollout, policy, chat_template=cfg.prompt.chat_template)

    def on_step(record, state) -> None:
        if record.step % every == 0 and curve.evaluate(record.step, policy.model.state_dict()):
            raise Stop
        if curve.over_time():
            raise Stop

    curve.clock = Clock()
    try:
        run_rl(cfg, policy, engine, task, spec, on_step)
    except Stop:
        pass


def run_trl(cfg: Config, task, spec, curve: Curve, every: int, output_dir: str) -> None:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    examples = task.train_split(cfg.train.num_prompts)
    per_step = cfg.train.mini_batches * cfg.train.ppo_epochs       # TRL optimizer steps per RL step

    def verifier(prompts, completions, index, **kwargs) -> list[float]:
        return [float(task.reward(examples[i], c)) for i, c in zip(index, completions, strict=True)]

    class Evaluate(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            step, done = divmod(state.global_step, per_step)
            if (not done and step % every == 0 and curve.evaluate(step, model.state_dict())) or curve.over_time():
                control.should_training_stop = True

    policy = load_policy(cfg.model, cfg.seed)
    trainer = quiet(GRPOTrainer(
        model=policy.model, reward_funcs=verifier, processing_class=policy.tokenizer,
        args=GRPOConfig(**trl_grpo_args(cfg, spec, output_dir)), callbacks=[Evaluate()],
        train_dataset=Dataset.from_list([{"prompt": e.prompt, "index": i} for i, e in enumerate(examples)]),
    ))
    curve.clock = Clock()
    trainer.train()


def run_side(args: argparse.Namespace) -> dict:
    cfg = side_config(args, args.side)
    task, spec = prepare(cfg)
    torch.set_num_threads(cfg.threads)
    seed_everything(cfg.seed)
    curve = Curve(Evaluator(cfg, task), args.threshold, args.max_seconds)
    if args.side == "reinforge":
        run_reinforge(cfg, task, spec, curve, args.eval_every)
    else:
        with tempfile.TemporaryDirectory() as output_dir:
            run_trl(cfg, task, spec, curve, args.eval_every, output_dir)
    return {"seconds": curve.reached_at, "curve": curve.points, "threads": torch.get_num_threads(),
            "engine": cfg.rollout.engine, "openmp": openmp_env()}


def start_model(args: argparse.Namespace) -> float:
    """The start model's held-out pass@1; the model is trained into --start-model first if it is not there."""
    if not (Path(args.start_model) / "model" / "config.json").is_file():
        run(build_config([f"seed={args.seed}", f"threads={args.threads}", "log.progress=false", "train.steps=0",
                          f"output_dir={args.start_model}", *args.overrides]), overwrite=True)
    cfg = side_config(args)
    task, _ = prepare(cfg)
    torch.set_num_threads(cfg.threads)
    evaluator = Evaluator(cfg, task)
    return evaluator(evaluator.policy.model.state_dict())["pass@1"]


def round_ratios(runs: dict[str, list[dict]], threshold: float) -> dict[str, list[float | None]]:
    """reinforge / TRL seconds of each round (a run that missed the threshold: None), reached and
    interpolated (`crossing`); empty lists with one side."""
    pairs = list(zip(runs.get("reinforge", []), runs.get("trl", []), strict=False))

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 4) if a and b else None

    return {"ratio_each": [ratio(r["seconds"], t["seconds"]) for r, t in pairs],
            "ratio_interpolated_each": [ratio(crossing(r["curve"], threshold), crossing(t["curve"], threshold))
                                        for r, t in pairs]}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--start-model", default=None,
                        help="folder of the SFT-only run (its model/); default: a folder per seed in "
                             "$REINFORGE_CACHE (~/.cache/reinforge)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads of each side")
    parser.add_argument("--eval-every", type=int, default=1,
                        help="RL steps between evaluations (each ~0.3 s here, outside both clocks)")
    parser.add_argument("--gain", type=float, default=0.15, help="threshold = start pass@1 + gain")
    parser.add_argument("--max-seconds", type=float, default=900.0, help="training seconds per side before giving up")
    parser.add_argument("--max-steps", type=int, default=400, help="RL steps per side before giving up")
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds of one reinforge and one TRL child, alternating (default 3; 1 with --only)")
    parser.add_argument("--only", choices=SIDES, help="run one side (the other's figures are null)")
    parser.add_argument("--reinforge", action="append", default=[], metavar="KEY=VALUE",
                        help="a reinforge setting TRL has no knob for, on the reinforge side only (not the default "
                             "recipe then: the JSON lists them)")
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)          # the child processes
    parser.add_argument("--threshold", type=float, help=argparse.SUPPRESS)        # set by the parent
    parser.add_argument("overrides", nargs="*", help="reinforge config overrides (key=value) for both sides")
    args = parser.parse_args(argv)
    if args.start_model is None:
        # The user's own cache, not the shared temp dir: a folder another user planted at a predictable temp
        # path would be loaded as the start model (and written through, as this user).
        cache = Path(os.environ.get("REINFORGE_CACHE", Path.home() / ".cache" / "reinforge"))
        args.start_model = str(cache / f"tta-start-seed{args.seed}")
    if args.rounds is None:      # one side alone has nothing to alternate with
        args.rounds = 1 if args.only else 3
    return args


def main() -> None:
    args = parse()
    if args.side:
        print(json.dumps(run_side(args)))
        return
    start = start_model(args)
    threshold = round(start + args.gain, 4)
    sides = (args.only,) if args.only else SIDES
    argv = ["--start-model", args.start_model, "--threshold", str(threshold), "--seed", str(args.seed),
            "--threads", str(args.threads), "--eval-every", str(args.eval_every), "--max-seconds",
            str(args.max_seconds), "--max-steps", str(args.max_steps),
            *(f"--reinforge={setting}" for setting in args.reinforge), *args.overrides]
    runs = alternate(__file__, argv, sides, args.rounds)
    for run_ in (r for side in sides for r in runs[side]):
        run_["curve"].insert(0, [0.0, 0, round(start, 4)])

    def seconds(side: str) -> float | None:
        reached = [r["seconds"] for r in runs.get(side, [])]
        return round(statistics.median(reached), 3) if reached and None not in reached else None

    reinforge_s, trl_s = seconds("reinforge"), seconds("trl")

    def interpolated(side: str) -> float | None:
        times = [crossing(r["curve"], threshold) for r in runs.get(side, [])]
        return round(statistics.median(times), 3) if times and None not in times else None

    reinforge_i, trl_i = interpolated("reinforge"), interpolated("trl")
    each = round_ratios(runs, threshold)
    cfg = side_config(args)
    result = {
        "reinforge_seconds": reinforge_s, "trl_seconds": trl_s,
        "ratio": round(reinforge_s / trl_s, 4) if reinforge_s and trl_s else None,
        "threshold": threshold, "start_pass1": round(start, 4),
        # the same, the crossing interpolated between evaluations (`crossing`)
        "reinforge_seconds_interpolated": reinforge_i, "trl_seconds_interpolated": trl_i,
        "ratio_interpolated": round(reinforge_i / trl_i, 4) if reinforge_i and trl_i else None,
        # [seconds, step, pass@1] at each evaluation of the first round; every round's under *_curves
        "reinforge_curve": runs["reinforge"][0]["curve"] if "reinforge" in runs else None,
        "trl_curve": runs["trl"][0]["curve"] if "trl" in runs else None,
        "reinforge_curves": [r["curve"] for r in runs.get("reinforge", [])],
        "trl_curves": [r["curve"] for r in runs.get("trl", [])],
        "reinforge_seconds_each": [r["seconds"] for r in runs.get("reinforge", [])],
        "trl_seconds_each": [r["seconds"] for r in runs.get("trl", [])],
        **each,
        "seed": args.seed, "rounds": args.rounds, "eval_every": args.eval_every, "threads": args.threads,
        "openmp": {side: runs[side][0]["openmp"] for side in sides},
        "recipe": cfg.recipe, "engine": cfg.rollout.engine,
        "overrides": args.overrides, "reinforge_only": args.reinforge,
        "prompts_per_step": cfg.train.prompts_per_step, "group_size": cfg.train.group_size,
        "mini_batches": cfg.train.mini_batches, "max_new_tokens": cfg.rollout.max_new_tokens, "lr": cfg.train.lr,
        "trl_loss": trl_loss(objective_spec(cfg)),
        "eval": {"num_prompts": cfg.eval.num_prompts, "num_samples": cfg.eval.num_samples, "seed": cfg.eval.seed},
    }
    if "trl" in sides:
        result.update(versions())
    print(json.dumps(result))


if __name__ == "__main__":
    main()
