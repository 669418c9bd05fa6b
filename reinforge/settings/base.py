"""The base of every config section."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A config section: unknown keys are refused, and assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
