"""Training loops: SFT (cold start) and synchronous RL."""
