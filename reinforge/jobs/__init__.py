"""Jobs: what the command line and `reinforge.train` run, each started through one bootstrap.

- `start.py`: the bootstrap every job starts through (checks, task and objective, seed and threads,
  the policy, its engine or agent engine).
- `train.py`: the default job (`reinforge train`): cold-start SFT, RL or DPO, held-out evaluation,
  checkpoints and resume; `rl.py` wires one RL step (`RLStep`) and DPO from the config;
  `lifecycle.py`: refusals, interrupts and the resume line.
- `multistage.py` (`reinforge pipeline`), `sweep.py` and `sweep_table.py` (`reinforge sweep`),
  `reward_model.py`, `process_reward_model.py`, `filter.py` (`reinforge filter`), `export.py`.

The top floor below the command line: jobs read the whole `Config` (reinforge.config) and hand each
part below them the section it takes.
"""
