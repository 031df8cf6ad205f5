"""The one compiled part: rolloutcli/core/_native.c, the CPU GAE kernel and the row gathers of ``rolloutcli batch``,
called through ctypes (rolloutcli/core/native.py).

Optional: where it cannot be compiled, the install goes on and rolloutcli runs the same float32 operations in
numpy (GAE: the same bits, only slower) and torch indexing (gathers: the same bytes). Metadata is in
pyproject.toml.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "rolloutcli.core._native",
            sources=["rolloutcli/core/_native.c"],
            # -ffp-contract=off: no fused multiply-add, so the float32 results equal RSL-RL's bit for bit.
            extra_compile_args=["-O3", "-ffp-contract=off", "-fno-fast-math", "-fvisibility=hidden"],
            optional=True,
        ),
        Extension(  # the n-step kernel (rolloutcli/core/nstep.py; torch gives the same bits without it)
            "rolloutcli.core._nstep_native",
            sources=["rolloutcli/core/_nstep.c"],
            extra_compile_args=["-O3", "-ffp-contract=off", "-fno-fast-math", "-fvisibility=hidden"],
            optional=True,
        ),
    ]
)
