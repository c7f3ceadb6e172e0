"""Build of ``tenzro_kernels``: the native quantized dot products of the CPU backend and the base64
codec of the data plane's JSON frames (``moe.wire.b64decode``/``b64encode_bytes``).

``pip install ./native`` (run by ``make``'s venv step). ``-ffp-contract=off`` keeps every float
operation a separate IEEE operation so the SIMD paths and the portable path are bit-identical;
the SIMD functions carry their own target attributes and are chosen at run time.
"""
from setuptools import Extension, setup

setup(
    name="tenzro-kernels",
    version="0.1.0",
    ext_modules=[Extension(
        "tenzro_kernels",
        sources=["_kernels.c"],
        depends=["x8_kernels.h"],
        extra_compile_args=["-O3", "-ffp-contract=off", "-fno-fast-math", "-fopenmp", "-std=c11"],
        extra_link_args=["-fopenmp"],
    )],
)
