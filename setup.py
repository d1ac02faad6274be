"""Builds the three compiled modules with the package: `replay.capture.codec._wire` (the recording thread's column passes),
`replay.capture.codec._pack` (a chunk's logprob columns, packed when it is sealed) and `replay.capture.writing._emit` (the sealed
chunks compressed and written on threads that never take the GIL, with the system's libzstd.so.1, loaded at import).

All are optional: where no C compiler is found the build goes on without them, and `replay.capture.codec.fastwire`,
`replay.capture.codec.columns` and `replay.capture.writing.emitter` take their Python paths (the same records, slower). Everything
else is declared in pyproject.toml.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension(f"replay.capture.{room}.{name}", [f"replay/capture/{room}/{name}.c"], optional=True,
                             extra_compile_args=["-O2"])
                   for room, name in (("codec", "_wire"), ("codec", "_pack"), ("writing", "_emit"))])
