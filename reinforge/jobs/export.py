"""`reinforge export`: a run's model as a plain Hugging Face folder.

The weights come from the run's newest checkpoint (or the checkpoint of a
given step), else from its final RUN_DIR/model; LoRA adapters are merged into
them. Next to them: the config, the tokenizer, and a generation config whose
sampling defaults are the run's rollout settings. The folder loads with
`AutoModelForCausalLM.from_pretrained` and needs no reinforge (the built-in
character tokenizer loads with `PreTrainedTokenizerFast.from_pretrained`; see
models/tokenizer.py for why not `AutoTokenizer`).
"""

from __future__ import annotations

from pathlib import Path

from reinforge.config import Config
from reinforge.config.load import resume_config
from reinforge.errors import ConfigError
from reinforge.models import Policy, load_policy, save_policy
from reinforge.settings import ModelConfig
from reinforge.telemetry.checkpoint import CheckpointDamaged, CheckpointStore


def export_model(run_dir: Path, out: Path, step: int | None = None) -> Path:
    """Write the model of the run in `run_dir` to `out` (created; an existing one must be an empty
    folder) and return `out`. `step`: the checkpoint to export; None: the newest, else RUN_DIR/model.

    Raises ConfigError when `run_dir` holds no run, has no checkpoint of `step`, or has no weights
    at all, and when `out` is not empty; nothing is written then.
    """
    run_dir, out = Path(run_dir), Path(out)
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"'{run_dir}' holds no run (no config.yaml): give a run directory of `reinforge train`")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"'{out}' already exists and is not an empty folder: choose another --out, or remove it")
    cfg, policy = run_policy(run_dir, step, command="export")
    save_policy(policy, out, cfg.rollout)
    return out


def run_policy(run_dir: Path, step: int | None = None, command: str = "serve") -> tuple[Config, Policy]:
    """The config of the run in `run_dir` and its policy with the weights of checkpoint `step` (None: the
    newest, else RUN_DIR/model); ConfigError as export_model's."""
    if not (Path(run_dir) / "config.yaml").is_file():
        raise ConfigError(f"'{run_dir}' holds no run (no config.yaml): give a run directory of `reinforge train`")
    cfg = resume_config(run_dir, command=command, rewards=False)
    return cfg, _trained_policy(Path(run_dir), cfg, step)


def _trained_policy(run_dir: Path, cfg: Config, step: int | None) -> Policy:
    """The run's policy with the weights of checkpoint `step` (None: the newest), else of RUN_DIR/model."""
    store = CheckpointStore(run_dir / "checkpoints", cfg.checkpoint.keep_last)
    if step is None:
        checkpoint = store.latest()
    else:
        found = {c.step: c for c in store.all()}
        if step not in found:
            raise ConfigError(f"'{run_dir}' has no checkpoint of step {step} (checkpoints of steps: "
                              f"{', '.join(map(str, sorted(found))) or 'none'})")
        checkpoint = found[step]
    if checkpoint is not None:
        # The run's own architecture (and LoRA adapters), so that the checkpoint's state_dict fits it.
        policy = load_policy(cfg.model, cfg.seed)
        try:     # checked against its manifest: a damaged checkpoint is named, never exported
            tensors = checkpoint.load().tensors
        except CheckpointDamaged as err:
            raise ConfigError(f"checkpoint {checkpoint.path} is damaged ({err}): export another with --step") from None
        policy.model.load_state_dict(tensors["model"])
        return policy
    final = run_dir / "model"
    if not (final / "config.json").is_file():
        raise ConfigError(f"'{run_dir}' has no checkpoint and no final model (model/): its run stopped before RL")
    return load_policy(ModelConfig(path=str(final), dtype=cfg.model.dtype), cfg.seed)   # merged already
