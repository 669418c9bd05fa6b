"""Curation: which prompts and samples reach training, decided from the policy's own samples.

- `batches.py`: one RL step's batch: prompts drawn from the pool, groups kept or dropped by filters
  (DAPO's dynamic sampling, zero-variance, retired prompts), refills; the `Scores` of a step.
- `difficulty.py`: the offline difficulty filter (`reinforge filter`): pass rates over k samples.
- `rejection.py`: rejection-sampling SFT data (verified samples of the policy or a teacher) and
  distillation traces read from a file.

Below the loops (which draw their batches here) and above rollout, tasks and data.
"""
