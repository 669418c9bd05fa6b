"""The benchmark scripts still run against the current code: each in a small configuration, in a
subprocess as its README command runs it, with the figures of its JSON line checked.

The numbers in BENCHMARKS.md come from these scripts; a script that an API change broke would
otherwise go unnoticed until the next time someone measures (the RL loop's `on_step` gained its
state argument and vs_trl.py failed for a whole session). TRL is not installed here, so vs_trl.py
runs its reinforge side alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from repo_paths import REPO

BENCHMARKS = REPO / "benchmarks"


def run_script(name: str, *args: str) -> dict:
    done = subprocess.run([sys.executable, str(BENCHMARKS / name), *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_vs_trl_reinforge_side_runs_the_benchmarked_problem():
    out = run_script("vs_trl.py", "--side", "reinforge", "--steps", "2", "--threads", "1")
    assert len(out["times"]) == 2 and all(t > 0 for t in out["times"])
    assert out["engine"] == "native" and out["threads"] == 1
    # The built-in Qwen2: embedding 89 x 128 (tied head), per layer q/k/v 128 x 384 + 384 biases,
    # o 128 x 128, gate/up/down 3 x 128 x 512, two norms of 128; a final norm of 128.
    assert out["model_params"] == 89 * 128 + 4 * (128 * 384 + 384 + 128 * 128 + 3 * 128 * 512 + 2 * 128) + 128
    # 16 new tokens at most; the shaped reward lies in [0, 1].
    assert 0 < out["response_length_mean"] <= 16
    assert 0.0 <= out["reward_mean"] <= 1.0
    assert 0 < out["generation_seconds"] < out["step_seconds"]


@pytest.mark.slow
def test_rollout_throughput_compares_like_with_like():
    out = run_script("rollout_throughput.py", "--rounds", "1", "--threads", "1")
    for name in ("fixed_length", "long_tail"):
        scenario = out[name]
        assert scenario["ratio"] == round(scenario["native_tokens_per_s"] / scenario["hf_tokens_per_s"], 3)
        # Both engines sample the same distribution: 256 samples' mean lengths agree to a few tokens.
        lengths = scenario["mean_length"]
        assert abs(lengths["hf"] - lengths["native"]) < 0.15 * lengths["hf"]
        assert max(scenario["max_length"].values()) <= scenario["max_new_tokens"]
    assert out["long_tail"]["mean_length"]["native"] < 0.9 * out["long_tail"]["max_new_tokens"]


@pytest.mark.slow
def test_async_throughput_trains_both_modes_on_the_same_samples():
    out = run_script("async_throughput.py", "sft.steps=0", "train.steps=2", "train.prompts_per_step=4",
                     "eval.num_prompts=8", "eval.num_samples=2", "threads=1")
    assert out["samples"] == 2 * 4 * 8 and out["max_staleness"] == 2
    assert abs(out["ratio"] - out["async_samples_per_s"] / out["sync_samples_per_s"]) < 2e-3
    assert all(0.0 <= out[k] <= 1.0 for k in ("start_pass@1", "sync_pass@1", "async_pass@1"))


@pytest.mark.slow
def test_dpo_heldout_runs():
    out = run_script(
        "dpo_heldout.py", "sft.steps=0", "train.steps=2", "eval.num_prompts=8", "eval.num_samples=2", "threads=1"
    )
    assert out["dpo_seconds"] > 0
    assert all(0.0 <= out[when]["pass@1"] <= 1.0 for when in ("start", "final"))


@pytest.mark.slow
def test_logprob_memory_agrees_with_the_plain_computation():
    out = run_script("logprob_memory.py", "--tokens", "64", "--vocab", "1000", "--hidden", "32")
    assert out["max_abs_diff"] < 1e-5
    assert out["chunked_peak_mb"] > 0 and out["naive_peak_mb"] > 0


@pytest.mark.slow
def test_learner_padding_buckets_give_the_one_pass_numbers_on_fewer_positions():
    out = run_script("learner_padding.py", "--repeats", "1", "--threads", "1")
    assert out["max_abs_diff"] < 1e-5
    assert out["passes"] > 1 and out["bucketed_positions"] < out["one_pass_positions"] / 2
    assert out["tokens"] - out["rows"] <= out["bucketed_positions"]   # a row of n tokens needs n - 1 positions


@pytest.mark.slow
def test_train_throughput_counts_the_batch_and_its_flops():
    out = run_script("train_throughput.py", "--prompts", "4", "--max-new-tokens", "32", "--prompt-length", "8",
                     "--repeats", "1", "--threads", "1")
    assert out["parameters"] == 1062656 and out["device"] == "cpu"
    assert out["mfu"] is None and out["learner_tflops"] > 0 and out["rollout_tokens_per_s"] > 0
    # 4 prompts x 8 samples, each row its 8 prompt tokens and its completion.
    assert out["learner_batch_tokens"] == 4 * 8 * 8 + out["completion_tokens"]


def test_train_throughput_model_flops_by_hand():
    import importlib.util

    import torch
    from transformers import Qwen2Config

    from reinforge.learner import LearnerBatch, build_sequences

    spec = importlib.util.spec_from_file_location("train_throughput", BENCHMARKS / "train_throughput.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = Qwen2Config(hidden_size=4, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         intermediate_size=8, vocab_size=10)
    seq = build_sequences([[5, 6]], torch.tensor([[7, 8, 9]]), torch.ones(1, 3), 0, group_ids=torch.tensor([0]))
    batch = LearnerBatch(sequences=seq, advantages=torch.zeros(1), old_logprobs=None,
                         sampler_logprobs=torch.zeros(1, 3), group_ids=torch.tensor([0]))
    # Matmul parameters: q/k/v 4 x (2 x 2 + 2 x 1 x 2) = 32, o 16, MLP 3 x 4 x 8 = 96, head 10 x 4 = 40.
    # Through the layers the prompt's 2 positions and the completion's first 2 (its last predicts nothing); the
    # head on the 3 positions predicting a completion token. Keys attended: prompt 1 + 2, completion (2 + 1) + (2 + 2).
    assert module.model_flops(config, batch, group_size=1) == 6 * (144 * 4 + 40 * 3) + 12 * 1 * 2 * 2 * 10


def test_verifier_latency_times_correct_programs_and_a_bounded_bomb():
    out = run_script("verifier_latency.py", "--runs", "4")
    # The script asserts every timed program passed; the bomb scores 0 whatever thread judged it.
    assert out["runs"] == 4 and out["math_bomb_score"] == 0.0 and out["math_bomb_timeout_s"] == 1.0
    assert out["sandbox_median_s"] > 0 and out["sandbox_no_namespaces_median_s"] > 0
    assert out["sandbox_without_kernel_layers_median_s"] > 0 and len(out["load_1min_start_end"]) == 2


def test_multiturn_continuation_samples_the_same_tokens_both_ways():
    out = run_script("multiturn_continuation.py", "--rounds", "1", "--rows", "4", "--turns", "3", "--prompt-tokens",
                     "16", "--turn-tokens", "8", "--observation-tokens", "8", "--hidden", "128", "--threads", "1")
    # Continuing from stored keys/values and prefilling the whole sequence again draw the same tokens.
    assert out["same_tokens"] is True
    assert out["continuation_tokens_per_s"] > 0 and out["reprefill_tokens_per_s"] > 0
    assert abs(out["ratio"] - out["continuation_tokens_per_s"] / out["reprefill_tokens_per_s"]) < 2e-3
    # 4 rows x 3 turns, each turn 1 to 8 sampled tokens; the longest row is at most its 16 prompt
    # tokens, 2 observations of 8 and 3 full turns.
    assert 4 * 3 <= out["model_tokens"] <= 4 * 3 * 8
    assert 16 + 2 * 8 + 3 <= out["final_length"] <= 16 + 2 * 8 + 3 * 8


@pytest.mark.slow
def test_quantized_rollouts_measure_the_int8_gap(tmp_path):
    out = run_script("quantized_rollouts.py", "--steps", "2", "--sft-steps", "5", "--variants", "fp32,int8_head+tis",
                     "--out", str(tmp_path / "runs"), "--plot", str(tmp_path / "plot.png"),
                     "eval.num_prompts=8", "eval.num_samples=2", "train.prompts_per_step=4")
    # The fp32 sampler is the learner up to rounding; the int8 one is measurably off, and TIS weighs it.
    assert out["fp32"]["mean"]["mismatch_kl"] < 1e-9
    assert out["int8_head+tis"]["mean"]["mismatch_kl"] > 1e-7
    assert out["int8_head+tis"]["mean"]["is_weight_max"] > 1.0
    assert (tmp_path / "plot.png").stat().st_size > 0


@pytest.mark.slow
def test_time_to_accuracy_reinforge_side_clocks_training_and_not_evaluation(tmp_path):
    # A 2-step SFT start model; a threshold of start - 1 is reached at the first evaluation, whose
    # clock reading is the side's seconds; 4 prompts x 8 samples a step, 8 x 2 held-out samples.
    out = run_script("time_to_accuracy.py", "--only", "reinforge", "--start-model", str(tmp_path / "start"),
                     "--max-steps", "2", "--eval-every", "1", "--threads", "1", "--gain", "-1", "sft.steps=2",
                     "sft.num_examples=512", "sft.batch_size=16", "train.prompts_per_step=4", "eval.num_prompts=8",
                     "eval.num_samples=2")
    assert out["threshold"] == round(out["start_pass1"] - 1, 4)
    curve = out["reinforge_curve"]
    assert [point[1] for point in curve] == [0, 1] and curve[0] == [0.0, 0, out["start_pass1"]]
    assert out["reinforge_seconds"] == round(curve[1][0], 3) > 0
    assert out["trl_seconds"] is None and out["ratio"] is None
    # pass@1 of 8 prompts x 2 samples is a multiple of 1/16.
    assert all(round(p * 16, 6) == round(p * 16) for _, _, p in curve)


def test_trl_settings_mirror_the_default_recipe():
    import importlib.util

    from reinforge.config import build_config
    from reinforge.jobs.start import objective_spec

    spec = importlib.util.spec_from_file_location("trl_common", BENCHMARKS / "trl_common.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = build_config([])
    assert module.trl_loss(objective_spec(cfg)) == {"loss_type": "grpo", "scale_rewards": "group", "epsilon": 0.2,
                                                    "epsilon_high": 0.2, "beta": 0.04}
    args = module.trl_grpo_args(cfg, objective_spec(cfg), "out")
    # One reinforge step: 32 prompts x 8 samples in 2 mini-batches = 2 TRL optimizer steps of 128 rows.
    assert (args["per_device_train_batch_size"], args["steps_per_generation"], args["num_generations"]) == (128, 2, 8)
    assert args["max_steps"] == 2 * cfg.train.steps and args["gradient_accumulation_steps"] == 1
    assert (args["max_completion_length"], args["learning_rate"], args["max_grad_norm"]) == (8, 5e-5, 1.0)
    dr = build_config(["recipe=dr_grpo"])
    assert module.trl_loss(objective_spec(dr)) == {"loss_type": "dr_grpo", "scale_rewards": "none", "epsilon": 0.2,
                                                   "epsilon_high": 0.2, "beta": 0.0}
    try:        # GSPO's sequence-level ratio is not TRL's token-level clip
        module.trl_loss(objective_spec(build_config(["recipe=gspo"])))
    except ValueError as err:
        assert "policy loss" in str(err)
    else:
        raise AssertionError("gspo mapped to a TRL loss")


def test_time_to_accuracy_interpolates_the_crossing():
    import importlib.util

    spec = importlib.util.spec_from_file_location("time_to_accuracy", BENCHMARKS / "time_to_accuracy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    curve = [[0.0, 0, 0.6], [2.0, 5, 0.7], [4.0, 10, 0.8]]
    # 0.75 lies halfway from 0.7 (2 s) to 0.8 (4 s): 3 s; a threshold met at the start: 0 s.
    assert module.crossing(curve, 0.75) == 3.0 and module.crossing(curve, 0.5) == 0.0
    assert module.crossing(curve, 0.8) == 4.0 and module.crossing(curve, 0.81) is None


def test_gpu_check_dry_run_runs_every_part_on_the_cpu():
    """benchmarks/gpu_check.py, the check for a lent GPU, at tiny shapes on the CPU: every part's code runs
    and its figures are the ones its line says they are derived from."""
    done = subprocess.run([sys.executable, str(BENCHMARKS / "gpu_check.py"), "--device", "cpu", "--dry-run",
                           "--tests-k", "chunked_head and fp32"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(x) for x in done.stdout.strip().splitlines()]
    parts = {line["part"]: line for line in lines}
    assert list(parts) == ["card", "cuda_tests", "rollout", "learner", "profile", "default_job", "summary"]
    assert all(line["device"].startswith("cpu") and line.get("ok", True) for line in lines)
    assert parts["summary"]["ok"] and parts["summary"]["failed"] == []
    card, tests, rollout, learner, job = (parts[p] for p in ["card", "cuda_tests", "rollout", "learner", "default_job"])
    assert card["bf16_matmul_tflops"] > 0 and card["copy_bandwidth_gbs"] > 0
    # The device's test cases are deselected on a CPU; the CPU case the -k picks ran and passed.
    assert (tests["marker"], tests["passed"], tests["failed"], tests["skipped"]) == ("not cuda", 1, 0, 0)
    # 4 prompts x 2 samples, every row to 12 new tokens (a random model at a 512 vocabulary rarely ends).
    assert rollout["rows"] == 8 and rollout["max_new_tokens"] == 12
    ratio = rollout["native_tokens_per_s"] / rollout["hf_generate_tokens_per_s"]
    assert abs(rollout["native_vs_generate"] - ratio) <= 2e-3 * ratio     # of the unrounded rates
    bound = rollout["rows"] / (rollout["step_bytes"] / (card["copy_bandwidth_gbs"] * 1e9))
    assert abs(rollout["bandwidth_bound_tokens_per_s"] - bound) <= 1e-3 * bound
    assert learner["rows"] == 8 and learner["batch_tokens"] > learner["completion_tokens"] > 0
    assert abs(learner["mfu_measured"] - learner["model_tflops"] / learner["measured_bf16_tflops"]) \
        <= 2e-3 * learner["mfu_measured"]
    assert learner["mfu_datasheet"] is None                  # no data-sheet rate for a CPU
    # The profile: 2 decode steps of the 8 rows, and the first micro-batch (all 8 rows) forward and backward;
    # a CPU has no device kernels, its aten ops are counted and ranked.
    decode, micro = parts["profile"]["decode"], parts["profile"]["learner_micro_step"]
    assert (decode["rows"], decode["steps"], decode["graph_mode"], decode["kernels_per_step"]) == (8, 2, None, None)
    assert (micro["rows"], micro["micro_batches"]) == (8, 1) and micro["tokens"] == learner["batch_tokens"]
    for table, steps in ((decode, 2), (micro, 1)):
        ops = table["top_cpu_ops"]
        assert 0 < len(ops) <= 15 and table["cpu_ops_per_step"] * steps >= sum(op["calls"] for op in ops)
        assert [op["ms"] for op in ops] == sorted((op["ms"] for op in ops), reverse=True)
    assert job["rl_steps"] == job["rl_steps_done"] == 3 and 0.0 <= job["pass@1_after"] <= 1.0
    assert job["eval_pass@1"] == [job["pass@1_before"], job["pass@1_after"]]


def test_gpu_check_a_part_over_its_budget_fails_alone(monkeypatch, capsys):
    sys.path.insert(0, str(BENCHMARKS))
    import gpu_check

    monkeypatch.setitem(gpu_check.BUDGETS, "rollout", 0.001)
    code = gpu_check.main(["--device", "cpu", "--dry-run", "--parts", "rollout,learner"])
    lines = {x["part"]: x for x in map(json.loads, capsys.readouterr().out.strip().splitlines())}
    assert code == 1
    assert not lines["rollout"]["ok"] and lines["rollout"]["error"] == "OutOfTime: over its budget of 0 s"
    assert lines["learner"]["ok"] and lines["card"]["ok"]             # the card is measured for the others
    assert (lines["summary"]["ok"], lines["summary"]["failed"]) == (False, ["rollout"])


def test_step_profile_splits_each_step_into_parts_that_add_up():
    out = run_script("step_profile.py", "--steps", "2", "--warmup", "1", "--threads", "1", "sft.num_examples=256",
                     "sft.batch_size=16", "train.prompts_per_step=4", "train.old_logprobs=recompute")
    parts = {"rl": ["generation", "prefill", "rewards", "curation", "batch_building", "old_logprobs", "reference",
                    "advantages", "forward", "loss", "backward", "optimizer", "critic", "weight_sync", "update_other",
                    "rest"],
             "sft": ["batch_building", "forward", "backward", "optimizer", "rest"]}
    for kind, names in parts.items():
        step = out[kind]
        assert list(step["parts"]) == names and list(step["part_medians"]) == names
        seconds = [part["seconds"] for part in step["parts"].values()]
        assert all(s >= 0 for s in seconds)
        assert abs(sum(seconds) - step["step_seconds"]) <= 0.01 * step["step_seconds"]
        # The split is of the median step (2 timed steps: the faster one).
        assert len(step["steps_s"]) == 2 and step["step_seconds"] == min(step["steps_s"])
    rl = {name: part["seconds"] for name, part in out["rl"]["parts"].items()}
    # The default recipe (grpo) computes each of these every step: a k3 KL against a fixed reference, pi_old
    # of the second of 2 mini-batches before the update (recomputed: by default the engine's log-probs are
    # taken, train.old_logprobs=auto). It has no critic, and the weight-sync probe of an
    # engine reading the trained tensors runs after the first update (warm-up) and every 10th, not here.
    assert all(rl[name] > 0 for name in parts["rl"] if name not in ("critic", "weight_sync", "rest"))
    assert rl["critic"] == 0.0 and rl["weight_sync"] == 0.0
    assert (out["rl"]["recipe"], out["rl"]["task"], out["rl"]["mini_batches"]) == ("grpo", "arithmetic", 2)
    assert 4 * 8 <= out["rl"]["completion_tokens"] <= 4 * 8 * out["rl"]["max_new_tokens"]
    assert out["torch_threads"] == 1 and out["cpu"] and out["sft"]["examples"] == 256
    from reinforge.kernels import load_cpu_kernels

    # The built-in model's shape fits the fused decode kernels: the engine uses them wherever they build.
    assert out["cpu_kernels"] == (load_cpu_kernels() is not None)
    assert out["env"]["REINFORGE_CPU_KERNELS"] == os.environ.get("REINFORGE_CPU_KERNELS")
    assert len(out["load_avg_start"]) == len(out["load_avg_end"]) == 3


def test_step_profile_clock_counts_each_part_exclusively(monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("step_profile", BENCHMARKS / "step_profile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    now = iter([0.0, 10.0, 11.0, 13.0, 14.0, 20.0, 21.0, 22.0, 24.0, 30.0])
    monkeypatch.setattr(module.time, "perf_counter", lambda: next(now))
    clock = module.PartClock()
    clock.tick()                                   # 0: the warm-up step ends
    backward = clock.timed(lambda: None, "backward")

    def forward():
        backward()                                 # 11 to 13 inside the forward (10 to 14)

    clock.timed(forward, "forward")()
    clock.timed(lambda: clock.timed(lambda: None, "forward")(), "reference")()   # opaque: 20 to 21 is all its own
    clock.timed(lambda: None, "forward")()         # 22 to 24
    clock.tick()                                   # 30
    step = clock.steps(1, ("forward", "backward", "reference", "rest"))
    assert step == [{"forward": 2.0 + 2.0, "backward": 2.0, "reference": 1.0, "rest": 30.0 - 7.0, "wall": 30.0}]


def test_the_reinforge_side_starts_as_the_cli_does_and_the_trl_side_as_its_users_run_it(tmp_path):
    # The CLI's OpenMP wait setting (GOMP_SPINCOUNT 1000 or 20000 by the load at start-up, unless set) is in place
    # before torch loads in reinforge's child, with the script's arguments as its own; TRL's child gets this
    # process's environment unchanged.
    sys.path.insert(0, str(BENCHMARKS))
    import trl_common

    probe = tmp_path / "probe.py"
    probe.write_text("import os, sys\nprint(os.environ.get('GOMP_SPINCOUNT'), 'torch' in sys.modules, sys.argv[1:])\n")
    clean = {k: v for k, v in os.environ.items() if k not in trl_common.OPENMP_KEYS}
    seen = {side: subprocess.run(trl_common.side_command(str(probe), ["--x", "1", "--side", side], side), env=clean,
                                 cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
            for side in ("reinforge", "trl")}
    spin, rest = seen["reinforge"].split(" ", 1)
    assert spin in ("1000", "20000") and rest == "False ['--x', '1', '--side', 'reinforge']"
    assert seen["trl"] == "None False ['--x', '1', '--side', 'trl']"


def test_time_to_accuracy_alternates_the_sides_and_pairs_each_round(monkeypatch):
    import importlib.util

    sys.path.insert(0, str(BENCHMARKS))
    import trl_common

    order = []

    def child(cmd, **kwargs):
        side = cmd[-1]
        order.append(side)
        seconds = {"reinforge": 2.0, "trl": 8.0}[side] * len(order)    # load rising over the run
        return subprocess.CompletedProcess(cmd, 0, stdout=json.dumps({"seconds": seconds}) + "\n")

    monkeypatch.setattr(trl_common.subprocess, "run", child)
    runs = trl_common.alternate("script.py", [], ("reinforge", "trl"), 3)
    # The order flips every other round: neither side always runs second.
    assert order == ["reinforge", "trl", "trl", "reinforge", "reinforge", "trl"]
    assert [r["seconds"] for r in runs["reinforge"]] == [2.0, 8.0, 10.0]
    assert [r["seconds"] for r in runs["trl"]] == [16.0, 24.0, 48.0]

    spec = importlib.util.spec_from_file_location("time_to_accuracy", BENCHMARKS / "time_to_accuracy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    curves = {"reinforge": [[0.0, 0, 0.6], [2.0, 4, 0.8]], "trl": [[0.0, 0, 0.6], [4.0, 4, 0.7], [8.0, 8, 0.8]]}
    runs = {side: [{"seconds": curve[-1][0], "curve": curve}, {"seconds": None, "curve": curve[:2]}]
            for side, curve in curves.items()}
    # Round 0: 2 / 8 s; interpolated at 0.75, 1.5 s (halfway from 0.6 to 0.8) over 6 s. Round 1 missed it.
    assert module.round_ratios(runs, 0.75) == {"ratio_each": [0.25, None], "ratio_interpolated_each": [0.25, None]}
    assert module.parse([]).rounds == 3 and module.parse(["--only", "reinforge"]).rounds == 1
    assert module.parse(["--rounds", "2"]).rounds == 2
