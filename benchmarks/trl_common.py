"""What the benchmarks against TRL share: reinforge's settings as TRL `GRPOConfig` arguments, and the
parent that runs each side in a child process of its own.

TRL is imported inside the functions that need it: the reinforge side of every benchmark runs (and is
tested, tests/e2e/test_benchmarks.py) in the project's venv, which has no TRL.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys

import torch
import transformers

from reinforge.config import Config
from reinforge.objectives import ObjectiveSpec

# reinforge's reduction -> TRL's loss_type: the same normalisation of the per-token terms.
#   seq_mean_token_mean      mean over rows of (sum_t m_t l_t / sum_t m_t)    TRL "grpo"
#   seq_mean_token_sum_norm  sum_{i,t} m_it l_it / (rows x max_new_tokens)   TRL "dr_grpo"
TRL_LOSS_TYPES = {"seq_mean_token_mean": "grpo", "seq_mean_token_sum_norm": "dr_grpo"}
# reinforge's advantage -> TRL's scale_rewards: (R - mean_g) / (std_g + eps) or R - mean_g, std_g with
# Bessel's correction on both sides; eps is 1e-6 in reinforge's `grpo`, 1e-4 in TRL (not a knob).
TRL_SCALE_REWARDS = {"grpo": "group", "dr_grpo": "none"}


def trl_loss(spec: ObjectiveSpec) -> dict:
    """The GRPOConfig loss arguments of a reinforge objective, or ValueError naming what TRL lacks.
    TRL's KL (beta > 0) is the k3 estimator added to each token's loss, against a fixed reference."""
    eps_low, eps_high = spec.policy_params["eps_low"], spec.policy_params["eps_high"]
    unmatched = [
        what for what, ok in (
            (f"advantage {spec.advantage}", spec.advantage in TRL_SCALE_REWARDS and not spec.advantage_transforms),
            (f"policy loss {spec.policy_loss}", spec.policy_loss == "ppo_clip" and spec.correction is None),
            (f"aggregation {spec.aggregation}", spec.aggregation in TRL_LOSS_TYPES),
            (f"kl {spec.kl_estimator} {spec.kl_placement} {spec.reference}", spec.kl_coef == 0 or (
                spec.kl_estimator == "k3" and spec.kl_placement == "in_loss" and spec.reference == "fixed")),
            ("entropy / nll / value terms", spec.entropy_coef == 0 and spec.nll_coef == 0 and spec.value is None),
        ) if not ok
    ]
    if unmatched:
        raise ValueError(f"TRL's GRPOTrainer has no match for reinforge's {', '.join(unmatched)}")
    return {"loss_type": TRL_LOSS_TYPES[spec.aggregation], "scale_rewards": TRL_SCALE_REWARDS[spec.advantage],
            "epsilon": eps_low, "epsilon_high": eps_high, "beta": spec.kl_coef}


def trl_grpo_args(cfg: Config, spec: ObjectiveSpec, output_dir: str, **extra) -> dict:
    """GRPOConfig keyword arguments with reinforge's settings where TRL has the knob.

    One reinforge step (one generation of prompts_per_step x group_size completions) is
    steps_per_generation = train.mini_batches TRL optimizer steps of per_device_train_batch_size =
    completions / mini_batches rows each, gradient_accumulation_steps=1; train.ppo_epochs is
    num_iterations. AdamW betas 0.9/0.99 (reinforge's learner/optim.py), constant lr after
    train.warmup_steps; grad clip, weight decay, temperature, max_new_tokens as configured.
    """
    tc, rollout = cfg.train, cfg.rollout
    completions = tc.prompts_per_step * tc.group_size
    if completions % tc.mini_batches or rollout.top_k or rollout.top_p != 1.0 or rollout.stop:
        raise ValueError("mirrored for mini_batches dividing the batch and plain temperature sampling only")
    return dict(
        output_dir=output_dir, seed=cfg.seed, use_cpu=True, bf16=False, gradient_checkpointing=False,
        max_steps=tc.steps * tc.mini_batches * tc.ppo_epochs,
        per_device_train_batch_size=completions // tc.mini_batches, gradient_accumulation_steps=1,
        steps_per_generation=tc.mini_batches, num_generations=tc.group_size, num_iterations=tc.ppo_epochs,
        max_completion_length=rollout.max_new_tokens, temperature=rollout.temperature,
        learning_rate=tc.lr, lr_scheduler_type="constant_with_warmup" if tc.warmup_steps else "constant",
        warmup_steps=tc.warmup_steps * tc.mini_batches, optim="adamw_torch", adam_beta1=0.9, adam_beta2=0.99,
        weight_decay=tc.weight_decay, max_grad_norm=tc.grad_clip,
        report_to="none", save_strategy="no", logging_steps=10**9, disable_tqdm=True, dataloader_num_workers=0,
        **trl_loss(spec), **extra,
    )


def quiet(trainer):
    """The trainer without PrinterCallback, which would print the end-of-training log line to stdout
    (the last line of a child's stdout is its JSON)."""
    from transformers import PrinterCallback

    trainer.remove_callback(PrinterCallback)
    return trainer


def alternate(script: str, argv: list[str], sides: tuple[str, ...], rounds: int) -> dict[str, list[dict]]:
    """`rounds` rounds of one child process per side, in turn: `script argv --side SIDE`, each child's
    last stdout line its JSON; their stderr (progress, warnings, a traceback) goes to this process's.
    Every other round runs the sides in reverse order (A B, B A, A B, ...), so that load rising or
    falling steadily over the run does not always fall on the side that runs second. Each side's list
    is in the order its runs happened (runs[side][r]: round r).
    Child processes, not threads of one process: torch ops issued from a second Python thread ran
    ~1.8x slower here, for either framework."""
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    for round_ in range(rounds):
        for side in sides if round_ % 2 == 0 else sides[::-1]:
            child = subprocess.run(side_command(script, [*argv, "--side", side], side), stdout=subprocess.PIPE,
                                   text=True)
            if child.returncode != 0:
                raise RuntimeError(f"the {side} child failed (exit {child.returncode}; its stderr is above)")
            runs[side].append(json.loads(child.stdout.strip().splitlines()[-1]))
    return runs


# reinforge's side starts as `reinforge train` does: reinforge/cli.py is imported before torch loads, so the
# child has the OpenMP wait setting the CLI gives every run (GOMP_SPINCOUNT by the load at its start unless the user
# set one; see BENCHMARKS.md, "OpenMP's wait policy"). TRL's side runs in this process's environment, as TRL's
# users run it.
CLI_LAUNCHER = ("import runpy, sys, reinforge.cli; sys.argv = sys.argv[1:]; "
                "runpy.run_path(sys.argv[0], run_name='__main__')")
OPENMP_KEYS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


def side_command(script: str, argv: list[str], side: str) -> list[str]:
    """The command line of `side`'s child: `script argv`, for reinforge through the CLI's process setup."""
    if side == "reinforge":
        return [sys.executable, "-c", CLI_LAUNCHER, script, *argv]
    return [sys.executable, script, *argv]


def openmp_env() -> dict[str, str | None]:
    """This process's OpenMP wait settings, for a child's JSON."""
    return {key: os.environ.get(key) for key in OPENMP_KEYS}


def versions() -> dict[str, str]:
    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "trl": importlib.metadata.version("trl")}
