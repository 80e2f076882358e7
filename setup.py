"""Build the native CPU kernels (commopt_ext/_cpu) as part of the normal install.

The library is plain C++ with a C ABI, loaded with ctypes by commopt/kernels.py, so it
compiles in seconds and does not depend on torch headers.
"""

import os

from setuptools import Extension, setup

extra = ["-O3", "-std=c++17", "-fopenmp", "-fno-math-errno", "-funroll-loops"]
if os.environ.get("COMMOPT_NATIVE_ARCH"):  # opt-in: tune for the build machine
    extra.append("-march=native")

setup(
    ext_modules=[
        Extension(
            "commopt_ext._cpu",
            sources=["commopt_ext/cpu_kernels.cpp"],
            extra_compile_args=extra,
            extra_link_args=["-fopenmp"],
            language="c++",
        )
    ]
)
