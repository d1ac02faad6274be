"""Builds the one compiled module, `replay.capture._wire` (the recording thread's column passes), with the package.

It is optional: where no C compiler is found the build goes on without it, and `replay.capture.fastwire` takes
its Python path (the same bytes, slower). Everything else is declared in pyproject.toml.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("replay.capture._wire", ["replay/capture/_wire.c"], optional=True,
                             extra_compile_args=["-O2"])])
