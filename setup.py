"""The one compiled part: the GAE kernel of ``rolloutcli gae`` on the CPU (rolloutcli/core/_gae_c.c).

Optional: where it cannot be compiled, the install goes on and the command uses the numba kernel instead
(same results, ~0.28 s more start-up). Metadata lives in pyproject.toml.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "rolloutcli.core._gae_c",
            sources=["rolloutcli/core/_gae_c.c"],
            # -ffp-contract=off: no fused multiply-add, so the float32 results equal RSL-RL's bit for bit.
            extra_compile_args=["-O3", "-ffp-contract=off", "-fno-fast-math", "-fvisibility=hidden"],
            optional=True,
        )
    ]
)
