"""Builds the two compiled modules with the package: `replay.capture._wire` (the recording thread's column passes)
and `replay.capture._pack` (a chunk's logprob columns, packed when it is sealed).

Both are optional: where no C compiler is found the build goes on without them, and `replay.capture.fastwire` and
`replay.capture.columns` take their Python paths (the same bytes, slower). Everything else is declared in pyproject.toml.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension(f"replay.capture.{name}", [f"replay/capture/{name}.c"], optional=True,
                             extra_compile_args=["-O2"]) for name in ("_wire", "_pack", "_emit")])
