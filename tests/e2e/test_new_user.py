"""What a new user coming from TRL or verl hit on files nobody prepared, each now a regression test:
a chat template that refuses the prompts (Llama-2's "a system message is required"), a plain
`ground_truth` column, a JSON Lines row cut short, the option names TRL's trainer and ModelConfig
and verl's custom_reward_function use, and `reinforge export` of a run whose reward was a
notebook function (which lives only in the process that trained)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import MICRO, byte_bpe
from typer.testing import CliRunner

from reinforge.cli import app
from reinforge.config import build_config
from reinforge.data.formats import DatasetError
from reinforge.data.loading import load_records
from reinforge.errors import ConfigError
from reinforge.tasks.dataset import DatasetTask

RUN = [m for m in MICRO if not m.startswith("model.")]    # the built-in model's sizes do not apply to a folder
SPECIALS = ["<s>", "</s>", "<<SYS>>", "<</SYS>>", "[INST]", "[/INST]"]
# Llama-2's rule: the template raises unless the conversation opens with a system message.
SYSTEM_REQUIRED = ("{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system message is required') }}"
                   "{% endif %}<<SYS>>{{ messages[0]['content'] }}<</SYS>>"
                   "{% for m in messages[1:] %}[INST]{{ m['content'] }}[/INST]{% endfor %}")


@pytest.fixture(scope="module")
def llama_needs_system(tmp_path_factory) -> Path:
    """A tiny Llama whose BPE tokenizer has an eos but no pad token and a template that needs a system message."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = byte_bpe([f"What is {a} + {b}? {a + b}" for a in range(10) for b in range(10)], SPECIALS)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", model_max_length=256)
    tok.chat_template = SYSTEM_REQUIRED
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id))
    path = tmp_path_factory.mktemp("llama_needs_system")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _plain_data(path: Path) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"What is {a} + 1?", "ground_truth": str(a + 1)}) + "\n"
                            for a in range(8)))
    return path


def test_a_template_that_refuses_the_prompt_is_one_line_naming_prompt_system(llama_needs_system, tmp_path) -> None:
    from reinforge.models.tokenizer import load_tokenizer
    from reinforge.rollout import encode_prompts

    tok = load_tokenizer(llama_needs_system)
    with pytest.raises(ConfigError) as err:
        encode_prompts(tok, ["What is 2 + 2?"])
    assert str(err.value) == (
        "the model's chat template refused a prompt with messages (user): a system message is required; add a system "
        "message with prompt.system=\"...\", give the messages the template expects in the data file, or set "
        "prompt.chat_template=never for plain-text prompts")

    out = tmp_path / "run"
    args = ["train", f"model={llama_needs_system}", *RUN, "sft.enabled=false", "task.name=dataset",
            f"task.options.path={_plain_data(tmp_path / 'd.jsonl')}", f"output_dir={out}"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "refused a prompt with messages (user): a system message is required" in result.output
    assert not out.exists()    # refused before the run directory is made
    # With the system message the template asks for, the same prompt encodes: <<SYS>>Be brief.<</SYS>>[INST]...[/INST]
    from reinforge.data.chat import with_system

    (ids,) = encode_prompts(tok, [with_system("What is 2 + 2?", "Be brief.")])
    assert tok.decode(ids) == "<<SYS>>Be brief.<</SYS>>[INST]What is 2 + 2?[/INST]"


def test_a_plain_ground_truth_column_is_the_answer(tmp_path, caplog) -> None:
    task = DatasetTask(str(_plain_data(tmp_path / "d.jsonl")), eval_path=str(tmp_path / "d.jsonl"), verifier="exact")
    assert [e.answer for e in task.eval_split(8)] == [str(a + 1) for a in range(8)]
    assert "using 'ground_truth'" in caplog.text
    # An `answer` column still wins over it.
    (tmp_path / "both.jsonl").write_text(json.dumps({"prompt": "p", "answer": "A", "ground_truth": "G"}) + "\n")
    task = DatasetTask(str(tmp_path / "both.jsonl"), eval_path=str(tmp_path / "both.jsonl"), verifier="exact")
    assert task.eval_split(1)[0].answer == "A"


def test_a_row_cut_short_is_reported_where_it_ends(tmp_path) -> None:
    path = tmp_path / "d.jsonl"
    # Line 2 lacks its closing brace: json reports the end of its 14 characters, column 15.
    path.write_text('{"prompt": "a"}\n{"prompt": "x"\n')
    with pytest.raises(DatasetError) as err:
        load_records(path)
    assert str(err.value) == f"'{path}', line 2: bad JSON: Expecting ',' delimiter at column 15"


@pytest.mark.parametrize(("override", "message"), [
    ("lora_r=8", "unknown config key 'lora_r'; did you mean 'model.lora.r'? (TRL's ModelConfig name)"),
    ("reward_funcs=[f]", "unknown config key 'reward_funcs'; did you mean 'reward.functions'? (TRL's GRPOTrainer / "
     "script argument; as reward.functions=[{name: path/to/file.py:function}], in TRL's, verl's or reinforge's form; "
     "a reward model folder is reward.model.path)"),
    ("dataset_name=x", "unknown config key 'dataset_name'; did you mean 'task.options.path'? (TRL's GRPOTrainer / "
     "script argument; a local data file or save_to_disk folder, with task.name=dataset; nothing is downloaded)"),
    ("data.val_files=v.parquet", "unknown config key 'data.val_files'; did you mean 'task.options.eval_path'? "
     "(verl's name; with task.name=dataset)"),
])
def test_trainer_and_model_config_names_get_the_key_that_does_the_job(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        build_config([override])
    assert str(err.value) == message


def test_verls_custom_reward_function_in_a_nested_yaml_names_reward_functions(tmp_path) -> None:
    (tmp_path / "verl.yaml").write_text("custom_reward_function:\n  path: my_reward.py\n  name: compute_score\n")
    with pytest.raises(ConfigError) as err:
        build_config([], str(tmp_path / "verl.yaml"))
    assert str(err.value).startswith(
        "2 unknown config keys: 'custom_reward_function.path'; did you mean "
        "'reward.functions'? (verl's name; as reward.functions=[{name: path/to/file.py:function}]"
    )


def test_export_of_a_run_whose_reward_was_a_notebook_function(tmp_path) -> None:
    (tmp_path / "r.py").write_text("def length(completion):\n    return float(len(completion))\n")
    run_dir = tmp_path / "run"
    args = ["train", *MICRO, "sft.enabled=false", "train.steps=1", f"output_dir={run_dir}",
            f"reward.functions=[{{name: {tmp_path / 'r.py'}:length}}]"]
    assert CliRunner().invoke(app, args).exit_code == 0
    # As if the reward had been given to reinforge.train in a process that has ended.
    config = run_dir / "config.yaml"
    config.write_text(
        config.read_text().replace(f"{tmp_path / 'r.py'}:length", "reinforge.rewards.user:gone_with_its_process")
    )
    result = CliRunner().invoke(app, ["export", str(run_dir)])
    assert result.exit_code == 0, result.output
    assert (run_dir / "export" / "config.json").is_file() and (run_dir / "export" / "model.safetensors").is_file()
    # Resuming does compute rewards: there the missing function is still refused, in one line.
    result = CliRunner().invoke(app, ["train", "--resume", str(run_dir)])
    assert (
        result.exit_code == 2
        and "no reward function 'gone_with_its_process' is registered in this process" in result.output
    )


def test_resume_from_checkpoint_names_the_resume_option() -> None:
    with pytest.raises(ConfigError) as err:
        build_config(["resume_from_checkpoint=true"])
    assert str(err.value) == ("unknown config key 'resume_from_checkpoint' (TRL's GRPOTrainer / script argument; "
                              "continue a run with `reinforge train --resume RUN_DIR`); remove it")


def test_a_verl_dataframe_is_a_dataset_and_train_dataset_names_dataset(tmp_path, monkeypatch) -> None:
    import numpy as np
    import pandas as pd

    import reinforge
    from reinforge.api import dataset_path

    monkeypatch.setenv("REINFORGE_CACHE", str(tmp_path))
    # As read from verl's parquet: the message list is a numpy array of dicts, reward_model a dict.
    frame = pd.DataFrame(
        [
            {
                "data_source": "gsm8k",
                "prompt": np.array([{"role": "user", "content": "1+2?"}], dtype=object),
                "reward_model": {"style": "rule", "ground_truth": "3"},
            }
        ]
    )
    path = dataset_path(frame)
    assert json.loads(Path(path).read_text()) == {
        "data_source": "gsm8k",
        "prompt": [{"role": "user", "content": "1+2?"}],
        "reward_model": {"style": "rule", "ground_truth": "3"},
    }
    with pytest.raises(
        TypeError, match=r"^reinforge.train takes the data as dataset=\.\.\., not train_dataset=\.\.\.$"
    ):
        reinforge.train(train_dataset=path)


def test_a_reward_file_imports_its_neighbours_and_a_broken_one_is_one_line(tmp_path) -> None:
    from reinforge.rewards.compose import resolve_reward_function

    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "helpers_next_to_it.py").write_text("def strip(text):\n    return text.strip()\n")
    (folder / "rewards.py").write_text("from helpers_next_to_it import strip\n\n"
                                       "def accuracy_reward(completions, solution, **kwargs):\n"
                                       "    return [float(strip(c) == s) for c, s in zip(completions, solution)]\n")
    fn = resolve_reward_function(f"{folder / 'rewards.py'}:accuracy_reward", {})
    assert fn(completions=[" 4 ", "5"], solution=["4", "4"]) == [1.0, 0.0]
    with pytest.raises(ValueError) as err:
        resolve_reward_function(f"{folder / 'rewards.py'}:acuracy_reward", {})
    assert str(err.value) == (
        f"reward function '{folder / 'rewards.py'}:acuracy_reward': '{folder / 'rewards.py'}' has "
        "no function 'acuracy_reward'; did you mean 'accuracy_reward'? (its functions: accuracy_reward)"
    )
    (folder / "broken.py").write_text("import re\n\ndef f(completions, **kwargs)\n    return [1.0]\n")
    (folder / "missing.py").write_text("import re\nimport not_installed_anywhere_xyz\n")
    with pytest.raises(ValueError) as err:
        resolve_reward_function(f"{folder / 'broken.py'}:f", {})
    assert str(err.value) == f"reward file '{folder / 'broken.py'}' failed to load: line 3: SyntaxError: expected ':'"
    with pytest.raises(ValueError) as err:
        resolve_reward_function(f"{folder / 'missing.py'}:f", {})
    assert str(err.value) == (f"reward file '{folder / 'missing.py'}' failed to load: line 2: ModuleNotFoundError: "
                              "No module named 'not_installed_anywhere_xyz'")


def test_reward_functions_as_bare_names_and_a_verifier_named_as_a_reward() -> None:
    cfg = build_config(["reward.functions=[verifier, think_answer]"])
    assert [(f.name, f.weight) for f in cfg.reward.functions] == [("verifier", 1.0), ("think_answer", 1.0)]
    assert [f.name for f in build_config(["reward.functions=verifier"]).reward.functions] == ["verifier"]
    with pytest.raises(ConfigError) as err:
        build_config(["reward.functions=[math]"])
    assert str(err.value) == (
        "invalid configuration: reward: 'math' is a verifier, not a reward function: the reward "
        "function 'verifier' scores with the task's verifier, set with task.options.verifier=math "
        "(task.name=dataset)"
    )


def test_a_kwargs_only_function_that_reads_completions_is_told_how_to_get_them(tmp_path) -> None:
    (tmp_path / "r.py").write_text("def kw(**kwargs):\n    return [1.0 for _ in kwargs['completions']]\n")
    args = ["train", *MICRO, "sft.enabled=false", "train.steps=1", f"output_dir={tmp_path / 'run'}",
            f"reward.functions=[{tmp_path / 'r.py'}:kw]"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    assert ("raised KeyError('completions') on sample 0" in result.output and
            "a function of only **kwargs is called once per sample with completion, prompt, answer and the row's "
            "fields: to be called in TRL's batched form, name its parameters (completions, **kwargs); full traceback "
            f"in {tmp_path / 'run'}/error.log" in result.output.replace("\n", ""))


def test_an_empty_data_file_says_it_is_empty(tmp_path) -> None:
    import pandas as pd

    (tmp_path / "e.jsonl").write_text("\n\n")
    (tmp_path / "h.csv").write_text("question,answer\n")
    pd.DataFrame({"prompt": [], "answer": []}).to_parquet(tmp_path / "e.parquet")
    for name, message in [("e.jsonl", "has no rows (the file is empty)"),
                          ("h.csv", "has no rows (the file is empty, or only its header)"),
                          ("e.parquet", "has no rows (the file is empty)")]:
        with pytest.raises(DatasetError) as err:
            load_records(tmp_path / name)
        assert str(err.value) == f"'{tmp_path / name}' {message}"


def test_paths_from_a_yaml_file_or_python_expand_the_home_folder(tmp_path, monkeypatch) -> None:
    from reinforge.rewards.compose import resolve_reward_function

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "d.jsonl").write_text(json.dumps({"prompt": "1+1?", "answer": "2"}) + "\n")
    (tmp_path / "r.py").write_text("def one(completion):\n    return 1.0\n")
    assert load_records("~/d.jsonl", required=("prompt", "answer")) == [{"prompt": "1+1?", "answer": "2"}]
    assert resolve_reward_function("~/r.py:one", {})(completion="x") == 1.0


@pytest.mark.parametrize(("overrides", "message"), [
    (["task.options.path=d.jsonl"], "invalid configuration: task: task.options.path is an option of "
     "task.name=dataset, not of the task 'arithmetic' (the default): set task.name=dataset"),
    (["task.name=countdown", "task.options.path=d.jsonl"], "invalid configuration: task: task.options.path is an "
     "option of task.name=dataset, not of the task 'countdown': set task.name=dataset"),
    (["dataset=d.jsonl"], "unknown config key 'dataset'; did you mean 'task.options.path'? (reinforge.train's "
     "argument name; with task.name=dataset)"),
])
def test_a_data_file_given_without_task_name_dataset_names_it(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        build_config(overrides)
    assert str(err.value) == message


def test_a_missing_answer_never_suggests_the_prompt_column(tmp_path) -> None:
    path = tmp_path / "prompts_only.jsonl"     # TRL's prompt-only layout: no gold answer to evaluate against
    path.write_text(json.dumps({"prompt": [{"role": "user", "content": "Write a haiku"}]}) + "\n")
    with pytest.raises(DatasetError) as err:
        DatasetTask(str(path))
    assert str(err.value) == (f"'{path}', line 1: field 'answer' is missing; the row's columns: prompt; add a column "
                              "'answer', or map one with task.options.fields.answer=COLUMN")


@pytest.fixture(scope="module")
def gpt2_32_positions(tmp_path_factory, llama_needs_system) -> Path:
    """A tiny GPT-2 (learned positions, n_positions=32) with the Llama fixture's tokenizer and no chat template."""
    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    tok = AutoTokenizer.from_pretrained(llama_needs_system)
    tok.chat_template = None
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=16, n_layer=1, n_head=2, n_positions=32,
                                       bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id))
    path = tmp_path_factory.mktemp("gpt2_32")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_prompt_plus_max_new_tokens_past_learned_positions_is_one_line(gpt2_32_positions, tmp_path) -> None:
    from reinforge.models.tokenizer import load_tokenizer

    data = _plain_data(tmp_path / "d.jsonl")
    longest = max(len(load_tokenizer(gpt2_32_positions)(f"What is {a} + 1?")["input_ids"]) for a in range(8))
    out = tmp_path / "run"
    base = ["train", f"model={gpt2_32_positions}", *RUN, "sft.enabled=false", "train.steps=1", "task.name=dataset",
            f"task.options.path={data}", "task.options.verifier=exact", f"output_dir={out}"]
    result = CliRunner().invoke(app, [*base, f"rollout.max_new_tokens={33 - longest}"])
    assert result.exit_code == 2 and not out.exists()
    line = " ".join(result.output.split())
    assert re.search(
        rf"error: \d+ of \d+ prompts are longer than {longest - 1} tokens, the model's 32 positions \(n_positions in "
        rf"its config.json\) less rollout.max_new_tokens={33 - longest} \(the longest: {longest} tokens, 'What is "
        rf"\d \+ 1\?'\): set rollout.max_new_tokens={32 - longest} or less, or remove or shorten those rows of the "
        "data; prompts are never truncated", line), line
    # Exactly at the limit it runs.
    result = CliRunner().invoke(app, [*base, f"rollout.max_new_tokens={32 - longest}"])
    assert result.exit_code == 0, result.output


def test_a_trl_or_verl_config_file_gets_every_unknown_key_at_once(tmp_path) -> None:
    (tmp_path / "trl.yaml").write_text("model_name_or_path: m\nnum_generations: 4\nseed: 1\ntrian:\n  steps: 2\n")
    with pytest.raises(ConfigError) as err:
        build_config([], str(tmp_path / "trl.yaml"))
    assert str(err.value) == (
        "3 unknown config keys: 'model_name_or_path'; did you mean 'model.path'? (TRL's GRPOConfig name; a local "
        "folder; nothing is downloaded) | 'num_generations'; did you mean 'train.group_size'? (TRL's GRPOConfig "
        "name) | "
        "'trian'; did you mean 'train'? (valid: alerts, analytics, backend, checkpoint, critic, curation, dpo, eval, "
        "log, model, "
        "objective, output_dir, prm, prompt, ray, recipe, reward, rm, rollout, seed, sft, task, threads, train)"
    )
    (tmp_path / "verl.yaml").write_text("data:\n  train_files: t.parquet\n  max_response_length: 64\n"
                                        "train:\n  steps: 2\n  lr_rate: 0.1\n")
    with pytest.raises(ConfigError) as err:
        build_config([], str(tmp_path / "verl.yaml"))
    assert str(err.value).startswith(
        "3 unknown config keys: 'data.train_files'; did you mean 'task.options.path'? (verl's name; with "
        "task.name=dataset) | 'data.max_response_length'; did you mean 'rollout.max_new_tokens'? (verl's name) | "
        "'train.lr_rate'")


def test_one_bad_row_after_good_ones_names_skip_invalid(tmp_path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "1+1?", "answer": "2"}\n{"prompt": "x", "answer": 3\n')
    with pytest.raises(DatasetError) as err:
        DatasetTask(str(path))
    assert str(err.value) == (f"'{path}', line 2: bad JSON: Expecting ',' delimiter at column 28; to skip such rows "
                              "instead: task.options.skip_invalid=true")
    assert DatasetTask(str(path), eval_path=str(path), skip_invalid=True).skipped == {str(path): 1}


def test_a_required_parameter_nothing_fills_is_refused_before_anything_loads(tmp_path) -> None:
    (tmp_path / "r.py").write_text(
        "def state(completions, trainer_state, **kwargs):\n    return [0.0] * len(completions)\n\n"
        "def column(completion, difficulty):\n    return 0.0\n\n"
        "def has_column(completions, ground_truth, **kwargs):\n    return [0.0] * len(completions)\n"
    )
    data = _plain_data(tmp_path / "d.jsonl")
    base = ["train", *MICRO, "sft.enabled=false", "task.name=dataset", f"task.options.path={data}",
            f"output_dir={tmp_path / 'run'}"]
    result = CliRunner().invoke(app, [*base, f"reward.functions=[{tmp_path / 'r.py'}:state]"])
    assert result.exit_code == 2 and not (tmp_path / "run").exists()
    assert (
        f"error: reward function '{tmp_path / 'r.py'}:state' needs 'trainer_state', which nothing passes: not an "
        "input of its form (prompts, completions, completion_ids), nor a column of the data (answer, ground_truth, "
        "prompt), nor one of its params; TRL's trainer_state is not passed (there is no transformers Trainer): give "
        "it a default, trainer_state=None"
    ) in " ".join(result.output.split())
    result = CliRunner().invoke(app, [*base, f"reward.functions=[{tmp_path / 'r.py'}:column]"])
    assert result.exit_code == 2 and "needs 'difficulty', which nothing passes" in result.output
    # A column of the data (ground_truth) fills it: the checks before the run pass.
    from reinforge.config import build_config as build
    from reinforge.jobs.start import prepare

    prepare(build([*base[1:], f"reward.functions=[{tmp_path / 'r.py'}:has_column]"]))


def test_a_list_of_gold_answers_says_the_verifier_takes_one(tmp_path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(
        json.dumps({"prompt": "2?", "reward_model": {"style": "rule", "ground_truth": ["2", "two"]}}) + "\n"
    )
    with pytest.raises(DatasetError) as err:
        DatasetTask(str(path))
    assert str(err.value) == (f"'{path}', line 1: field 'answer' must be str or int or float, got list; the verifiers "
                              "compare with one gold answer: map a column holding one with task.options.fields.answer="
                              "COLUMN (a reward function of your own still gets the whole list from the row)")
