"""The compiled part of kvfabric; everything else is configured in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        # optional: without a C compiler the install still succeeds and
        # kvfabric.memory.strided falls back to Tensor.copy_
        Extension(
            "kvfabric.memory._strided",
            ["kvfabric/memory/_strided.c"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
        # optional too: without it kvfabric.hashing converts token lists with numpy
        Extension(
            "kvfabric._tokens",
            ["kvfabric/_tokens.c"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
    ],
)
