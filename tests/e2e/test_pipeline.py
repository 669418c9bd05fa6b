"""End to end: the CLI on micro configs, the run directory, determinism, bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from reinforge.cli import app
from reinforge.config import build_config
from reinforge.jobs.train import run

runner = CliRunner()


# A step may have no correct (or no incorrect) sample: then there is no length to report for it.
MAY_BE_NULL = {"response_length_correct_mean", "response_length_incorrect_mean",
               *(f"reasoning/{name}/{kind}" for name in ("reflection_rate", "reflections_per_1k_tokens")
                 for kind in ("correct", "incorrect"))}


def _finite(record: dict) -> bool:
    return all(k in MAY_BE_NULL or (v is not None and (not isinstance(v, float) or math.isfinite(v)))
               for k, v in record.items())


@pytest.mark.parametrize(("recipe", "extra"), [
    ("grpo", []),
    ("dr_grpo", ["train.mini_batches=1"]),      # one optimizer step per batch: pi_old from the update's forward
    ("grpo", ["rollout.engine=hf"]),
])
def test_three_step_run_writes_a_complete_run_dir(
    tmp_path: Path, micro_overrides, recipe: str, extra: list[str]
) -> None:
    out = tmp_path / "run"
    result = runner.invoke(app, ["train", *micro_overrides, *extra, f"recipe={recipe}", f"output_dir={out}"])
    assert result.exit_code == 0, result.output
    assert "greedy accuracy" in result.output           # the before/after table
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in lines if r["stage"] == "rl"]
    assert [r["step"] for r in rl] == [1, 2, 3]
    for key in (
        "reward_mean", "response_length_mean", "entropy", "clip_frac", "grad_norm", "lr", "tokens_per_s",
        "step_seconds", "mismatch_abs_diff_max",
    ):
        assert all(key in r for r in rl), key
    assert all(_finite(r) for r in lines)
    assert ("kl" in rl[0]) == (recipe == "grpo")
    summary = json.loads((out / "summary.json").read_text())
    for stage in ("start", "final"):
        ev = summary["eval"][stage]
        assert 0.0 <= ev["pass@1"] <= 1.0 and 0.0 <= ev["greedy_accuracy"] <= 1.0
        assert list(ev["pass@k"]) == ["1", "2", "4"]
        assert ev["pass@k"]["1"] == pytest.approx(ev["pass@1"])
    assert summary["wall_seconds"] > 0
    resolved = yaml.safe_load((out / "config.yaml").read_text())
    assert resolved["recipe"] == recipe and resolved["output_dir"] == str(out)
    assert summary["sft"]["steps"] == 3 and summary["sft"]["final_loss"] < summary["sft"]["first_loss"]
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= {p.name for p in (out / "model").iterdir()}
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-000003"]   # the end of RL, resumable


def test_same_seed_same_numbers(tmp_path: Path, micro_overrides) -> None:
    def metrics(name: str) -> list[dict]:
        cfg = build_config([*micro_overrides, f"output_dir={tmp_path / name}"])
        result = run(cfg)
        drop = {"tokens_per_s", "step_seconds", "generation_seconds"}
        lines = [json.loads(x) for x in (Path(result.output_dir) / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in line.items() if k not in drop} for line in lines] + [result.summary["eval"]]

    assert metrics("a") == metrics("b")


def test_local_model_directory_goes_through_the_same_path(tmp_path: Path, micro_overrides, tiny_model_dir: str) -> None:
    out = tmp_path / "run"
    result = runner.invoke(app, ["train", *micro_overrides, f"model={tiny_model_dir}", f"output_dir={out}"])
    assert result.exit_code == 0, result.output
    assert yaml.safe_load((out / "config.yaml").read_text())["model"]["path"] == tiny_model_dir


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.stepz=3", "did you mean 'steps'"),
        ("model=/does/not/exist", "does not exist"),
        ("task.name=arithmatic", "did you mean 'arithmetic'"),
    ],
)
def test_bad_input_is_a_clear_error_and_writes_nothing(
    tmp_path: Path, micro_overrides, override: str, message: str
) -> None:
    out = tmp_path / "run"
    result = runner.invoke(app, ["train", *micro_overrides, override, f"output_dir={out}"])
    assert result.exit_code == 2
    assert message in result.output
    assert "Traceback" not in result.output
    assert not out.exists()


def test_existing_run_is_not_overwritten(tmp_path: Path, micro_overrides) -> None:
    out = tmp_path / "run"
    assert runner.invoke(app, ["train", *micro_overrides, f"output_dir={out}"]).exit_code == 0
    before = (out / "metrics.jsonl").read_text()
    result = runner.invoke(app, ["train", *micro_overrides, f"output_dir={out}"])
    assert result.exit_code == 2 and "already holds a run" in result.output
    assert (out / "metrics.jsonl").read_text() == before


@pytest.mark.parametrize(
    ("override", "message"),
    [("task.options.digits=0", "digits must be"), ("objective.aggregation=token_maen", "did you mean 'token_mean'")],
)
def test_bad_option_values_are_config_errors(tmp_path: Path, micro_overrides, override: str, message: str) -> None:
    out = tmp_path / "run"
    result = runner.invoke(app, ["train", *micro_overrides, override, f"output_dir={out}"])
    assert result.exit_code == 2 and message in result.output, result.output
    assert not out.exists()


def test_countdown_task_runs_end_to_end(tmp_path: Path, micro_overrides) -> None:
    out = tmp_path / "run"
    result = runner.invoke(
        app, ["train", *micro_overrides, "task.name=countdown", "rollout.max_new_tokens=8", f"output_dir={out}"]
    )
    assert result.exit_code == 0, result.output
    rl = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["stage"] == "rl"]
    assert len(rl) == 3 and all(_finite(r) for r in rl)


def test_other_architectures_and_chat_templates_use_the_same_path(tmp_path: Path, micro_overrides) -> None:
    """A Llama-architecture directory whose tokenizer has its own chat template."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from reinforge.models import load_policy
    from reinforge.models.tokenizer import build_char_tokenizer
    from reinforge.rollout import encode_prompts

    tok = build_char_tokenizer()
    tok.chat_template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
    ))
    path = tmp_path / "llama"
    model.save_pretrained(path)
    tok.save_pretrained(path)

    cfg = build_config([*micro_overrides, f"model={path}"])
    policy = load_policy(cfg.model, seed=0)
    assert type(policy.model).__name__ == "LlamaForCausalLM"
    assert policy.tokenizer.decode(encode_prompts(policy.tokenizer, ["05+34="])[0]) == "[05+34=]"
    assert policy.tokenizer.decode(encode_prompts(policy.tokenizer, ["05+34="], "never")[0]) == "05+34="
    out = tmp_path / "run"
    result = runner.invoke(app, ["train", *micro_overrides, f"model={path}", f"output_dir={out}"])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "summary.json").read_text())["rl_steps"] == 3


def test_sft_on_teacher_traces_from_a_file(tmp_path: Path, micro_overrides) -> None:
    """Distillation: sft.source=file trains on (prompt, completion) rows of a JSONL file."""
    traces = tmp_path / "traces.jsonl"
    traces.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "completion": str(a + b)}) + "\n"
                              for a in range(10, 14) for b in range(20, 22)))
    out = tmp_path / "run"
    result = runner.invoke(
        app, ["train", *micro_overrides, "sft.source=file", f"sft.data_path={traces}", f"output_dir={out}"]
    )
    assert result.exit_code == 0, result.output
    sft = json.loads((out / "summary.json").read_text())["sft"]
    assert sft["source"] == "file" and sft["examples"] == 8 and sft["final_loss"] < sft["first_loss"]
    missing = runner.invoke(
        app,
        [
            "train",
            *micro_overrides,
            "sft.source=file",
            f"sft.data_path={tmp_path / 'nope.jsonl'}",
            f"output_dir={tmp_path / 'other'}",
        ],
    )
    assert missing.exit_code == 2 and "does not exist" in missing.output and not (tmp_path / "other").exists()


def test_train_seed_varies_rl_from_one_sft_model(tmp_path: Path, micro_overrides) -> None:
    """seed fixes SFT; train.seed only the stage after it, so methods can be compared from one SFT model."""
    def run_with(name: str, *extra: str) -> tuple[dict, list[dict]]:
        result = run(build_config([*micro_overrides, "train.lr=1e-3", *extra, f"output_dir={tmp_path / name}"]))
        lines = [json.loads(x) for x in (Path(result.output_dir) / "metrics.jsonl").read_text().splitlines()]
        rl = [{k: v for k, v in r.items() if k not in {"tokens_per_s", "step_seconds", "generation_seconds"}}
              for r in lines if r["stage"] == "rl"]
        return result.summary, rl

    a, rl_a = run_with("a", "train.seed=1")
    b, rl_b = run_with("b", "train.seed=2")
    c, rl_c = run_with("c", "train.seed=1")
    assert a["sft"] == b["sft"] and a["eval"]["start"] == b["eval"]["start"]      # the same SFT model
    assert rl_a != rl_b                                                            # different RL draws
    assert rl_a == rl_c and a["eval"] == c["eval"]                                 # and reproducible
