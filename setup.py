"""The optional native read loop (kvtier/_native/readloop.c, docs/architecture.md).

Everything else is in pyproject.toml. The extension is optional: where it
cannot be built (no C compiler, no Python headers), kvtier installs without
it and its directory tiers read with the Python driver (kvtier.tiers.dir.aiostream).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvtier._readloop",
            sources=["kvtier/_native/readloop.c"],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-missing-field-initializers",
                                "-Wno-cast-function-type", "-Wno-unused-parameter"],
            optional=True,
        )
    ]
)
