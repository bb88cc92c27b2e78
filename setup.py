"""The native CPU kernels (``dsv4/_kernels.c``, loaded with ctypes by ``dsv4.native``); all other
metadata is in ``pyproject.toml``.

The extension is optional: an install without a C compiler still succeeds, and the operators
then run ATen's ops, which compute the same (``dsv4.native.reason`` says why the kernels are
absent). The compiler never contracts products and sums into FMAs (each kernel states how it
rounds); the products' kernels use FMA instructions explicitly, chosen at run time."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "dsv4._kernels",
            sources=["dsv4/_kernels.c"],
            libraries=["m"],
            extra_compile_args=["-O3", "-ffp-contract=off"],
            optional=True,
        )
    ]
)
