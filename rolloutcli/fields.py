"""The rollout file's fields (format contract v1), as one table that every module iterates: adding a field is
one row here. Datasets that match no row are *extras*, carried along untouched (and split like any field when
laid out ``[T, N, ...]``). No h5py, numpy or torch here: dtypes are numpy dtype names.
"""

from __future__ import annotations

from dataclasses import dataclass

# Layouts: where T (time) and N (envs) sit in a field's shape.
STEP = "[T, N, ...]"  # per-step fields: split, batch and GAE stream over them
HIDDEN = "[T, layers, N, H]"  # recurrent state at each step
ENV = "[N, ...]"  # one entry per env (last_values, last_observations)


@dataclass(frozen=True)
class Field:
    """One row of the table."""

    name: str  # HDF5 path; for a group, the prefix of its datasets name/<key>
    layout: str = STEP  # STEP, HIDDEN or ENV
    required: str = ""  # "always", the command that needs it ("gae", "distillation") or "" (optional)
    load_dtype: str | None = None  # dtype every reader returns, or None to keep the stored one
    flag: bool = False  # episode-end flag: stored as bool or 0/1, loaded as uint8 0/1
    trailing_one: bool = False  # a trailing axis of size 1 is accepted on disk and dropped on load
    finite: bool = False  # NaN/Inf is a data problem (checked before any command runs)
    group: bool = False  # a group of datasets name/<key> (observation groups, distribution parameters)
    batch_name: str | None = None  # the attribute of an RSL-RL Batch it feeds
    storage_name: str | None = None  # the attribute of RolloutStorage that holds it (scalars as [T, N, 1])

    @property
    def role(self) -> str:
        """The field's role (the name of its row; ``observation`` for the observation groups)."""
        return {"observations": "observation", "hidden_states": "hidden"}.get(self.name, self.name)

    @property
    def env_axis(self) -> int:
        """Axis of N in the stored shape."""
        return {STEP: 1, HIDDEN: 2, ENV: 0}[self.layout]


# fmt: off
FIELDS: tuple[Field, ...] = (
    Field("observations", required="always", group=True, batch_name="observations", storage_name="observations"),
    Field("actions", required="always", batch_name="actions", storage_name="actions"),
    Field("rewards", required="always", load_dtype="float32", trailing_one=True, finite=True, storage_name="rewards"),
    Field("dones", required="always", load_dtype="uint8", flag=True, trailing_one=True, batch_name="dones",
          storage_name="dones"),
    Field("time_outs", load_dtype="uint8", flag=True, trailing_one=True, storage_name="time_outs"),
    Field("values", required="gae", load_dtype="float32", trailing_one=True, finite=True, batch_name="values",
          storage_name="values"),
    Field("last_values", layout=ENV, required="gae", load_dtype="float32", trailing_one=True, finite=True,
          storage_name="last_values"),
    Field("actions_log_prob", trailing_one=True, batch_name="old_actions_log_prob", storage_name="actions_log_prob"),
    Field("distribution", group=True, batch_name="old_distribution_params", storage_name="distribution_params"),
    Field("privileged_actions", required="distillation", batch_name="privileged_actions",
          storage_name="privileged_actions"),
    Field("hidden_states", layout=HIDDEN, group=True, batch_name="hidden_states"),
    Field("advantages", load_dtype="float32", trailing_one=True, batch_name="advantages", storage_name="advantages"),
    Field("returns", load_dtype="float32", trailing_one=True, batch_name="returns", storage_name="returns"),
    # v1.1: the observation that ended an episode (before the reset; undefined where dones is 0), V of it,
    # and the observation after the last step.
    Field("final_observations", group=True),
    Field("final_values", load_dtype="float32", trailing_one=True),
    Field("last_observations", layout=ENV, group=True),
)
# fmt: on
BY_NAME: dict[str, Field] = {f.name: f for f in FIELDS}
EXTRA = "extra"  # the role of a dataset that matches no row
# An extra ``[T, N]`` 0/1 that gymnasium's recorder writes in NEXT_STEP mode: 1 at an env's autoreset step (dones is
# 1 there, the action was ignored, no transition happened). inspect counts no episode there and batch
# --transitions exports no transition there.
AUTORESET = "autoreset_steps"


def field_of(path: str) -> Field | None:
    """The row a dataset path belongs to (``observations/policy`` -> the observations row), or None (an extra).

    A single dataset at ``observations`` is the observation group ``policy`` (format contract).
    """
    top, _, rest = path.partition("/")
    row = BY_NAME.get(top)
    if row is None or (row.group != bool(rest) and path != "observations"):
        return None
    return row


def by_flag(**wanted: object) -> list[Field]:
    """The rows whose attributes equal ``wanted`` (e.g. ``by_flag(flag=True)``), in table order."""
    return [f for f in FIELDS if all(getattr(f, key) == value for key, value in wanted.items())]
