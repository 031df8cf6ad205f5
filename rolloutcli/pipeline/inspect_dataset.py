"""``rolloutcli inspect`` on a dataset: a row per file, totals, and one file's statistics computed over all files.

Each file is scanned once, as ``inspect`` scans one file; episode statistics and moments merge exactly across
files (:meth:`EpisodeStats.merge`, :meth:`Moments.merge`). Files that disagree (fields, trailing shapes, dtypes)
become a warning, not a refusal: ``inspect`` is how a person finds out.
"""

from __future__ import annotations

import os
from array import array
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from rolloutcli.core.stats import EpisodeStats, Moments
from rolloutcli.dataset import Dataset, check_agreement, check_agrees, dataset_reader, reader_signature
from rolloutcli.errors import RolloutError
from rolloutcli.hdf5.probe import probing_ahead
from rolloutcli.hdf5.reader import RolloutReader
from rolloutcli.pipeline.inspect import MOMENT_FIELDS, _episodes_report, _scan
from rolloutcli.pipeline.lazy import Lazy
from rolloutcli.pipeline.options import RunOptions
from rolloutcli.pipeline.per_dim import merge_scans, per_dim_report, scan_per_dim
from rolloutcli.pipeline.progress import Progress

ROW_NUMBERS = 5  # a file's size in bytes, T, N, completed episodes, warnings


def _file_rows(dataset: Dataset, numbers: array) -> Lazy[dict[str, Any]]:
    """A row per file of ``dataset`` from its ``ROW_NUMBERS`` numbers in ``numbers`` (40 bytes a file kept)."""

    def row(i: int) -> dict[str, Any]:
        size_bytes, T, N, episodes, warnings = numbers[ROW_NUMBERS * i : ROW_NUMBERS * (i + 1)]
        return {
            "file": str(dataset.files[i]),
            "name": dataset.names[i],
            "size_bytes": size_bytes,
            "T": T,
            "N": N,
            "steps": T * N,
            "episodes": episodes,
            "warnings": warnings,
        }

    return Lazy(len(numbers) // ROW_NUMBERS, row)


def _merge(a: EpisodeStats, b: EpisodeStats) -> EpisodeStats:
    """Merge the statistics of files of any T (episode lengths counted up to the longest T)."""
    if a.T != b.T:  # a run's files mostly agree: no padding then (~0.1 ms a file)
        T = max(a.T, b.T)
        a, b = (replace(s, T=T, length_counts=np.pad(s.length_counts, (0, T - s.T))) for s in (a, b))
    return a.merge(b)


class _Agreement:
    """``check_agreement``'s rule, checked on each file while it is open for its row (a file opened once): the
    first disagreement, as it would raise it, becomes ``problems``' one warning."""

    def __init__(self) -> None:
        self.first: tuple[Path, Any] | None = None
        self.problems: list[str] = []

    def check(self, path: Path, reader: RolloutReader) -> None:
        if self.first is None:
            self.first = (path, reader_signature(reader))
        elif not self.problems:
            try:
                check_agrees(self.first[0], self.first[1], path, reader_signature(reader))
            except RolloutError as error:
                self.problems.append(str(error))


def run_inspect_dataset(
    dataset: Dataset, options: RunOptions, progress: Progress | None = None, *, per_dim: bool = False
) -> dict[str, Any]:
    """The dataset report: ``files`` (a row each), ``totals``, merged ``episodes`` and moments, ``warnings``;
    ``per_dim`` adds per-dimension statistics over every file (the files must agree, else exit 1)."""
    progress = progress or Progress()
    if per_dim:
        check_agreement(dataset.files, options.safety)
    scanned = None
    numbers, warnings = array("q"), []
    episodes: EpisodeStats | None = None
    per_env: list[int] = []  # completed episodes of each env of each file, in order
    moments: dict[str, Moments] = {}
    fields: list[dict[str, Any]] = []
    agreement = _Agreement()
    for path in probing_ahead(dataset.files, options.safety):
        with dataset_reader(path, options.safety, check=False, budget=options.max_memory) as reader:
            agreement.check(path, reader)
            found: list[str] = []
            try:
                reader.check_values()
            except RolloutError as error:
                found.extend(error.problems)
            stats, values = _scan(reader, progress)
            if not fields:
                fields = [
                    {"name": s.name, "role": s.role, "dtype": str(s.dtype)} for s in reader.schema.fields.values()
                ]
            numbers.extend((os.path.getsize(path), reader.T, reader.N, stats.completed, len(found)))
            if per_dim:
                scanned = merge_scans(scanned, scan_per_dim(reader, progress))
        warnings.extend(found)
        per_env.extend(stats.per_env)  # apart: a merge copies the lists (0.1 ms a file at 5,000 files, and growing)
        stats.per_env = []
        episodes = stats if episodes is None else _merge(episodes, stats)
        for key, value in values.items():
            moments[key] = moments[key].merge(value) if key in moments else value
    warnings.extend(agreement.problems)
    assert episodes is not None
    episodes.per_env = per_env
    rows = _file_rows(dataset, numbers)
    sizes, lengths, envs = (numbers[k::ROW_NUMBERS] for k in range(3))
    totals = {
        "files": len(rows),
        "steps": sum(t * n for t, n in zip(lengths, envs, strict=True)),
        "envs": sum(envs),
        "episodes": episodes.completed,
        "bytes": sum(sizes),
    }
    return {
        "dataset": str(dataset.root),
        "files": rows,
        "totals": totals,
        "fields": fields,
        "episodes": _episodes_report(episodes),
        **{key: moments[key].as_dict() if key in moments else None for key in MOMENT_FIELDS},
        "warnings": warnings,
        **({"per_dim": per_dim_report(scanned)} if per_dim else {}),
    }
