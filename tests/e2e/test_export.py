"""`reinforge export` and RUN_DIR/model: a plain Hugging Face folder (LoRA merged) that reloads with
transformers alone and gives the trained policy's log-probs, with the run's sampling defaults."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import MICRO
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
from typer.testing import CliRunner

from reinforge.cli import app
from reinforge.config import build_config
from reinforge.config.load import resume_config
from reinforge.errors import ConfigError
from reinforge.jobs.export import export_model
from reinforge.jobs.train import run
from reinforge.learner import build_sequences, completion_token_stats
from reinforge.models import load_policy
from reinforge.models.tokenizer import build_char_tokenizer
from reinforge.telemetry.checkpoint import CheckpointStore

SAMPLING = ["rollout.temperature=0.7", "rollout.top_p=0.9", "rollout.top_k=5", "rollout.max_new_tokens=5"]
TEXT = "a b\n3 5 7>22: Ab?"     # spaces and a newline: Qwen2's byte-level tokenizer would drop them


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """A micro full fine-tuning run and a micro LoRA run (checkpoints at steps 1, 2, 3)."""
    root = tmp_path_factory.mktemp("runs")
    extra = {"full": [], "lora": ["model.lora.r=4"]}
    for name, overrides in extra.items():
        run(build_config([*MICRO, *SAMPLING, *overrides, "checkpoint.every=1", "checkpoint.keep_last=3",
                          f"output_dir={root / name}"]))
    return {name: root / name for name in extra}


def trained_policy(run_dir: Path, step: int | None = None):
    """The policy as training left it: the run's own model (LoRA unmerged) with the checkpoint's weights."""
    cfg = resume_config(run_dir)
    store = CheckpointStore(run_dir / "checkpoints", keep_last=3)
    checkpoint = store.latest() if step is None else next(c for c in store.all() if c.step == step)
    policy = load_policy(cfg.model, cfg.seed)
    policy.model.load_state_dict(checkpoint.tensors()["model"])
    return policy


def logprobs(model: torch.nn.Module) -> torch.Tensor:
    tokenizer = build_char_tokenizer()
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in ("12+34=", "7+8=", "3 5 7>22:")]
    completions = torch.tensor([[5, 6, 1, 0], [9, 10, 11, 1], [4, 1, 0, 0]])
    mask = (completions != 0).float()
    with torch.no_grad():
        return completion_token_stats(
            model, build_sequences(prompts, completions, mask, tokenizer.pad_token_id)
        ).logprobs


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_exported_folder_reloads_plainly_with_the_trained_logprobs(runs, kind: str, tmp_path) -> None:
    out = export_model(runs[kind], tmp_path / "export")
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert type(model).__name__ == "Qwen2ForCausalLM" and not any("lora" in k for k in model.state_dict())
    policy = trained_policy(runs[kind])
    expected = logprobs(policy.model)
    torch.testing.assert_close(logprobs(model), expected, atol=1e-5, rtol=0)
    # RUN_DIR/model, written as the run ended, is the same plain model.
    final = AutoModelForCausalLM.from_pretrained(str(runs[kind] / "model"), dtype=torch.float32)
    torch.testing.assert_close(logprobs(final), expected, atol=1e-5, rtol=0)
    if kind == "lora":   # the merge mattered: the adapters (trained by SFT) moved the weights off the base
        with policy.model.disable_adapter():
            assert (logprobs(policy.model) - expected).abs().max() > 1e-3
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(out))
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    assert ids == build_char_tokenizer()(TEXT, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == TEXT
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<eos>", "<pad>")


def test_generation_config_holds_the_runs_sampling_settings(runs, tmp_path) -> None:
    tokenizer = build_char_tokenizer()
    expected = {"do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "max_new_tokens": 5,
                "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    out = export_model(runs["lora"], tmp_path / "export")
    for folder in (out, runs["lora"] / "model"):
        config = json.loads((folder / "generation_config.json").read_text())
        assert {k: config.get(k) for k in expected} == expected, folder
    # transformers' generate takes them as its defaults: a sampled completion of at most 5 tokens.
    model = AutoModelForCausalLM.from_pretrained(str(out))
    torch.manual_seed(0)
    generated = model.generate(torch.tensor([tokenizer("12+34=")["input_ids"]]))
    assert 6 < generated.shape[1] <= 6 + 5


def test_step_and_fallback_to_the_final_model(runs, tmp_path) -> None:
    out = export_model(runs["lora"], tmp_path / "step1", step=1)
    torch.testing.assert_close(logprobs(AutoModelForCausalLM.from_pretrained(str(out))),
                               logprobs(trained_policy(runs["lora"], step=1).model), atol=1e-5, rtol=0)
    with pytest.raises(ConfigError, match=r"no checkpoint of step 7 \(checkpoints of steps: 1, 2, 3\)"):
        export_model(runs["lora"], tmp_path / "step7", step=7)
    assert not (tmp_path / "step7").exists()
    # Without checkpoints the run's final model is exported.
    bare = tmp_path / "bare"
    shutil.copytree(runs["full"], bare, ignore=shutil.ignore_patterns("checkpoints"))
    out = export_model(bare, tmp_path / "from_final")
    torch.testing.assert_close(logprobs(AutoModelForCausalLM.from_pretrained(str(out))),
                               logprobs(trained_policy(runs["full"]).model), atol=1e-5, rtol=0)


def test_cli_exports_and_errors_clearly(runs, tmp_path) -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["export", str(runs["full"]), "--out", str(tmp_path / "cli")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "cli" / "model.safetensors").is_file() and (tmp_path / "cli" / "tokenizer.json").is_file()
    # The same folder again: not empty, refused.
    result = runner.invoke(app, ["export", str(runs["full"]), "--out", str(tmp_path / "cli")])
    assert result.exit_code == 2 and "not an empty folder" in result.output
    (tmp_path / "not_a_run").mkdir()
    result = runner.invoke(app, ["export", str(tmp_path / "not_a_run")])
    assert result.exit_code == 2 and "holds no run" in result.output and "Traceback" not in result.output
    result = runner.invoke(app, ["export", str(runs["lora"]), "--out", str(tmp_path / "s"), "--step", "9"])
    assert result.exit_code == 2 and "no checkpoint of step 9" in result.output
