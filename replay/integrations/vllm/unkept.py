"""Fields this vLLM sends that a capture does not keep (`replay.contracts.unkept`), watched on the engine thread: the
first time a request or a step actually sets one (not None, False, zero or empty), the engine's log says which, once
per field, so that a capture never drops something that mattered in silence. Fields left at their defaults, which
is nearly always, cost a few attribute reads per new request and step."""

from __future__ import annotations

import logging
from typing import Any

from replay.contracts.unkept import unkept

log = logging.getLogger("vllm.replay")
_SCALARS = (bool, int, float, str, bytes, list, tuple, dict, set, frozenset)


def _set(value: Any) -> bool:
    """A value a sender set: anything but None, False, zero or empty (an array or a tensor counts as set)."""
    return value is not None and (bool(value) if isinstance(value, _SCALARS) else True)


class UnkeptFields:
    """Watches the fields `header` says this vLLM has and captures do not keep."""

    def __init__(self, header: Any) -> None:
        self.fields: dict[str, list[str]] = {}
        for name in unkept(header.extra.get("vllm_unmirrored_fields")):
            cls, _, field = name.partition(".")
            self.fields.setdefault(cls, []).append(field)
        self.said: set[str] = set()

    def _check(self, cls: str, obj: Any, where: str) -> None:
        try:
            for field in self.fields.get(cls, ()):
                if f"{cls}.{field}" not in self.said and _set(getattr(obj, field, getattr(obj, "_" + field, None))):
                    self.said.add(f"{cls}.{field}")
                    log.warning("replay: %s sets %s.%s, which a capture does not keep: recorded without it, so a "
                                "replay of what it changes may differ", where, cls, field)
        except Exception as e:  # noqa: BLE001 - never raise on vLLM's engine thread: stop watching, and say so
            self.fields = {}
            log.warning("replay: cannot watch the fields a capture does not keep (%s: %s); recording goes on",
                        type(e).__name__, e)

    def request(self, request: Any) -> None:
        """A request vLLM's scheduler takes (its EngineCoreRequest fields and sampling parameters)."""
        if self.fields:
            rid = getattr(request, "request_id", "?")  # (a plain attribute: nothing here raises)
            self._check("EngineCoreRequest", request, f"request {rid}")
            if getattr(request, "sampling_params", None) is not None:
                self._check("SamplingParams", request.sampling_params, f"request {rid}")

    def scheduled(self, so: Any) -> None:
        """A step's SchedulerOutput, its new requests and its cached ones."""
        if self.fields:
            self._check("SchedulerOutput", so, "a step")
            for new in getattr(so, "scheduled_new_reqs", None) or ():
                self._check("NewRequestData", new, f"request {new.req_id}")
            self._check("CachedRequestData", getattr(so, "scheduled_cached_reqs", None), "a step")

    def output(self, mro: Any) -> None:
        """A step's ModelRunnerOutput."""
        if self.fields:
            self._check("ModelRunnerOutput", mro, "a step's output")
