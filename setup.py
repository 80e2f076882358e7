"""Build the native CPU kernels (commopt_ext/_cpu) as part of the normal install.

The library is plain C++ with a C ABI, loaded with ctypes by commopt/kernels/native.py, so it
compiles in seconds and does not depend on torch headers. Without a C++ compiler the install
still succeeds: the build skips the library and commopt runs its torch reference kernels
(slower; one warning says so at the first encode). COMMOPT_REQUIRE_NATIVE=1 makes a failed
build an error instead.
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
            optional=not os.environ.get("COMMOPT_REQUIRE_NATIVE"),
        )
    ]
)
