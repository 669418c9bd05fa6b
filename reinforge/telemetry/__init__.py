"""Run directory, console output and metric sinks."""

from reinforge.telemetry.run_dir import RunDir, default_output_dir

__all__ = ["RunDir", "default_output_dir"]
