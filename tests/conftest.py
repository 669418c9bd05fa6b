"""Shared fixtures: micro configs and a saved tiny model directory."""

from __future__ import annotations

import os

import pytest
import torch

# Two xdist workers on two cores: one torch thread each avoids oversubscription.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

MICRO = [
    "model.hidden_size=32",
    "model.num_layers=1",
    "model.num_heads=2",
    "model.num_kv_heads=1",
    "model.intermediate_size=64",
    "sft.steps=3",
    "sft.batch_size=8",
    "sft.num_examples=32",
    "train.steps=3",
    "train.prompts_per_step=4",
    "train.group_size=4",
    "train.micro_batch_size=8",
    "rollout.max_new_tokens=4",
    "eval.num_prompts=6",
    "eval.num_samples=4",
    "log.progress=false",
    "threads=1",
]


@pytest.fixture
def micro_overrides() -> list[str]:
    return list(MICRO)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A built-in tiny model saved as a plain Hugging Face directory."""
    from reinforge.config import build_config
    from reinforge.models import build_tiny_qwen2, save_policy

    cfg = build_config(MICRO)
    path = tmp_path_factory.mktemp("tiny_model")
    save_policy(build_tiny_qwen2(cfg.model, seed=0), path)
    return str(path)
