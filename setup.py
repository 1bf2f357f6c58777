"""The compiled part of kvfabric; everything else is configured in pyproject.toml.

Both C kernels are optional, and so is a compiler: without them kvfabric.memory.strided falls
back to Tensor.copy_ and kvfabric.hashing converts token lists with numpy. A kernel that does
not build (no compiler, no Python headers, a compile error) leaves a warning and the install
goes on pure Python. ``KVFABRIC_NO_EXTENSION=1`` does not try: the wheel is then pure Python
(``py3-none-any``), one for every platform and supported Python.
"""

import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

NO_EXTENSION_ENV = "KVFABRIC_NO_EXTENSION"


class OptionalBuildExt(build_ext):
    """``optional=True`` alone reports a failed kernel as a bare "building ... failed"; this
    says what it costs (pip shows it with ``-v``, setuptools always) and never fails the
    install, whatever the compiler raised."""

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:  # CompileError, a missing compiler, LinkError, ...
            print(
                f"WARNING: kvfabric: the optional C kernel {ext.name} was not built "
                f"({type(exc).__name__}: {exc}); kvfabric uses its pure-Python path instead "
                f"(set {NO_EXTENSION_ENV}=1 to skip the attempt)",
                file=sys.stderr,
            )


def extensions() -> list[Extension]:
    if os.environ.get(NO_EXTENSION_ENV, "").strip() not in ("", "0"):
        return []
    return [
        # without it kvfabric.memory.strided falls back to Tensor.copy_
        Extension(
            "kvfabric.memory._strided",
            ["kvfabric/memory/_strided.c"],
            depends=["kvfabric/memory/bytecopy.h"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
        # without it kvfabric.hashing converts token lists with numpy
        Extension(
            "kvfabric._tokens",
            ["kvfabric/_tokens.c"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
    ]


setup(ext_modules=extensions(), cmdclass={"build_ext": OptionalBuildExt})
