"""What ``RolloutWriter`` refuses beyond shapes and dtypes: reserved root attributes, unsafe extras names and
NaN/Inf in the values ``gae`` computes with (unless the caller opts in to keep them)."""

from __future__ import annotations

from typing import Any

import numpy as np

from rolloutcli.core.timeouts import RULES
from rolloutcli.errors import RolloutError
from rolloutcli.fields import BY_NAME
from rolloutcli.hdf5.schema import FORMAT_VERSION

# root attributes the format gives meaning to, or the writer's own parameters set: -> how to set them instead
RESERVED = {
    "rolloutcli_format": "It is reserved: the writer sets it. Remove it from attrs.",
    "format_version": "It is reserved: the writer sets it. Remove it from attrs.",
    "timeouts_bootstrapped": "It is reserved: the writer records raw rewards (False). Remove it from attrs.",
    "timeouts_rule": "Pass timeouts_rule=... to RolloutWriter instead.",
    "recording_id": "Pass recording_id=... to RolloutWriter instead.",
    "recording_index": "Pass recording_index=... to RolloutWriter instead.",
    "versions": "It is reserved: the writer sets it. Remove it from attrs.",
    "gamma": "Pass gamma=... to RolloutWriter instead.",
    "lam": "Pass lam=... to RolloutWriter instead.",
    "recorded_from_reset": "Pass recorded_from_reset=... to RolloutWriter instead.",
    "recorder": "Pass recorder=... to RolloutWriter instead.",
}
NONFINITE_FIX = "Fix the reward or critic, or pass allow_nonfinite=True to keep them (gae then refuses the file)."


def format_attrs(path: object, timeouts_rule: str | None) -> dict[str, Any]:
    """The root attributes of the format a writer stamps: ``format_version`` (1.2: the version that defines
    ``timeouts_rule``) and ``timeouts_rule`` when given (the trainer's time-out rule, one of ``RULES``)."""
    if timeouts_rule is not None and timeouts_rule not in RULES:
        raise RolloutError.field(
            path,
            "timeouts_rule",
            f"one of {', '.join(RULES)} or None",
            repr(timeouts_rule),
            "Name your trainer's.",
        )
    return {"rolloutcli_format": "rollout", "format_version": FORMAT_VERSION, "timeouts_rule": timeouts_rule}


def recording_attrs(path: object, recording_id: Any, recording_index: Any) -> dict[str, Any]:
    """The root attributes ``recording_id``/``recording_index`` of a file of consecutive recordings (format 1.2),
    given both or neither: a non-empty id without NUL bytes (HDF5 would cut it) and an index from 0."""
    if recording_id is None and recording_index is None:
        return {}
    if recording_id is None or recording_index is None:
        given = "recording_id" if recording_index is None else "recording_index"
        other = "recording_index" if recording_index is None else "recording_id"
        raise RolloutError.field(
            path, other, f"a value beside {given} (both or neither)", "None", f"Pass {other} too, or neither."
        )
    if not isinstance(recording_id, str) or not recording_id or "\x00" in recording_id:
        raise RolloutError.field(
            path, "recording_id", "a non-empty str without NUL bytes", repr(recording_id),
            "Pass one id (uuid.uuid4().hex) for all files of one recording.",
        )  # fmt: skip
    if isinstance(recording_index, bool) or not isinstance(recording_index, int | np.integer) or recording_index < 0:
        raise RolloutError.field(
            path, "recording_index", "an int >= 0", repr(recording_index),
            "Count the recording's files 0, 1, 2, ... in the order they are written.",
        )  # fmt: skip
    return {"recording_id": recording_id, "recording_index": int(recording_index)}


def check_attrs(path: object, attrs: dict[str, Any]) -> None:
    """Refuse an ``attrs`` key the writer sets itself (or the format gives meaning to), or one HDF5 would cut."""
    for key in attrs:
        if not isinstance(key, str) or not key or "\x00" in key:
            raise RolloutError.field(
                path, "attrs", "non-empty attribute names without NUL bytes", repr(key), "Rename the attribute."
            )
        if key in RESERVED:
            raise RolloutError.field(
                path, f"attrs.{key}", "attributes the writer does not set", f"'{key}'", RESERVED[key]
            )


def check_extras_name(where: str, name: Any) -> None:
    """Refuse an extras name that HDF5 would shorten (NUL) or that would land on a format field or a group."""
    parts = name.split("/") if isinstance(name, str) else [""]
    bad = (
        not isinstance(name, str)
        or "\x00" in name
        or any(part in ("", ".", "..") for part in parts)
        or parts[0] in BY_NAME
    )
    if bad:
        raise RolloutError.field(
            where,
            "extras",
            "names without NUL bytes, empty or '.' parts, other than the format's fields",
            repr(name),
            "Rename the extra.",
        )


def check_group_key(where: str, field: str, name: Any) -> None:
    """Refuse a key of a dict of groups (observations, distribution, hidden states) that HDF5 would shorten (NUL)
    or read as more than one name."""
    if not isinstance(name, str) or "\x00" in name or "/" in name or name in ("", ".", ".."):
        raise RolloutError.field(where, field, "keys without NUL bytes or '/', not empty or '.'", repr(name),
                                 "Rename the key.")  # fmt: skip


def first_nonfinite(name: str, value: np.ndarray, mask: np.ndarray | None = None) -> tuple[int, int] | None:
    """The (step, env) of the first NaN/Inf of a ``[k, N, ...]`` block (only where ``mask [k, N]`` is set)."""
    if value.dtype.kind != "f":
        return None
    bad = ~np.isfinite(value.reshape(*value.shape[:2], -1)).all(axis=2)
    if mask is not None:
        bad &= mask.astype(bool)
    if not bad.any():
        return None
    step, env = np.argwhere(bad)[0]
    return int(step), int(env)


def last_values_of(path: object, value: np.ndarray, num_envs: int, allow_nonfinite: bool) -> np.ndarray:
    """``close()``'s ``last_values`` as ``[N]`` floats (``[N, 1]`` accepted), finite unless ``allow_nonfinite``."""
    value = value.reshape(-1) if value.shape == (num_envs, 1) else value
    where = f"{path}: close()"
    if value.shape != (num_envs,) or value.dtype.kind != "f":
        raise RolloutError.field(where, "last_values", f"float [{num_envs}]", f"{value.dtype} {list(value.shape)}")
    at = None if allow_nonfinite else first_nonfinite("last_values", value[None])
    if at is not None:
        raise RolloutError.field(
            where, "last_values", "finite numbers", f"{value[at[1]]} at env {at[1]}", NONFINITE_FIX
        )
    return value
