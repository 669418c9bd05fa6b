"""Agentic RL: what a policy that acts through tools needs besides the single-turn loop.

Today this is the tool layer alone, reinforge/agents/tools.py (docs/agents.md):
tool schemas, parsing calls out of model text, and bounded execution. The
multi-turn rollout that would use it is not built yet.
"""
