"""Build of the compiled full-vocabulary kernel; everything else is in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "logitdiff.numerics._kernel",
            sources=["src/logitdiff/numerics/_kernel.cpp"],
            language="c++",
            # No -ffast-math: the kernel relies on IEEE NaN/inf semantics. AVX2/FMA code is
            # compiled per function (target attributes) and chosen at run time.
            extra_compile_args=["-O3", "-std=c++17", "-fvisibility=hidden"],
            extra_link_args=["-pthread"],
        )
    ],
)
