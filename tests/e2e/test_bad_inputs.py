"""Bad input ends in one line on stderr (file, key or value, and what to do), exit status 2, and
nothing written; a real bug keeps its traceback (issue 20.4)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from reinforge.cli import app

runner = CliRunner()


def _refused(args: list[str], out: Path) -> str:
    """Run `reinforge train ARGS output_dir=OUT`; assert exit 2, one stderr line and nothing at OUT;
    return that line."""
    result = runner.invoke(app, ["train", *args, f"output_dir={out}"])
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output and result.stdout == ""
    assert not out.exists()
    return lines[0]


@pytest.fixture
def model_copy(tmp_path: Path, tiny_model_dir: str) -> Path:
    """A copy of the tiny model folder, to break."""
    return Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (
            lambda m: (m / "config.json").write_text('{"model_type": "qwen2",\n  "hidden_size": }'),
            "config.json: not valid JSON (line 2, column 18: Expecting value); repair it or save the model again "
            "with save_pretrained",
        ),
        (lambda m: (m / "config.json").write_text('["qwen2"]'), "config.json has no model_type"),
        (lambda m: (m / "config.json").unlink(), "has no config.json: it is not a Hugging Face model directory"),
        (
            lambda m: (m / "model.safetensors").unlink(),
            "holds no weights (none of model.safetensors, model.safetensors.index.json",
        ),
        (
            lambda m: [(m / f).unlink() for f in ("tokenizer.json", "tokenizer_config.json")],
            "holds no tokenizer (none of tokenizer.json, tokenizer.model, vocab.json",
        ),
        (lambda m: (m / "tokenizer.json").write_text('{"version": '), "its tokenizer does not load (Expecting value"),
    ],
)
def test_a_broken_model_folder_is_one_line(
    tmp_path: Path, micro_overrides, model_copy: Path, damage, message: str
) -> None:
    damage(model_copy)
    line = _refused([*micro_overrides, f"model={model_copy}"], tmp_path / "run")
    assert message in line and str(model_copy) in line


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(tmp_path: Path, micro_overrides, model_copy: Path) -> None:
    import json

    config = json.loads((model_copy / "config.json").read_text())
    tokens = config["vocab_size"]
    config["vocab_size"] = tokens - 1
    (model_copy / "config.json").write_text(json.dumps(config))
    line = _refused([*micro_overrides, f"model={model_copy}"], tmp_path / "run")
    assert f"its tokenizer has {tokens} tokens and the model's config.json vocab_size is {tokens - 1}" in line


def test_a_model_path_that_does_not_exist(tmp_path: Path, micro_overrides) -> None:
    line = _refused([*micro_overrides, f"model={tmp_path / 'nope'}"], tmp_path / "run")
    assert line == (f"error: model path '{tmp_path / 'nope'}' does not exist or is not a directory (no hub downloads: "
                    "give a local Hugging Face model directory, or model=builtin)")


@pytest.mark.parametrize(("text", "message"), [
    # The unclosed list starts on line 3; the parser notices on line 4, column 4.
    ("train:\n  steps: 3\n  lr: [1, 2\nsft:\n", "line 4, column 4: YAML syntax error: expected ',' or ']', but got ':' "
                                                  "(while parsing a flow sequence that starts at line 3)"),
    ("train:\n\tsteps: 3\n", "line 2, column 1: YAML syntax error: found character '\\t' that cannot start any token "
                             "(while scanning for the next token)"),
    ("- recipe: grpo\n", "must hold a mapping of keys (lines like 'recipe: grpo'), not a list"),
])
def test_a_bad_yaml_file_is_one_line(tmp_path: Path, micro_overrides, text: str, message: str) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    line = _refused([*micro_overrides, "--config", str(path)], tmp_path / "run")
    assert line == f"error: config file '{path}'{' ' if message.startswith('must') else ', '}{message}"


def test_a_missing_or_unreadable_config_file(tmp_path: Path, micro_overrides, monkeypatch) -> None:
    assert _refused(["--config", str(tmp_path / "no.yaml")], tmp_path / "run") == \
        f"error: config file '{tmp_path / 'no.yaml'}' does not exist: give a YAML file"
    assert _refused(["--config", str(tmp_path)], tmp_path / "run") == \
        f"error: config file '{tmp_path}' is a directory: give a YAML file"
    path = tmp_path / "run.yaml"
    path.write_text("seed: 1\n")

    def unreadable(self, *args, **kwargs):    # chmod does not stop root, who runs the tests here
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_text", unreadable)
    assert _refused(["--config", str(path)], tmp_path / "run") == \
        f"error: config file '{path}' cannot be read: Permission denied"


def test_an_unknown_recipe_names_the_value_and_the_closest(tmp_path: Path, micro_overrides) -> None:
    assert _refused([*micro_overrides, "recipe=grpoo"], tmp_path / "run") == \
        "error: unknown recipe 'grpoo'; did you mean 'grpo'? (`reinforge recipes` lists them)"


def test_an_output_dir_that_is_not_a_folder(tmp_path: Path, micro_overrides) -> None:
    file = tmp_path / "taken"
    file.write_text("mine")
    result = runner.invoke(app, ["train", *micro_overrides, f"output_dir={file}"])
    assert result.exit_code == 2 and result.stderr == \
        f"error: output_dir '{file}' is a file, not a folder: choose another output_dir\n"
    assert file.read_text() == "mine"
    assert (
        _refused(micro_overrides, file / "run")
        == f"error: output_dir '{file / 'run'}' cannot be created: '{file}' is a file, not a folder; choose another "
           "output_dir"
    )


def test_an_output_dir_without_write_permission(tmp_path: Path, micro_overrides, monkeypatch) -> None:
    import reinforge.telemetry.run_dir as run_dir

    locked = tmp_path / "locked"
    locked.mkdir()
    # As root (these tests' user) every folder is writable; the check's answer is what is under test.
    monkeypatch.setattr(run_dir.os, "access", lambda path, mode: Path(path) != locked)
    assert _refused(micro_overrides, locked / "run") == (
        f"error: output_dir '{locked / 'run'}' cannot be created: no permission to write in '{locked}'; "
        "choose an output_dir you can write to")
    assert list(locked.iterdir()) == []


def test_a_real_bug_keeps_its_traceback(tmp_path: Path, micro_overrides, monkeypatch) -> None:
    """Only user errors become one line: anything else propagates (CliRunner holds it)."""
    import reinforge.jobs.train

    def broken(cfg):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(reinforge.jobs.train, "prepare", broken)
    result = runner.invoke(app, ["train", *micro_overrides, f"output_dir={tmp_path / 'run'}"])
    assert result.exit_code == 1 and isinstance(result.exception, ZeroDivisionError)
    assert "error:" not in result.stderr


def test_resume_from_a_damaged_config_yaml_is_one_line(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("seed: 0\ntrain: {steps: 3\n")
    before = sorted(p.name for p in run.iterdir())
    result = runner.invoke(app, ["train", "--resume", str(run)])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert result.stderr.startswith(
        f"error: config file '{run / 'config.yaml'}', line 3, column 1: YAML syntax error: "
    )
    assert len(result.stderr.splitlines()) == 1
    (run / "config.yaml").write_text("seed: 0\ntrain: {steps: -1}\n")
    result = runner.invoke(app, ["train", "--resume", str(run)])
    assert result.exit_code == 2 and result.stderr == (
        f"error: --resume: {run / 'config.yaml'} is not a valid config (invalid configuration: train.steps: "
        "Input should be greater than or equal to 0)\n")
    assert sorted(p.name for p in run.iterdir()) == before
