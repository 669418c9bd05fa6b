"""Training loops: cold-start SFT, RL (synchronous and asynchronous, the one step in loop.py),
DPO and self-play, and credit assignment (a critic's GAE, greedy baselines).

Each loop takes the small typed settings it needs and the parts wired by the jobs (jobs/rl.py):
the batches come from reinforge.curation, the update from reinforge.learner.
"""
