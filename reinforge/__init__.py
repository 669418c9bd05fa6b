"""reinforge: reinforcement-learning post-training of language models with verifiable rewards.

`reinforge.train(...)` runs what `reinforge train` runs, from Python (reinforge/api.py,
docs/python-api.md); it returns a `RunResult`.
"""

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

__version__ = "0.1.0"

__all__ = ["RunResult", "__version__", "train"]


def __getattr__(name: str):
    # Imported on first use: `import reinforge` (and `reinforge --version`) stays light.
    if name in ("train", "RunResult"):
        from reinforge import api

        return getattr(api, name)
    raise AttributeError(f"module 'reinforge' has no attribute {name!r}")


# Modules that moved in 0.2 (docs/architecture.md): the old import paths keep working until 0.3, with a
# DeprecationWarning that names the new one. The old module object *is* the new one (no copy).
MOVED = {
    "reinforge.pipeline": "reinforge.jobs.train",
    "reinforge.trainers": "reinforge.jobs.rl",
    "reinforge.multistage": "reinforge.jobs.multistage",
    "reinforge.sweep": "reinforge.jobs.sweep",
    "reinforge.rm_job": "reinforge.jobs.reward_model",
    "reinforge.prm_job": "reinforge.jobs.process_reward_model",
    "reinforge.export": "reinforge.jobs.export",
    "reinforge.lifecycle": "reinforge.jobs.lifecycle",
    "reinforge.config_input": "reinforge.config.input",
    "reinforge.config_keys": "reinforge.config.keys",
    "reinforge.synonyms": "reinforge.config.synonyms",
    "reinforge.synonyms_openrlhf": "reinforge.config.synonyms_openrlhf",
    "reinforge.objective_config": "reinforge.settings.objective",
    "reinforge.catalogue": "reinforge.objectives.catalogue",
    "reinforge.user_rewards": "reinforge.rewards.user",
    "reinforge.loops.curation": "reinforge.curation.batches",
    "reinforge.loops.difficulty": "reinforge.curation.difficulty",
    "reinforge.loops.rejection": "reinforge.curation.rejection",
    "reinforge.telemetry.weight_sync": "reinforge.rollout.weight_sync",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old module path of MOVED and hands back the module at its new path."""

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name in MOVED else None

    def create_module(self, spec):
        new = MOVED[spec.name]
        warnings.warn(f"{spec.name} moved to {new}; the old path goes away in reinforge 0.3",
                      DeprecationWarning, stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module):
        pass       # the module at its new path has run already


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.append(_MovedModules())
