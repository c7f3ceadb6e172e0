"""Build of ``tenzro_rowwise``: the fixed-order dense product of ``moe.rowwise`` (``pip install ./native_rowwise``).

``-ffp-contract=off`` keeps every multiply and add a separate IEEE operation, so the
AVX-512, AVX2 and baseline clones (chosen at run time) give the same bits as each other and
as the numba fallback in ``moe/rowwise.py``.
"""
from setuptools import Extension, setup

setup(
    name="tenzro-rowwise",
    version="0.1.0",
    ext_modules=[Extension(
        "tenzro_rowwise",
        sources=["_rowwise.c"],
        extra_compile_args=["-O3", "-ffp-contract=off", "-fno-fast-math", "-fopenmp", "-std=c11", "-Wno-psabi"],
        extra_link_args=["-fopenmp"],
    )],
)
