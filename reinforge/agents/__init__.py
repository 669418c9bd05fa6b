"""Agentic RL: samples that are conversations with tools and environments (docs/agents.md).

- `tools.py`: tool schemas, parsing calls out of model text, bounded execution; `tool_env.py`: a tool
  box played as an environment.
- `environment.py`: the environment protocol and the checks of a user's class; `episode.py`: one
  episode played a step at a time, and the metrics of a batch of them.
- `render.py`: conversations as tokens (chat template or plain text); `rollout.py`: the agent engine that
  plays a batch of episodes with the run's engine and returns the learner's `Rollout`; `workers.py`: the
  same in the asynchronous loop's sampler thread; `setup.py`: whether a run is multi-turn, from its config.
"""
