"""``rolloutcli stats``: the per-dimension statistics of one observation group; with ``--normalizer``, also the
state dict of RSL-RL's ``EmpiricalNormalization`` (``_mean``, ``_var``, ``_std`` shaped ``[1, *obs_shape]``,
``count``).

``_var`` is the exactly rounded variance over the count (RSL-RL's ``unbiased=False``), ``_std`` its square root,
both over the finite values of each dimension (non-finite ones are counted and reported); ``count`` is the
number of rows, T * N. Loaded into the module, ``forward`` gives ``(x - mean) / (std + eps)``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rolloutcli.dataset import check_agreement
from rolloutcli.errors import EXIT_USAGE, RolloutError
from rolloutcli.hdf5.atomic import atomic_file, check_output_path
from rolloutcli.hdf5.reader import RolloutReader
from rolloutcli.pipeline.options import RunOptions
from rolloutcli.pipeline.per_dim import merge_scans, per_dim_report, scan_per_dim
from rolloutcli.pipeline.progress import Progress


def _group(reader: RolloutReader, group: str | None) -> str:
    """The observation group to normalise: ``group``, else ``policy``, else the only one."""
    keys = reader.schema.observation_keys
    if group is None and len(keys) == 1:
        return next(iter(keys))
    chosen = group or "policy"
    if chosen not in keys:
        raise RolloutError(
            f"{reader.path}: --group: expected one of the observation groups {', '.join(sorted(keys))}, found "
            f"'{chosen}'. Pass --group NAME.",
            exit_code=EXIT_USAGE,
        )
    return chosen


def run_normalizer(
    src: Path | Sequence[Path],
    dst: Path | None,
    group: str | None,
    run: RunOptions,
    *,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """The statistics of the observations of ``group`` in ``src`` (a file, or the files of a dataset, which must
    agree: exact over all of their rows); with ``dst``, also written there (``torch.save`` of a state dict)."""
    started, progress = time.perf_counter(), progress or Progress()
    files = [Path(src)] if isinstance(src, (str, Path)) else [Path(p) for p in src]
    if dst is not None:
        check_output_path(Path(dst), files, overwrite=overwrite)
    if len(files) > 1:
        check_agreement(files, run.safety)
    scanned, rows = None, 0
    for path in files:
        with RolloutReader(path, run.safety, budget=run.max_memory) as reader:
            key = _group(reader, group)
            label = f"observations/{key}"
            scanned = merge_scans(scanned, scan_per_dim(reader, progress, {label: reader.schema.observation_keys[key]}))
            rows += reader.T * reader.N
    moments, shape = scanned[label]
    if dst is not None:
        _save_state(Path(dst), files, moments, shape, rows, overwrite)
    report = per_dim_report(scanned)[label]
    return {
        "input": str(files[0]) if len(files) == 1 else [str(p) for p in files],
        "output": None if dst is None else str(dst),
        "group": key,
        "shape": list(shape),
        "count": rows,
        "nonfinite": report["nonfinite_total"],
        "per_dim": {label: report},
        "seconds": time.perf_counter() - started,
    }


def _save_state(dst: Path, files: list[Path], moments: Any, shape: Sequence[int], rows: int, overwrite: bool) -> None:
    """``torch.save`` the ``EmpiricalNormalization`` state dict to ``dst``, atomically."""
    import torch

    mean = [m.as_dict()["mean"] or 0.0 for m in moments.dims]
    var = moments.population_variance()
    as_tensor = lambda values: torch.tensor(values, dtype=torch.float64).reshape(1, *shape).to(torch.float32)  # noqa: E731
    state = {
        "_mean": as_tensor(mean),
        "_var": as_tensor(var),
        "_std": as_tensor([math.sqrt(v) for v in var]),
        "count": torch.tensor(rows, dtype=torch.long),
    }
    with atomic_file(dst, inputs=files, overwrite=overwrite) as tmp:
        torch.save(state, tmp)
