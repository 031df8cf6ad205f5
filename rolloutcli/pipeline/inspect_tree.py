"""``inspect`` on what is not a rollout file: the tree of any HDF5 file it can open safely, the layout it
recognises (D4RL, Minari, robomimic, ikostrikov, rolloutcli's own split files and shard folders) and the one
line that says what is missing and which command fixes it. Also the checks every report shares: where
non-finite values are (first step and env) and whether a file looks env-major ([N, T]) or flat ([T*N]).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from rolloutcli.errors import RolloutError
from rolloutcli.hdf5.reader import H5Input
from rolloutcli.hdf5.tree import object_tree
from rolloutcli.pipeline.layouts import recognise

MANIFEST = "manifest.json"
MANIFEST_BYTES = 16 << 20  # a larger manifest is not ours
ENV_MAJOR_ATTRS = ("layout", "dim_order", "batch_dims", "dims", "memory_layout")


def folder_report(path: Path) -> dict[str, Any]:
    """A folder: rolloutcli's shard folder (``manifest.json``) or a Minari dataset; anything else is refused."""
    manifest = path / MANIFEST
    if manifest.is_file() and manifest.stat().st_size <= MANIFEST_BYTES:
        try:
            data = json.loads(manifest.read_text())
        except (OSError, ValueError) as exc:
            raise RolloutError(f"{manifest}: unreadable manifest ({exc}).") from exc
        data = data if isinstance(data, dict) else {}
        shards = data.get("shards") if isinstance(data.get("shards"), list) else []
        command = f"rolloutcli inspect {data['source']}" if isinstance(data.get("source"), str) else None
        line = (
            f"{path}: a shard folder written by rolloutcli batch ({len(shards)} shards, mode {data.get('mode')}); "
            "train from it with rolloutcli.shards.ShardDataset, or inspect the rollout it came from"
            + (f": {command}" if command else ".")
        )
        return _base(path, "shards", line, [], {k: v for k, v in data.items() if k != "shards"}, command)
    if (path / "data" / "main_data.hdf5").is_file():
        command = f"rolloutcli import {path} -o OUT.h5"
        line = f"{path}: a Minari dataset folder, not a rollout file; convert it: {command}"
        return _base(path, "minari", line, [], {}, command)
    raise RolloutError(f"{path}: is a folder, expected an HDF5 file (or a shard folder with {MANIFEST}).", exit_code=3)


def _base(
    path: Path, kind: str, line: str, tree: list, attrs: dict[str, Any], command: str | None = None
) -> dict[str, Any]:
    """``problem``: the line that says what to do; ``command``: the command it ends with, if it names one."""
    return {
        "file": str(path),
        "contract": False,
        "kind": kind,
        "problem": line,
        "command": command,
        "tree": tree,
        "objects": len(tree),
        "attrs": attrs,
        "nonfinite": [],
        "warnings": [line],
    }


def tree_report(path: Path, source: H5Input, problems: list[str], budget: int) -> dict[str, Any]:
    """The report of an audited HDF5 file outside the contract (``problems``: what ``describe`` found)."""
    layout = recognise(source.datasets)
    fmt = source.attrs.get("rolloutcli_format")
    command = None
    if fmt == "trajectories":
        command = f"rolloutcli split --unpad {path} -o OUT.h5"
        kind, fix = "split", f"a file written by rolloutcli split; restore the rollout: {command}"
    elif fmt == "shard":
        kind, fix = (
            "shard",
            "one shard written by rolloutcli batch; load its folder with rolloutcli.shards.ShardDataset",
        )
    elif layout is not None:
        command = f"rolloutcli import {path} -o OUT.h5"
        kind, fix = layout, f"a file in the {layout} layout, not a rollout file; convert it: {command}"
    else:
        kind = "unknown"
        fix = f"not a rollout file ({_missing(problems)}); record the contract's fields, or convert a known layout "
        fix += "with rolloutcli import (D4RL, Minari, robomimic, ikostrikov)"
    line = f"{path}: {fix}"
    tree, count = object_tree(source)
    report = _base(path, kind, line, tree, source.attrs, command)
    report.update(objects=count, size_bytes=os.path.getsize(path), problems=problems)
    floats = [n for n, info in source.datasets.items() if info.dtype.kind == "f" and len(info.shape) >= 1]
    report["nonfinite"] = nonfinite(source, floats, budget)
    # A layout it knows gets the hint alone: the contract's complaints (and "looks flat") would contradict it.
    known = kind != "unknown"
    report["warnings"] = [line] if known else [line, *problems, *flat_warnings(path, source.datasets, source.attrs)]
    return report


def _missing(problems: list[str]) -> str:
    """``missing rewards, dones`` from the schema's problem lines (or the first problem's gist)."""
    missing = [p.split("field '", 1)[1].split("'", 1)[0] for p in problems if "found nothing" in p and "field '" in p]
    if missing:
        return "missing " + ", ".join(missing)
    return f"{len(problems)} problem(s), first: {problems[0].split(': ', 1)[-1]}" if problems else "no datasets"


def nonfinite(source: H5Input, names: list[str], budget: int) -> list[dict[str, Any]]:
    """For every float dataset in ``names`` holding NaN/Inf: how many, and the first (step, env) index (rows
    read in blocks of at most ``budget`` bytes)."""
    found = []
    for name in names:
        info = source.datasets[name]
        rows = info.shape[0]
        step = max(1, budget // max(math.prod(info.shape[1:]) * info.dtype.itemsize, 1))
        count, first = 0, None
        for start in range(0, rows, step):
            bad = ~np.isfinite(source.slice(name, (slice(start, min(start + step, rows)),)))
            count += int(np.count_nonzero(bad))
            if first is None and bad.any():
                index = np.argwhere(bad)[0]
                first = [int(index[0]) + start, int(index[1]) if len(index) > 1 else None]
        if count:
            found.append({"dataset": name, "count": count, "first_step": first[0], "first_env": first[1]})
    return found


def flat_warnings(path: Path, datasets: dict[str, Any], attrs: dict[str, Any]) -> list[str]:
    """A flat ``[T*N]`` recording (1-D rewards and dones)."""
    rewards, dones = datasets.get("rewards"), datasets.get("dones")
    if rewards is not None and dones is not None and len(rewards.shape) == 1 and len(dones.shape) == 1:
        return [
            f"{path}: looks flat ([T*N]): 'rewards' and 'dones' are 1-D ({rewards.shape[0]} rows); the contract "
            "is [T, N]: reshape them (time first), or if episodes lie end to end, rolloutcli import --from d4rl."
        ]
    return []


def env_major_warnings(path: Path, T: int, per_env: list[int], attrs: dict[str, Any]) -> list[str]:
    """A file that looks ``[N, T]`` read as ``[T, N]``: an attribute says so, or some "env" ends an episode
    at nearly every step while the typical one does not (in ``[N, T]`` data, synchronised ends such as time
    limits fall on one column)."""
    said = [k for k in ENV_MAJOR_ATTRS if _env_first(attrs.get(k))]
    counts = sorted(per_env)
    median = counts[len(counts) // 2] if counts else 0
    shape = f"[{T}, {len(per_env)}]"
    if said:
        why = f"its attribute '{said[0]}' = {attrs[said[0]]!r} puts envs first"
    elif T >= 8 and counts and counts[-1] >= 0.9 * T and median < 0.5 * T:
        why = f"one env ends an episode at {counts[-1]} of {T} steps while most end at {median} or fewer"
    else:
        return []
    return [
        f"{path}: looks env-major ([N, T]): read as {shape} = [T, N], but {why}; transpose every per-step "
        "dataset to [T, N, ...] (time first), as RSL-RL stores them."
    ]


def _env_first(value: Any) -> bool:
    if value is True or value is None:
        return False
    text = str(value).lower().replace(" ", "")
    return text.startswith(("[n,t", "(n,t", "n,t", "env", "batch,time", "[batch,time")) or text == "env_major"
