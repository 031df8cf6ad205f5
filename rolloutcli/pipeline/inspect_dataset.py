"""``rolloutcli inspect`` on a dataset: a row per file, totals, and one file's statistics computed over all files.

Each file is scanned once, as ``inspect`` scans one file; episode statistics and moments merge exactly across
files (:meth:`EpisodeStats.merge`, :meth:`Moments.merge`). Files that disagree (fields, trailing shapes, dtypes)
become a warning, not a refusal: ``inspect`` is how a person finds out.
"""

from __future__ import annotations

import os
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
from rolloutcli.pipeline.options import RunOptions
from rolloutcli.pipeline.per_dim import merge_scans, per_dim_report, scan_per_dim
from rolloutcli.pipeline.progress import Progress


def _file_row(path: Path, name: str, reader: RolloutReader, episodes: EpisodeStats, warnings: list[str]) -> dict:
    return {
        "file": str(path),
        "name": name,
        "size_bytes": os.path.getsize(path),
        "T": reader.T,
        "N": reader.N,
        "steps": reader.T * reader.N,
        "episodes": episodes.completed,
        "warnings": len(warnings),
    }


def _merge(a: EpisodeStats, b: EpisodeStats) -> EpisodeStats:
    """Merge the statistics of files of any T (episode lengths counted up to the longest T)."""
    T = max(a.T, b.T)
    pad = [replace(s, T=T, length_counts=np.pad(s.length_counts, (0, T - s.T))) for s in (a, b)]
    return pad[0].merge(pad[1])


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
    rows, warnings = [], []
    episodes: EpisodeStats | None = None
    moments: dict[str, Moments] = {}
    fields: list[dict[str, Any]] = []
    agreement = _Agreement()
    for path, name in zip(probing_ahead(dataset.files, options.safety), dataset.names, strict=True):
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
            rows.append(_file_row(path, name, reader, stats, found))
            if per_dim:
                scanned = merge_scans(scanned, scan_per_dim(reader, progress))
        warnings.extend(found)
        episodes = stats if episodes is None else _merge(episodes, stats)
        for key, value in values.items():
            moments[key] = moments[key].merge(value) if key in moments else value
    warnings.extend(agreement.problems)
    assert episodes is not None
    totals = {
        "files": len(rows),
        "steps": sum(r["steps"] for r in rows),
        "envs": sum(r["N"] for r in rows),
        "episodes": episodes.completed,
        "bytes": sum(r["size_bytes"] for r in rows),
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
