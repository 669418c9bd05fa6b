"""The reward sources reinforge ships, by their `reward.<field>` config section: `SOURCE_BUILDERS`, and
`build_sources` / `configured_sources` over a RewardConfig.

This module sits above the sources' modules (judge.py, reward_model.py, process.py, teacher.py), which
import only the records of rewards/sources.py; it imports transformers' model classes through them,
so the config checks import it inside the check that needs it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from reinforge.rewards import judge, process, reward_model, teacher
from reinforge.rewards.sources import RewardSource, SourceContext

# reward config field -> builder(section, context). The order is the order the composer scores and sums the
# sources in (a run with two sources adds their rewards in this order).
SOURCE_BUILDERS: dict[str, Callable[[Any, SourceContext], RewardSource]] = {
    "judge": judge.build_source,
    "model": reward_model.build_source,
    "process": process.build_source,
    "teacher": teacher.build_source,
}


def build_sources(reward_cfg: Any, context: SourceContext) -> list[RewardSource]:
    """The sources whose sections are set in `reward_cfg` (a RewardConfig), in the order of SOURCE_BUILDERS."""
    return [builder(section, context) for name, builder in SOURCE_BUILDERS.items()
            if (section := getattr(reward_cfg, name, None)) is not None]


def configured_sources(reward_cfg: Any) -> list[str]:
    """The names of the source sections set in `reward_cfg`, without building anything."""
    return [name for name in SOURCE_BUILDERS if getattr(reward_cfg, name, None) is not None]


__all__ = ["SOURCE_BUILDERS", "build_sources", "configured_sources"]
