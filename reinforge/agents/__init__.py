"""Multi-turn agents: tools and environments."""
