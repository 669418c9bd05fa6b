"""What a run shows and keeps: the run directory, console output, metric sinks, alerts, reports, the
hang watchdog, the weight-sync probe and checkpoints."""

from reinforge.telemetry.run_dir import RunDir, default_output_dir

__all__ = ["RunDir", "default_output_dir"]
