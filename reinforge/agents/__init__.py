"""Agentic RL: what a policy that acts through tools and environments needs besides the single-turn loop.

Today these are building blocks (docs/agents.md): the tool layer, reinforge/agents/tools.py (tool
schemas, parsing calls out of model text, bounded execution), and the environment protocol,
reinforge/agents/environment.py (checking a user's class, playing one episode into a trajectory
record). The multi-turn rollout that would use them is not built yet.
"""
