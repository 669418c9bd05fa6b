"""Built-in model and tokenizer: save/load round trips through the same code path as any HF model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from reinforge.cli import app
from reinforge.config import build_config
from reinforge.models import load_policy
from reinforge.models.charset import CHARSET
from reinforge.models.tokenizer import build_char_tokenizer, load_tokenizer
from reinforge.settings import ModelConfig

runner = CliRunner()


def test_char_tokenizer_round_trip_next_to_a_qwen2_config(tiny_model_dir: str) -> None:
    # The saved directory holds a Qwen2 config.json: AutoTokenizer would swap in
    # Qwen2's byte-level tokenizer; load_tokenizer must not.
    tok = load_tokenizer(tiny_model_dir)
    text = "12+34=46 (3*5)/7\nabc XYZ"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)                      # one token per character
    assert tok.decode(ids) == text
    assert len(tok) == len(CHARSET) + 3
    assert (tok.pad_token_id, tok.eos_token_id) == (0, 1)
    assert tok.decode(ids + [tok.eos_token_id], skip_special_tokens=True) == text


def test_unknown_characters_map_to_unk() -> None:
    tok = build_char_tokenizer()
    assert tok("é", add_special_tokens=False)["input_ids"] == [tok.unk_token_id]


def test_added_tokens_are_one_token_each_survive_a_save_and_stay_in_decoded_text(tmp_path: Path) -> None:
    from reinforge.errors import ConfigError

    tags = ["<tool_call>", "</tool_call>"]
    tok = build_char_tokenizer(tags)
    text = '<tool_call>{"a":1}</tool_call>'
    ids = tok(text, add_special_tokens=False)["input_ids"]
    base = len(CHARSET) + 3
    assert len(tok) == base + 2 and ids[0] == base and ids[-1] == base + 1
    assert len(ids) == len('{"a":1}') + 2                       # the tags are one token each, the rest characters
    assert tok.decode(ids + [tok.eos_token_id], skip_special_tokens=True) == text   # not special: kept
    assert tok("<tool_ca", add_special_tokens=False)["input_ids"] == tok(
        "<tool_ca", add_special_tokens=False)["input_ids"][:8]             # a partial tag stays characters
    assert len(tok("<tool_ca", add_special_tokens=False)["input_ids"]) == 8
    # The built-in model's vocabulary grows with them; its folder's tokenizer reads the tags the same way.
    policy = load_policy(ModelConfig(added_tokens=tags), seed=0)
    assert policy.model.config.vocab_size == base + 2
    policy.model.save_pretrained(tmp_path)
    policy.tokenizer.save_pretrained(tmp_path)
    assert load_tokenizer(tmp_path)(text, add_special_tokens=False)["input_ids"] == ids
    for bad in (["a"], ["<tool_call>", "<tool_call>"], [""]):
        with pytest.raises(ValueError, match="two or more characters"):
            build_char_tokenizer(bad)
        with pytest.raises(ConfigError, match="two or more characters"):     # and before a run starts
            build_config([f"model.added_tokens={bad}"])
    with pytest.raises(ValueError, match="a character of the built-in tokenizer already"):
        build_char_tokenizer(["<eos>"])


def test_saved_model_reloads_with_identical_logits(tiny_model_dir: str) -> None:
    policy = load_policy(ModelConfig(path=tiny_model_dir), seed=123)   # seed must not matter for a path
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids = torch.tensor([[4, 5, 66, 6, 7, 72]])
    torch.testing.assert_close(policy.model(ids).logits, plain(ids).logits, rtol=0, atol=0)
    assert policy.eos_token_ids == [1]


def test_model_device_auto_is_the_cpu_without_cuda_and_cuda_is_refused_before_a_run() -> None:
    import pytest

    from reinforge.config import build_config
    from reinforge.errors import ConfigError
    from reinforge.jobs.start import prepare
    from reinforge.models import model_device, resolve_device

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal is for machines without it")
    assert resolve_device("auto") == torch.device("cpu") == resolve_device("cpu")
    policy = load_policy(ModelConfig(device="auto"), seed=0)
    assert model_device(policy.model) == torch.device("cpu")
    for name in ("cuda", "cuda:1"):
        with pytest.raises(ConfigError, match="0 CUDA device"):
            prepare(build_config([f"model.device={name}"]))
    with pytest.raises(ConfigError, match="model.device"):
        build_config(["model.device=gpu"])


def test_a_sequence_batch_moves_every_tensor() -> None:
    from reinforge.learner import build_sequences

    batch = build_sequences([[1, 2], [3]], torch.tensor([[4, 5], [6, 0]]), torch.tensor([[1.0, 1.0], [1.0, 0.0]]), 0,
                            group_ids=torch.tensor([0, 1]))
    assert batch.to(torch.device("cpu")) is batch
    moved = batch.to(torch.device("meta"))
    present = [f for f in vars(batch) if getattr(batch, f) is not None]      # routes, top-K: only when recorded
    assert {f: getattr(moved, f).device.type for f in present} == {f: "meta" for f in present}
    assert {"input_ids", "attention_mask", "group_ids"} <= set(present)
    assert moved.input_ids.shape == batch.input_ids.shape == (2, 4)
    without_groups = build_sequences([[1]], torch.tensor([[2]]), torch.tensor([[1.0]]), 0)
    assert without_groups.to(torch.device("meta")).group_ids is None


# Models other than Llama-family: the engine and the learner forward are decided from config.json at
# config check (issue 21.4), said in one line, and an explicit setting the model cannot run is refused.

GPT2_NOTE = ("model: gpt2 is not Llama-family (llama, mistral, qwen2, qwen3, qwen2_moe, mixtral, qwen3_moe); "
             "rollout uses the transformers engine "
             "(rollout.engine=hf), learner uses the model's own forward (train.shared_prefix=false)")


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory) -> str:
    """A tiny GPT-2 with the char tokenizer, saved as a Hugging Face folder."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = build_char_tokenizer()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=64, vocab_size=len(tok),
                                       bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
                                       pad_token_id=tok.pad_token_id))
    path = tmp_path_factory.mktemp("gpt2")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def _run_settings(micro: list[str]) -> list[str]:
    return [o for o in micro if not o.startswith("model.")]    # sizes of the built-in model


@pytest.mark.parametrize("lora", [False, True])
def test_gpt2_trains_with_one_line_saying_what_runs_it(
    tmp_path: Path, micro_overrides, gpt2_dir: str, lora: bool
) -> None:
    out = tmp_path / "run"
    extra = ["model.lora.r=4"] if lora else []
    result = runner.invoke(
        app, ["train", *_run_settings(micro_overrides), f"model={gpt2_dir}", *extra, f"output_dir={out}"]
    )
    assert result.exit_code == 0, result.output
    notes = [line for line in result.stderr.splitlines() if line.startswith("model:")]
    # peft's default targets for GPT-2 (its projections are not named as Llama's)
    assert notes == [GPT2_NOTE + (", LoRA adapters on c_attn (model.lora.target_modules)" if lora else "")]
    assert "error" not in result.stderr.lower() and "Warning" not in result.stderr
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert (saved["rollout"]["engine"], saved["train"]["shared_prefix"]) == ("hf", False)
    assert json.loads((out / "summary.json").read_text())["rl_steps"] == 3


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        (
            "rollout.engine=native",
            "rollout.engine=native cannot run '{path}': gpt2 is not Llama-family (llama, mistral, qwen2, "
            "qwen3, qwen2_moe, mixtral, qwen3_moe); remove rollout.engine=native (the transformers engine is "
            "chosen for this model) or set rollout.engine=hf",
        ),
        (
            "train.shared_prefix=true",
            "train.shared_prefix=true cannot run '{path}': gpt2 is not Llama-family (llama, mistral, "
            "qwen2, qwen3, qwen2_moe, mixtral, qwen3_moe); remove it (the model's own forward is chosen for this "
            "model) or set "
            "train.shared_prefix=false",
        ),
        (
            "recipe=areal",
            "train.mode=async samples with the native engine, which cannot run '{path}': gpt2 is not "
            "Llama-family (llama, mistral, qwen2, qwen3, qwen2_moe, mixtral, qwen3_moe); use train.mode=sync and a "
            "recipe that is not asynchronous",
        ),
    ],
)
def test_gpt2_with_a_setting_it_cannot_run_is_one_config_error(tmp_path: Path, micro_overrides, gpt2_dir: str,
                                                               setting: str, message: str) -> None:
    out = tmp_path / "run"
    result = runner.invoke(
        app, ["train", *_run_settings(micro_overrides), f"model={gpt2_dir}", setting, f"output_dir={out}"]
    )
    assert result.exit_code == 2
    assert result.stderr == f"error: {message.format(path=gpt2_dir)}\n"
    assert not out.exists()


@pytest.mark.parametrize(
    ("config", "native", "shared_prefix"),
    [
        ({"model_type": "qwen2"}, None, None),
        (
            {"model_type": "phi"},
            "phi is not Llama-family (llama, mistral, qwen2, qwen3, qwen2_moe, mixtral, qwen3_moe)",
            "phi is not Llama-family (llama, mistral, qwen2, qwen3, qwen2_moe, mixtral, qwen3_moe)",
        ),
        (
            {"model_type": "llama", "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
            "llama with rope_type 'dynamic' is not one the native decoder implements (default, linear, llama3, yarn)",
            ...,
        ),
        ({"model_type": "llama", "rope_scaling": {"type": "linear", "factor": 2.0}}, None, None),
        (
            {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 4096},
            "qwen2 uses sliding-window layers, which the native decoder does not model",
            ...,
        ),
        ({"model_type": "qwen2", "use_sliding_window": False, "sliding_window": 4096}, None, None),
        (
            {"model_type": "mistral", "sliding_window": 4096},
            None,
            "mistral uses sliding-window attention, which the shared-prompt learner forward does not model",
        ),
        (
            {"model_type": "llama", "attention_dropout": 0.1},
            None,
            "llama applies attention dropout, which the shared-prompt learner forward does not",
        ),
    ],
)
def test_what_the_native_paths_run_is_read_from_config_json(config: dict, native, shared_prefix) -> None:
    from reinforge.models.model_dir import native_refusal, shared_prefix_refusal

    assert native_refusal(config) == native
    assert shared_prefix_refusal(config) == (native if shared_prefix is ... else shared_prefix)


def test_a_mistral_window_keeps_the_native_engine_and_drops_the_shared_prompt_forward(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mistral", "sliding_window": 16}))
    cfg = build_config([f"model={tmp_path}"])
    assert (cfg.rollout.engine, cfg.train.shared_prefix) == ("native", False)
    from reinforge.models.model_dir import architecture_plan

    assert architecture_plan(tmp_path).note(cfg.rollout.engine, cfg.train.shared_prefix) == (
        "model: mistral uses sliding-window attention, which the shared-prompt learner forward does not model; "
        "rollout uses the native engine (rollout.engine=native), learner uses the model's own forward "
        "(train.shared_prefix=false)"
    )


def test_a_model_that_soft_caps_its_logits_gets_full_logits(tmp_path: Path) -> None:
    """The chunked log-prob head assumes logits = lm_head(hidden); Gemma 2 caps them after it."""
    from reinforge.errors import ConfigError
    from reinforge.models.model_dir import architecture_plan

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma2", "final_logit_softcapping": 30.0}))
    cfg = build_config([f"model={tmp_path}"])
    assert (cfg.rollout.engine, cfg.train.shared_prefix, cfg.train.logprob_chunk_size) == ("hf", False, 0)
    assert architecture_plan(tmp_path).note("hf", False, None, 0) == (
        "model: gemma2 is not Llama-family (llama, mistral, qwen2, qwen3, qwen2_moe, mixtral, qwen3_moe); "
        "rollout uses the transformers engine "
        "(rollout.engine=hf), learner uses the model's own forward (train.shared_prefix=false) with full logits "
        "(train.logprob_chunk_size=0: gemma2 soft-caps its logits after the LM head)")
    with pytest.raises(ConfigError) as err:
        build_config([f"model={tmp_path}", "train.logprob_chunk_size=512"])
    assert str(err.value) == (
        f"train.logprob_chunk_size=512 cannot run '{tmp_path}': gemma2 soft-caps its logits after "
        "the LM head; remove it (full logits are chosen for this model) or set it to 0"
    )


def test_a_pipelines_later_stages_run_the_first_stages_architecture(tmp_path: Path, gpt2_dir: str) -> None:
    """Stage 2 trains stage 1's GPT-2, whose folder does not exist yet when the stages are checked."""
    from reinforge.jobs.multistage import PipelineSpec, stage_configs

    (tmp_path / "p.yaml").write_text(yaml.safe_dump({"name": "two", "stages": [{"name": "a"}, {"name": "b"}]}))
    a, b = stage_configs(PipelineSpec.load(str(tmp_path / "p.yaml")), [f"model={gpt2_dir}"], tmp_path / "out")
    assert b.model.path == str(tmp_path / "out" / "1-a" / "model")
    assert [(c.rollout.engine, c.train.shared_prefix) for c in (a, b)] == [("hf", False), ("hf", False)]
