"""Rewards: what turns a step's completions into scores.

Composition of reward functions, verifiers and learned sources (`compose`, `sources`, `functions`,
`conventions`), the learned ones themselves (reward models, process reward models, generative judges,
teachers) and their training. The verifiers they build on live one floor below, in
`reinforge.verifiers` (math, integer, countdown, code and its sandbox).
"""
