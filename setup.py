"""The build's one compiled part, optional: gradwatch.publisher._native (see gradwatch/publisher/_native.c).

Everything else is in pyproject.toml. ``optional=True``: without a C compiler the install still succeeds
and the steady step takes its pure-Python path (docs/design.md, "The native steady step").
"""

import sys

from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "gradwatch.publisher._native", ["gradwatch/publisher/_native.c", "gradwatch/publisher/_native_norms.c",
                                     "gradwatch/publisher/_native_shim.c"],
    depends=["gradwatch/publisher/_native.h"], optional=True,
    extra_compile_args=[] if sys.platform == "win32" else ["-O3", "-fno-strict-aliasing", "-pthread"],
    libraries=["dl"] if sys.platform.startswith("linux") else [],  # dlopen, for _native_shim.c (glibc < 2.34)
)])
