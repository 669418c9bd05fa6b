"""Every job starts through the one bootstrap (jobs/start.py): the cross-section checks, then the seed
(with the run's threads) and the policy, then the engine and the agent setup; and the old import paths of
the modules that moved keep working, with a warning that names the new one."""
from __future__ import annotations

import importlib
import sys
import warnings
from pathlib import Path

import pytest

from reinforge.config import build_config
from reinforge.jobs import start


class Started(BaseException):
    """Raised once the bootstrap is done, so that a test stops the job there (a BaseException: jobs that
    catch a run's Exception, the sweep's in-process runs, let it through)."""


@pytest.fixture
def bootstrap(monkeypatch):
    """The bootstrap's steps in the order they ran, with their arguments; the job stops after the last."""
    calls: list[tuple] = []
    check_run, seed, build_agent = start.check_run, start.seed_everything, start.build_agent

    def spy_check(cfg, task, spec):
        calls.append(("checks", cfg.recipe))
        return check_run(cfg, task, spec)

    def spy_seed(value):
        calls.append(("seed", value))
        return seed(value)

    def spy_agent(*args, **kwargs):
        calls.append(("agent setup",))
        build_agent(*args, **kwargs)
        raise Started()

    monkeypatch.setattr(start, "check_run", spy_check)
    monkeypatch.setattr(start, "seed_everything", spy_seed)
    monkeypatch.setattr(start, "build_agent", spy_agent)
    return calls


def _cfg(micro_overrides, tmp_path: Path, *extra: str):
    return build_config([*micro_overrides, "seed=7", *extra, f"output_dir={tmp_path / 'run'}"])


def test_train_job(bootstrap, micro_overrides, tmp_path):
    from reinforge.jobs.train import run

    with pytest.raises(Started):
        run(_cfg(micro_overrides, tmp_path))
    assert bootstrap == [("checks", "grpo"), ("seed", 7), ("agent setup",)]


def test_dpo_through_the_train_job(bootstrap, micro_overrides, tmp_path):
    from reinforge.jobs.train import run

    with pytest.raises(Started):
        run(_cfg(micro_overrides, tmp_path, "recipe=dpo"))
    assert bootstrap == [("checks", "dpo"), ("seed", 7), ("agent setup",)]


def test_reward_model_job(bootstrap, micro_overrides, tmp_path):
    from reinforge.jobs.reward_model import run_reward_model_job

    with pytest.raises(Started):
        run_reward_model_job(_cfg(micro_overrides, tmp_path, "rm.num_prompts=4"), tmp_path / "rm")
    assert bootstrap == [("checks", "grpo"), ("seed", 7), ("agent setup",)]


def test_process_reward_model_job(bootstrap, micro_overrides, tmp_path):
    from reinforge.jobs.process_reward_model import run_process_reward_model_job

    with pytest.raises(Started):
        run_process_reward_model_job(_cfg(micro_overrides, tmp_path, "task.name=chain_sum"), tmp_path / "prm")
    assert bootstrap == [("checks", "grpo"), ("seed", 7), ("agent setup",)]


def test_filter_job(bootstrap, micro_overrides, tmp_path):
    from reinforge.jobs.filter import run_filter

    with pytest.raises(Started):
        run_filter(_cfg(micro_overrides, tmp_path), tmp_path / "kept.jsonl", k=2, lo=0.1, hi=0.9)
    assert bootstrap == [("checks", "grpo"), ("seed", 7), ("agent setup",)]


def test_multistage_job(bootstrap, micro_overrides, tmp_path):
    from reinforge.jobs.multistage import run_pipeline

    with pytest.raises(Started):
        run_pipeline("r1_zero", [*micro_overrides, "seed=7"], tmp_path / "pipe")
    # The first stage is checked before any stage runs, then each stage starts as a train job.
    assert [c[0] for c in bootstrap] == ["checks", "checks", "seed", "agent setup"]
    assert ("seed", 7) in bootstrap


def test_sweep_job(bootstrap, micro_overrides, tmp_path):
    from reinforge.jobs.sweep import run_sweep

    with pytest.raises(Started):
        run_sweep([*micro_overrides, "seed=7,8"], tmp_path / "sweep", jobs=1)
    # Every combination is checked before any runs (seed=7 and seed=8), then the first starts as a train job.
    assert bootstrap == [("checks", "grpo")] * 3 + [("seed", 7), ("agent setup",)]


def test_the_agent_setup_gives_the_jobs_episodes_when_tools_are_configured(micro_overrides, tmp_path):
    # What the reward-model jobs and the filter skipped before they started here: with tools, the engine
    # every job samples with plays episodes.
    from reinforge.agents.rollout import AgentEngine

    cfg = _cfg(micro_overrides, tmp_path, "task.name=multiply_tool", "rollout.max_new_tokens=8")
    job = start.start(cfg)
    assert isinstance(job.engine, AgentEngine)
    assert isinstance(start.start(_cfg(micro_overrides, tmp_path)).engine, type(job.engine.engine))


@pytest.mark.parametrize("old, new", [("reinforge.pipeline", "reinforge.jobs.train"),
                                      ("reinforge.trainers", "reinforge.jobs.rl"),
                                      ("reinforge.config_keys", "reinforge.config.keys"),
                                      ("reinforge.user_rewards", "reinforge.rewards.user"),
                                      ("reinforge.loops.curation", "reinforge.curation.batches")])
def test_an_old_import_path_is_the_moved_module_with_a_warning(old, new):
    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    assert [str(w.message) for w in caught if w.category is DeprecationWarning] == [
        f"{old} moved to {new}; the old path goes away in reinforge 0.3"]


def test_the_sections_still_import_from_the_config():
    from reinforge.config import ModelConfig
    from reinforge.settings import ModelConfig as Declared

    assert ModelConfig is Declared
