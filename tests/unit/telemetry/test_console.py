"""The console: --version, `reinforge config`, train --help, and output that prints above the progress bars."""

from __future__ import annotations

import io
import re

import pytest
from typer.testing import CliRunner

from reinforge import __version__
from reinforge.cli import app
from reinforge.config import build_config, config_to_yaml
from reinforge.config.keys import config_keys
from reinforge.errors import ConfigError
from reinforge.telemetry.alerts import Alert
from reinforge.telemetry.console import BarSafeStream, bar_safe_console
from reinforge.telemetry.recorder import Recorder
from reinforge.telemetry.run_dir import RunDir

runner = CliRunner()


def test_version() -> None:
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output == f"reinforge {__version__}\n"


@pytest.mark.parametrize("args", [["--version"], ["--help"], ["train", "--help"]])
def test_help_and_version_do_not_import_torch(args: list[str]) -> None:
    # torch and transformers take seconds to import; --help and --version must answer without them.
    import subprocess
    import sys

    probe = ("import runpy, sys\n"
             f"sys.argv = ['reinforge', *{args!r}]\n"
             "try:\n    runpy.run_module('reinforge.cli', run_name='__main__')\n"
             "except SystemExit as stop:\n    code = stop.code or 0\n"
             "heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules)\n"
             "print('HEAVY', heavy, code)\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.stdout.splitlines()[-1] == "HEAVY [] 0", done.stdout + done.stderr


def test_train_help_says_how_to_list_every_key() -> None:
    result = runner.invoke(app, ["train", "--help"], env={"COLUMNS": "300"})
    assert (
        result.exit_code == 0 and "`reinforge config`" in result.output and "reinforge config rollout" in result.output
    )


def test_config_lists_every_key_with_its_doc_and_default() -> None:
    result = runner.invoke(app, ["config"], env={"COLUMNS": "120"})
    assert result.exit_code == 0
    keys = re.findall(r"^(\S+) = ", result.output, flags=re.MULTILINE)
    assert keys == [k.key for k in config_keys()]
    assert {
        "seed", "rollout.temperature", "train.lr", "log.samples_every", "model.lora.r", "reward.overlong.coef",
    } <= set(keys)
    assert (
        "rollout.temperature = 1.0  (float)\n    Sampling temperature for training rollouts and pass@k evaluation.\n"
        in result.output
    )
    assert "train.mode = sync  (sync|async)\n" in result.output


def test_config_of_one_section() -> None:
    result = runner.invoke(app, ["config", "rollout"], env={"COLUMNS": "120"})
    assert result.exit_code == 0
    assert re.findall(r"^(\S+) = (.*?)  \(", result.output, flags=re.MULTILINE) == [
        ("rollout.engine", "native"), ("rollout.vllm_gpu_memory_utilization", "0.1"),
        ("rollout.max_batch_rows", "null"), ("rollout.cpu_kernels", "true"),
        ("rollout.temperature", "1.0"), ("rollout.top_p", "1.0"), ("rollout.top_k", "0"),
        ("rollout.record_top_k", "0"), ("rollout.min_p", "0.0"), ("rollout.quantization", "none"),
        ("rollout.quantize_lm_head", "false"), ("rollout.max_new_tokens", "8"), ("rollout.stop", "[]"),
        ("rollout.tools", "null"),
        ("rollout.tool_parser", "auto"), ("rollout.tool_timeout_s", "10.0"), ("rollout.tool_max_chars", "4096"),
        ("rollout.max_tool_calls", "4"), ("rollout.max_turns", "8"), ("rollout.max_model_tokens", "null"),
        ("rollout.max_environment_tokens", "null"), ("rollout.continuation", "true")]
    bad = runner.invoke(app, ["config", "rolout"])
    assert bad.exit_code == 2 and "unknown config section 'rolout'; did you mean 'rollout'?" in bad.output


def test_config_of_a_recipe_shows_its_resolved_values() -> None:
    result = runner.invoke(app, ["config", "curation", "--recipe", "dapo"], env={"COLUMNS": "120"})
    assert result.exit_code == 0
    # reinforge/recipes/dapo.yaml: dynamic sampling (zero-variance filter, refill); marked as the preset's.
    assert "curation.filters = [zero_variance]  (list[zero_variance])  *\n" in result.output
    assert "curation.refill = dynamic  (none|dynamic|active)  *\n" in result.output
    assert re.search(r"^curation\.max_rounds = \d+  \(int\)$", result.output, flags=re.MULTILINE)   # a default: no mark
    overlong = {k.key: k for k in config_keys("reward", recipe="dapo")}["reward.overlong"]
    assert (
        overlong.changed
        and overlong.value is not None
        and {k.key: k for k in config_keys("reward")}["reward.overlong"].value is None
    )
    with pytest.raises(ConfigError, match="unknown recipe 'nope'"):
        config_keys(recipe="nope")


def test_bar_safe_console_prints_above_an_open_bar() -> None:
    from tqdm import tqdm

    out = io.StringIO()
    bar = tqdm(total=10, file=out, desc="rl", ascii=True, bar_format="{desc} {n}/{total}")
    bar.update(3)
    bar_safe_console(out).print("step 3: entropy collapsed")
    bar.update(1)
    bar.close()
    # tqdm.write clears the bar line ("\r" + spaces + "\r"), writes the message on its own line, and
    # redraws the bar after it: the message never shares a line with the bar.
    text = out.getvalue()
    assert "\rstep 3: entropy collapsed\n" in text.replace(" " * 8, "")
    assert text.index("step 3: entropy collapsed") < text.rindex("rl 3/10") < text.rindex("rl 4/10")


def test_recorder_alerts_and_sft_summary_go_through_the_bar_safe_writer(tmp_path, micro_overrides, monkeypatch) -> None:
    written: list[str] = []
    monkeypatch.setattr(
        "reinforge.telemetry.console.tqdm.write", lambda text, file=None, end="\n": written.append(text)
    )
    cfg = build_config([*micro_overrides, f"output_dir={tmp_path / 'run'}"])
    run_dir = RunDir(cfg.output_dir, config_to_yaml(cfg), cfg.rollout)
    recorder = Recorder(run_dir, cfg.log, cfg.alerts, recipe=cfg.recipe, rl_steps=cfg.train.steps,
                        resolved=cfg.model_dump(mode="json"))
    assert isinstance(recorder.console.file, BarSafeStream)
    recorder.start_rl(0)
    assert recorder._bar.n == 0      # the RL bar is up at step 0, before the first step has run
    recorder.alert_log.write([Alert(step=2, name="entropy_collapse", message="step 2: entropy collapsed", values={})])
    recorder.sft_done({"steps": 3, "first_loss": 4.5, "final_loss": 1.25}, 2.0)
    recorder.close()
    run_dir.close()
    assert written == ["step 2: entropy collapsed\n",
                       "sft: 3 steps, loss 4.500 -> 1.250 (mean of the last 10%), 2.0 s\n"]
