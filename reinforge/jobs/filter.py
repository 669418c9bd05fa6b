"""The offline difficulty filter (`reinforge filter OUT`): the train prompts whose pass rate over k
samples of the policy lies in [lo, hi], written as JSONL that `task.name=dataset` reads back.

Started like every job (jobs/start.py): checked, seeded, the policy of model.path and its engine
(episodes when the run has tools or an environment); curation/difficulty.py measures and writes.
"""

from __future__ import annotations

from pathlib import Path

from reinforge.config import Config
from reinforge.curation.difficulty import DifficultyReport, pass_rates, write_filtered
from reinforge.jobs.start import start
from reinforge.rollout import SamplingParams


def run_filter(cfg: Config, out: str | Path, k: int, lo: float, hi: float) -> DifficultyReport:
    """The train prompts with lo <= pass rate <= hi over `k` samples at the run's sampling settings,
    written to `out`; the report has every prompt's pass rate."""
    job = start(cfg)
    examples = job.task.train_split(cfg.train.num_prompts)
    rates = pass_rates(job.engine, job.task, examples, k, SamplingParams.from_config(cfg.rollout))
    return write_filtered(Path(out), examples, rates, lo, hi)
