"""The policy as a service: an OpenAI-compatible endpoint served by the run's engine, and agents trained
through it (docs/agents.md).

- `sampler.py`: the engine sampling requests from many threads (continuous batching on the native engine);
- `records.py`: what is recorded of each episode's calls, and the trajectory built from it;
- `chat.py`: chat requests as tokens (continuing a conversation without re-tokenising it), tool calls;
- `endpoint.py`: the routes, the episodes' keys, the run's sampling settings; `http.py`: its HTTP server;
- `agent.py`: agent functions (`task.agent`) as a rollout engine; `trl_env.py`: TRL environment classes;
- `setup.py`: from a run's config; `run.py`: `reinforge serve RUN_DIR`.
"""
