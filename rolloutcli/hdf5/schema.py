"""The rollout file's layout (format contract v1): which datasets exist, their roles and shapes.

``describe`` turns an opened, audited ``h5py.File`` into a ``RolloutSchema`` and lists every structural
problem (missing fields, T/N disagreement, wrong rank, non-numeric dtypes, bad hidden-state layout) at
once. Value checks (NaN, 0/1 flags) need the data and live in ``reader.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from rolloutcli.errors import problem_line

FORMAT_NAME = "rollout"
FORMAT_VERSION = 1
REFERENCE_FIELD = "rewards"  # T and N come from here; every other field is checked against it

# Per-step fields whose trailing 1 is squeezed: [T, N] or [T, N, 1].
SCALAR_FIELDS = ("rewards", "dones", "time_outs", "values", "actions_log_prob", "advantages", "returns")
FLAG_FIELDS = ("dones", "time_outs")
FLOAT_COMPUTE_FIELDS = ("rewards", "values", "last_values")


@dataclass(frozen=True)
class FieldSpec:
    """One dataset of a rollout file.

    Attributes:
        name: its HDF5 path (also the key used everywhere else, e.g. ``observations/policy``).
        role: observation, actions, rewards, dones, time_outs, values, last_values, actions_log_prob,
            distribution, privileged_actions, hidden, advantages, returns or extra.
        env_axis: axis of N (1 for ``[T, N, ...]``, 2 for hidden ``[T, layers, N, H]``, 0 for
            ``last_values``), None for extra datasets that are carried along untouched.
    """

    name: str
    role: str
    shape: tuple[int, ...]
    dtype: np.dtype
    env_axis: int | None
    chunks: tuple[int, ...] | None = None
    compression: str | None = None

    @property
    def per_step(self) -> bool:
        """True for ``[T, N, ...]`` fields that split, batch and GAE stream over."""
        return self.env_axis == 1

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def bytes_per_env(self) -> int:
        """Bytes of one env's slice of this field."""
        if self.env_axis is None or not self.shape:
            return 0
        return self.nbytes // max(self.shape[self.env_axis], 1)


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

    def has(self, name: str) -> bool:
        return name in self.fields

    def names(self, role: str) -> list[str]:
        return [name for name, spec in self.fields.items() if spec.role == role]

    def per_step_names(self) -> list[str]:
        return [name for name, spec in self.fields.items() if spec.per_step]


def _role_of(name: str) -> str:
    top = name.split("/")[0]
    if top == "observations":
        return "observation"
    if top == "distribution":
        return "distribution"
    if top == "hidden_states":
        return "hidden"
    if name in (
        "actions",
        "rewards",
        "dones",
        "time_outs",
        "values",
        "last_values",
        "actions_log_prob",
        "privileged_actions",
        "advantages",
        "returns",
    ):
        return name
    return "extra"


def _attr_value(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value


def _compression(dataset: h5py.Dataset) -> str | None:
    parts = [
        p
        for p in (
            dataset.compression,
            "shuffle" if dataset.shuffle else None,
            "fletcher32" if dataset.fletcher32 else None,
        )
        if p
    ]
    return "+".join(parts) if parts else None


def list_datasets(handle: h5py.File) -> dict[str, h5py.Dataset]:
    """Every dataset reachable by hard links, keyed by path (the file must be audited first)."""
    found: dict[str, h5py.Dataset] = {}

    def visit(name: str, obj: h5py.HLObject) -> None:
        if isinstance(obj, h5py.Dataset):
            found[name] = obj

    handle.visititems(visit)
    return found


def describe(path: Path, handle: h5py.File) -> tuple[RolloutSchema | None, list[str]]:
    """Build the schema and list every structural problem (all at once, one line each)."""
    datasets = list_datasets(handle)
    problems: list[str] = []

    def bad(name: str, expected: str, found: str, fix: str = "") -> None:
        problems.append(problem_line(path, name, expected, found, fix))

    for required in ("actions", "rewards", "dones"):
        if required not in datasets:
            bad(
                required,
                "a dataset [T, N" + (", ...]" if required == "actions" else "]"),
                "nothing",
                "Record it; see the format contract in the README.",
            )
    obs_paths = {name.split("/", 1)[1]: name for name in datasets if name.startswith("observations/")}
    if "observations" in datasets:
        obs_paths = {"policy": "observations"}
    if not obs_paths:
        bad(
            "observations",
            "a group of datasets [T, N, ...] (or one dataset)",
            "nothing",
            "Record at least one observation group, e.g. observations/policy.",
        )
    reference = datasets.get(REFERENCE_FIELD)
    T = N = 0
    if reference is not None:
        if reference.ndim < 2:
            bad(REFERENCE_FIELD, "shape [T, N] or [T, N, 1]", f"shape {tuple(reference.shape)}")
        else:
            T, N = int(reference.shape[0]), int(reference.shape[1])
            if T == 0 or N == 0:
                bad(REFERENCE_FIELD, "at least one step and one env", f"T={T}, N={N}", "The recording is empty.")
    fields: dict[str, FieldSpec] = {}
    for name, dataset in datasets.items():
        role = _role_of(name)
        shape = tuple(int(s) for s in dataset.shape)
        dtype = dataset.dtype
        env_axis: int | None = 1
        if role == "extra":
            env_axis = None
        elif role == "last_values":
            env_axis = 0
        elif role == "hidden":
            env_axis = 2
        if role != "extra" and dtype.kind not in "biuf":
            bad(
                name,
                "a numeric dtype (bool, integer or float)",
                f"dtype {dtype}",
                "Store numbers; strings and compound types cannot be trained on.",
            )
        elif role != "extra" and T and N:
            problem = _shape_problem(role, shape, T, N)
            if problem:
                bad(name, problem, f"shape {shape}")
        fields[name] = FieldSpec(
            name,
            role,
            shape,
            dtype.newbyteorder("=") if dtype.kind in "iuf" else dtype,
            env_axis,
            dataset.chunks,
            _compression(dataset),
        )
    hidden = _hidden_layout(path, fields, problems)
    attrs = {key: _attr_value(value) for key, value in handle.attrs.items()}
    if problems or reference is None:
        return None, problems
    return RolloutSchema(path, T, N, fields, attrs, {k: obs_paths[k] for k in sorted(obs_paths)}, hidden), problems


def _shape_problem(role: str, shape: tuple[int, ...], T: int, N: int) -> str | None:
    """Expected-shape text when ``shape`` does not fit ``role``, else None."""
    if role in SCALAR_FIELDS:
        if shape in ((T, N), (T, N, 1)):
            return None
        return f"shape [T, N] = [{T}, {N}] (or [{T}, {N}, 1])"
    if role == "last_values":
        return None if shape in ((N,), (N, 1)) else f"shape [N] = [{N}] (or [{N}, 1])"
    if role == "hidden":
        if len(shape) == 4 and shape[0] == T and shape[2] == N:
            return None
        return f"shape [T, layers, N, hidden] with T={T}, N={N}"
    if len(shape) >= 2 and shape[:2] == (T, N):
        return None
    return f"shape [T, N, ...] with T={T}, N={N}"


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
            problems.append(
                problem_line(
                    path,
                    f"hidden_states/{net}",
                    "LSTM h and c of the same shape",
                    f"{fields[names[0]].shape} and {fields[names[1]].shape}",
                )
            )
    return layout
