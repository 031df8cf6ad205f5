"""``rolloutcli gae``: advantages and returns for a rollout file, streamed in env blocks.

GAE is independent per env, so the file is processed in env blocks sized by ``--max-memory``:
pass 1 computes ``A`` and ``returns`` per block and gathers per-env moments of ``A``; when normalising,
pass 2 rewrites ``advantages = (A - mean) / (std + 1e-8)`` with the global mean and unbiased std.

Datasets GAE does not touch are carried over by copying the file's bytes (``copy_file_range``, nothing
decoded) into the temporary output, in a background thread that starts before the input is even opened: the
safety audit, the validation pass, loading the kernels and the first block's GAE all run while the kernel
copies. Then the copy is opened ``r+`` and only ``advantages``, ``returns`` (and bootstrapped ``rewards``, the
recorded ones kept as ``rewards_raw``) are written.

On the CPU everything runs on numpy arrays and the numba kernels of :mod:`rolloutcli.core.gae_kernels`:
torch is never imported (it would cost about a second, more than the work on a 1 GB file). Another device
runs :func:`rolloutcli.core.gae.compute_gae`'s torch scan there; the bootstrap, the statistics and the
normalisation stay in numpy (elementwise passes on the data on its way to the file).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rolloutcli.errors import EXIT_IO, EXIT_USAGE, RolloutError
from rolloutcli.hdf5.atomic import atomic_file, check_output_path
from rolloutcli.hdf5.filecopy import BackgroundCopy
from rolloutcli.hdf5.limits import check_regular_file
from rolloutcli.hdf5.probe import start_helper
from rolloutcli.pipeline.options import RunOptions
from rolloutcli.pipeline.progress import NoProgress, Progress

WRITTEN = ("advantages", "returns")


@dataclass(frozen=True)
class GaeOptions:
    """What ``gae`` computes.

    Attributes:
        gamma, lam: discount and GAE lambda.
        normalize: normalise advantages over the whole rollout (returns are never normalised).
        bootstrap_timeouts: apply ``r_t += gamma * V(s_t) * time_out_t``; None = when ``time_outs`` exists.
        last_values: ``"recorded"`` (require the dataset) or ``"zero"`` (treat the rollout end as terminal).
    """

    gamma: float = 0.99
    lam: float = 0.95
    normalize: bool = True
    bootstrap_timeouts: bool | None = None
    last_values: str = "recorded"


def run_gae(
    src: Path,
    dst: Path | None,
    options: GaeOptions,
    run: RunOptions,
    *,
    overwrite: bool = False,
    in_place: bool = False,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Write ``dst`` (or replace ``src`` when ``in_place``) = ``src`` + advantages, returns, attributes."""
    progress = progress or NoProgress()
    started = time.perf_counter()
    src = Path(src)
    if in_place:
        dst = Path(os.path.realpath(src))  # replace the file itself, not a symlink to it
    if dst is None:
        raise RolloutError(
            "gae: expected an output path (-o OUT.h5) or --in-place, found neither.", exit_code=EXIT_USAGE
        )
    dst = Path(dst)
    # Refuse a bad output before anything is read or copied; atomic_file checks again.
    check_output_path(dst, [src], overwrite=overwrite or in_place, replace_input=in_place)
    check_regular_file(src)  # before the copy: a FIFO or device would never end
    if in_place and not os.access(src, os.W_OK):
        raise RolloutError(
            f"{src}: the input is write-protected; refusing to replace it with --in-place. "
            "Make it writable (chmod u+w) or write a new file with -o OUT.h5.",
            exit_code=EXIT_IO,
        )
    start_helper()  # the metadata probe's interpreter starts while the copy does
    with atomic_file(dst, inputs=[src], overwrite=overwrite, replace_input=in_place) as tmp:
        progress.start("copy", max(1, src.stat().st_size))
        with BackgroundCopy(src, tmp) as copy:
            # h5py, numpy and the kernels are imported while the kernel copies the file (about 0.1 s).
            from rolloutcli.pipeline.gae_work import compute_into

            summary, bootstrap, already = compute_into(src, dst, tmp, copy, options, run, progress)
    summary.update(
        {
            "input": str(src),
            "output": str(dst),
            "in_place": in_place,
            "gamma": options.gamma,
            "lambda": options.lam,
            "normalized": options.normalize,
            "timeouts_bootstrapped": bootstrap or already,
            "bootstrapped_by_this_run": bootstrap,
            "last_values": options.last_values,
            "seconds": time.perf_counter() - started,
        }
    )
    return summary
