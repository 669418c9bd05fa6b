"""reinforge: reinforcement-learning post-training of language models with verifiable rewards.

`reinforge.train(...)` runs what `reinforge train` runs, from Python (reinforge/api.py,
docs/python-api.md); it returns a `RunResult`.
"""

__version__ = "0.1.0"

__all__ = ["RunResult", "__version__", "train"]


def __getattr__(name: str):
    # Imported on first use: `import reinforge` (and `reinforge --version`) stays light.
    if name in ("train", "RunResult"):
        from reinforge import api

        return getattr(api, name)
    raise AttributeError(f"module 'reinforge' has no attribute {name!r}")
