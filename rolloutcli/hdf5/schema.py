"""The rollout file's layout (format contract v1): which datasets exist, their roles and shapes.

``describe`` turns the metadata of an audited file (``{path: DatasetInfo}`` and its root attributes) into a
``RolloutSchema`` and lists every structural problem at once. What each field may look like comes from
:mod:`rolloutcli.fields`; value checks (NaN, 0/1 flags) need the data and live in ``reader.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rolloutcli.errors import problem_line
from rolloutcli.fields import ENV, EXTRA, FIELDS, HIDDEN, STEP, Field, field_of

FORMAT_NAME = "rollout"
FORMAT_VERSION = 1.2  # the contract version written (1.2: timeouts_rule); every reader accepts 1, 1.1 and 1.2
REFERENCE_FIELD = "rewards"  # T and N come from here; every other field is checked against it


@dataclass(frozen=True)
class DatasetInfo:
    """A dataset's metadata as stored: shape, dtype (with its byte order), chunks, filters."""

    shape: tuple[int, ...]
    dtype: np.dtype
    chunks: tuple[int, ...] | None = None
    compression: str | None = None


@dataclass(frozen=True)
class FieldSpec:
    """One dataset of a rollout file.

    Attributes:
        name: its HDF5 path (also its key everywhere else, e.g. ``observations/policy``).
        role: the role of its row in :data:`rolloutcli.fields.FIELDS`, or ``extra``.
        dtype: the stored dtype in native byte order.
        env_axis: axis of N; None for extras not laid out ``[T, N, ...]`` (carried along whole).
    """

    name: str
    role: str
    shape: tuple[int, ...]
    dtype: np.dtype
    env_axis: int | None
    chunks: tuple[int, ...] | None = None
    compression: str | None = None

    @property
    def row(self) -> Field | None:
        return field_of(self.name) if self.role != EXTRA else None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def bytes_per_env(self) -> int:
        """Bytes of one env's slice of this field (0 for a dataset carried along whole)."""
        if self.env_axis is None or not self.shape:
            return 0
        return self.nbytes // max(self.shape[self.env_axis], 1)

    def loaded(self, envs: int) -> tuple[np.dtype, tuple[int, ...]]:
        """The dtype and shape the reader returns for ``envs`` envs of this field (its row's normalisation)."""
        shape = list(self.shape)
        if self.env_axis is not None and shape:
            shape[self.env_axis] = envs
        row = self.row
        if row is None:
            return self.dtype, tuple(shape)
        if row.trailing_one and len(shape) == (2 if row.layout == STEP else 1) + 1 and shape[-1] == 1:
            shape = shape[:-1]
        return np.dtype(row.load_dtype or self.dtype), tuple(shape)


@dataclass
class RolloutSchema:
    """What a rollout file holds. ``fields`` maps HDF5 path to spec (observations read from a single
    ``observations`` dataset are keyed ``observations`` and shown as the group ``policy``)."""

    path: Path
    T: int
    N: int
    fields: dict[str, FieldSpec]
    attrs: dict[str, Any] = field(default_factory=dict)
    observation_keys: dict[str, str] = field(default_factory=dict)  # obs key -> HDF5 path
    hidden: dict[str, list[str]] = field(default_factory=dict)  # "actor"/"critic" -> paths (h[, c])

    def names(self, role: str) -> list[str]:
        return [name for name, spec in self.fields.items() if spec.role == role]

    def per_step_names(self) -> list[str]:
        """Contract fields laid out ``[T, N, ...]`` (extras excluded)."""
        return [name for name, spec in self.fields.items() if spec.role != EXTRA and spec.env_axis == 1]

    def step_names(self) -> list[str]:
        """Every dataset laid out ``[T, N, ...]``: the per-step fields and the extras shaped like them."""
        return [name for name, spec in self.fields.items() if spec.env_axis == 1]


def _expected_shape(row: Field, shape: tuple[int, ...], T: int, N: int) -> str | None:
    """Expected-shape text when ``shape`` does not fit ``row``, else None."""
    if row.layout == ENV and row.trailing_one:
        return None if shape in ((N,), (N, 1)) else f"shape [N] = [{N}] (or [{N}, 1])"
    if row.layout == ENV:
        return None if shape[:1] == (N,) else f"shape [N, ...] with N={N}"
    if row.layout == HIDDEN:
        if len(shape) == 4 and shape[0] == T and shape[2] == N:
            return None
        return f"shape [T, layers, N, hidden] with T={T}, N={N}"
    if row.trailing_one:
        return None if shape in ((T, N), (T, N, 1)) else f"shape [T, N] = [{T}, {N}] (or [{T}, {N}, 1])"
    return None if len(shape) >= 2 and shape[:2] == (T, N) else f"shape [T, N, ...] with T={T}, N={N}"


def _reference(path: Path, datasets: dict[str, DatasetInfo], problems: list[str]) -> tuple[int, int]:
    reference = datasets.get(REFERENCE_FIELD)
    if reference is None:
        return 0, 0
    if len(reference.shape) < 2:
        problems.append(problem_line(path, REFERENCE_FIELD, "shape [T, N] or [T, N, 1]", f"shape {reference.shape}"))
        return 0, 0
    T, N = reference.shape[:2]
    if T == 0 or N == 0:
        fix = "The recording is empty."
        problems.append(problem_line(path, REFERENCE_FIELD, "at least one step and one env", f"T={T}, N={N}", fix))
    return T, N


def _missing(path: Path, datasets: dict[str, DatasetInfo]) -> list[str]:
    """A line for every required row with no dataset."""
    problems = []
    for row in sorted(FIELDS, key=lambda r: r.group):  # datasets first, then the observation group
        if row.required == "always" and not any(field_of(name) is row for name in datasets):
            expected = "a dataset [T, N" + (", ...]" if not row.trailing_one else "]")
            fix = "Record it; see the format contract in the README."
            if row.group:
                expected = "a group of datasets [T, N, ...] (or one dataset)"
                fix = "Record at least one observation group, e.g. observations/policy."
            problems.append(problem_line(path, row.name, expected, "nothing", fix))
    return problems


def describe(
    path: Path, datasets: dict[str, DatasetInfo], attrs: dict[str, Any]
) -> tuple[RolloutSchema | None, list[str]]:
    """Build the schema and list every structural problem (all at once, one line each)."""
    problems = _missing(path, datasets)
    T, N = _reference(path, datasets, problems)
    fields: dict[str, FieldSpec] = {}
    for name, info in datasets.items():
        row = field_of(name)
        dtype = info.dtype.newbyteorder("=") if info.dtype.kind in "iuf" else info.dtype
        env_axis = row.env_axis if row is not None else None
        if row is None and len(info.shape) >= 2 and T and info.shape[:2] == (T, N):
            env_axis = 1  # an extra laid out [T, N, ...]: streamed and split like the per-step fields
        if row is not None and info.dtype.kind not in "biuf":
            fix = "Store numbers; strings and compound types cannot be trained on."
            found = f"dtype {info.dtype}"
            problems.append(problem_line(path, name, "a numeric dtype (bool, integer or float)", found, fix))
        elif row is not None and T and N and (expected := _expected_shape(row, info.shape, T, N)):
            problems.append(problem_line(path, name, expected, f"shape {info.shape}"))
        role = row.role if row is not None else EXTRA
        fields[name] = FieldSpec(name, role, info.shape, dtype, env_axis, info.chunks, info.compression)
    hidden = _hidden_layout(path, fields, problems)
    if problems or REFERENCE_FIELD not in datasets:
        return None, problems
    observations = (
        {"policy": "observations"}
        if "observations" in datasets
        else {name.split("/", 1)[1]: name for name in datasets if name.startswith("observations/")}
    )
    return RolloutSchema(path, T, N, fields, attrs, dict(sorted(observations.items())), hidden), problems


def _hidden_layout(path: Path, fields: dict[str, FieldSpec], problems: list[str]) -> dict[str, list[str]]:
    """Check ``hidden_states/<actor|critic>/<i>``: i = 0 (GRU) or 0, 1 (LSTM h, c of equal shape)."""
    layout: dict[str, list[str]] = {}
    for name in fields:
        parts = name.split("/")
        if parts[0] != "hidden_states":
            continue
        if len(parts) != 3 or parts[1] not in ("actor", "critic") or parts[2] not in ("0", "1"):
            problems.append(
                problem_line(path, name, "hidden_states/actor/<0|1> or hidden_states/critic/<0|1>", f"'{name}'")
            )
            continue
        layout.setdefault(parts[1], []).append(name)
    for net, names in layout.items():
        names.sort()
        indices = [n.rsplit("/", 1)[1] for n in names]
        if indices not in (["0"], ["0", "1"]):
            problems.append(
                problem_line(path, f"hidden_states/{net}", "index 0 (GRU) or 0 and 1 (LSTM h, c)", f"indices {indices}")
            )
        elif len(names) == 2 and fields[names[0]].shape != fields[names[1]].shape:
            shapes = f"{fields[names[0]].shape} and {fields[names[1]].shape}"
            problems.append(problem_line(path, f"hidden_states/{net}", "LSTM h and c of the same shape", shapes))
    return layout
