"""The one compiled part: rolloutcli/core/_native.c, the GAE kernel of ``rolloutcli gae`` on the CPU and the
row gathers of ``rolloutcli batch``, called through ctypes (rolloutcli/core/native.py).

Optional: where it cannot be compiled, the install goes on and rolloutcli uses numba (GAE) and torch (gathers)
instead: the same results, ~0.28 s more start-up for ``gae`` and slower exports. Metadata is in pyproject.toml.
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
        )
    ]
)
