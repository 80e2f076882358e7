"""Build the native CPU kernels (commopt_ext/_cpu) and deadlines (commopt_ext/_deadline) as part
of the normal install.

Both are plain C++ with a C ABI, loaded with ctypes (commopt/kernels/native.py,
commopt/comm/deadline.py), so they compile in seconds and do not depend on torch headers.
Without a C++ compiler the install still succeeds: the build skips them, commopt runs its torch
reference kernels (slower; one warning says so at the first encode) and bounds its Horovod calls
with faulthandler instead. COMMOPT_REQUIRE_NATIVE=1 makes a failed build an error instead.
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
        ),
        # Deadlines watched by a native thread (commopt/comm/deadline.py): they end a process
        # whose Python threads are all frozen behind a blocked call that holds the GIL.
        Extension(
            "commopt_ext._deadline",
            sources=["commopt_ext/deadline.cpp"],
            extra_compile_args=["-O2", "-std=c++17", "-pthread"],
            extra_link_args=["-pthread"],
            language="c++",
            optional=not os.environ.get("COMMOPT_REQUIRE_NATIVE"),
        ),
    ]
)
