"""Capture headers: provenance stamped with this tool's version and format."""

from __future__ import annotations

import re
import time
from typing import Any

from replay import __version__
from replay.capture.format.records import (
    FORMAT_MAJOR,
    FORMAT_MINOR,
    EngineConfig,
    Environment,
    Header,
    ModelIdentity,
)
from replay.provenance.environment import current_environment


def make_header(engine: str, *, engine_version: str = "", model: ModelIdentity | None = None,
                engine_config: EngineConfig | None = None, environment: Environment | None = None,
                extra: dict[str, Any] | None = None) -> Header:
    """A Header stamped with this tool's version and format, now."""
    return Header(
        format_version=(FORMAT_MAJOR, FORMAT_MINOR),
        tool_version=__version__,
        created=time.time(),
        engine=engine,
        engine_version=engine_version,
        model=model,
        engine_config=engine_config or EngineConfig(),
        environment=environment or current_environment(with_torch=False),
        extra=extra or {},
    )


def major_minor(version: str | None) -> tuple[int, int] | None:
    """(major, minor) of a version string ("0.32.0+cpu" -> (0, 32)); None when it has no two numbers."""
    parts = re.findall(r"\d+", version or "")[:2]
    return (int(parts[0]), int(parts[1])) if len(parts) == 2 else None
