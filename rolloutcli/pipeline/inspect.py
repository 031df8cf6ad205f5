"""``rolloutcli inspect``: what a person needs to trust a rollout file before training on it.

Streams env blocks (``--max-memory``) so a file larger than memory can be inspected. Returns plain data
(a JSON-able dict, schema documented in the README); the CLI renders it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from rolloutcli.core.stats import EpisodeStats, Moments
from rolloutcli.errors import RolloutError
from rolloutcli.fields import AUTORESET, by_flag
from rolloutcli.hdf5.reader import H5Input, RolloutReader
from rolloutcli.hdf5.schema import describe
from rolloutcli.pipeline.inspect_tree import env_major_warnings, folder_report, nonfinite, tree_report
from rolloutcli.pipeline.options import RunOptions
from rolloutcli.pipeline.per_dim import per_dim_report, scan_per_dim
from rolloutcli.pipeline.progress import Progress
from rolloutcli.pipeline.timeouts_rule import report as timeouts_report

BLOWUP_WARNING = 10.0  # padded size / input size above which split warns
GAE_ATTRS = ("gae_gamma", "gae_lambda", "advantages_normalized", "timeouts_bootstrapped", "last_values_mode")
MOMENT_FIELDS = tuple(f.name for f in by_flag(load_dtype="float32"))  # rewards, values, ..., returns


def padded_split_bytes(reader: RolloutReader, trajectories: int) -> tuple[int, int]:
    """(input bytes, padded bytes) of the ``[T, N, ...]`` datasets split would pad to ``[T, M, ...]``."""
    schema = reader.schema
    per_step = [schema.fields[n] for n in schema.step_names()]
    input_bytes = sum(spec.nbytes for spec in per_step)
    padded = sum(spec.bytes_per_env() * trajectories for spec in per_step) + schema.T * trajectories
    return input_bytes, padded


def hidden_layout(reader: RolloutReader) -> dict[str, dict[str, Any]]:
    layout = {}
    for net, paths in reader.schema.hidden.items():
        shape = reader.schema.fields[paths[0]].shape
        layout[net] = {
            "type": "LSTM" if len(paths) == 2 else "GRU",
            "layers": shape[1],
            "size": shape[3],
            "datasets": paths,
        }
    return layout


OTHER_FORMATS = ("trajectories", "shard")  # rolloutcli's own outputs that are not rollout files


def run_inspect(
    path: Path, options: RunOptions, progress: Progress | None = None, *, per_dim: bool = False
) -> dict[str, Any]:
    """Summarise ``path``: a rollout file in full; any other HDF5 file it can open safely (or a shard folder) as
    its tree with the one line that says what is missing (``contract`` false). Unsafe or unreadable files raise
    ``RolloutError``; value problems become warnings. ``per_dim`` adds ``per_dim``: per-dimension statistics of
    the observation groups and actions."""
    progress = progress or Progress()
    if Path(path).is_dir():
        return folder_report(Path(path))
    try:
        reader = RolloutReader(path, options.safety, check=False, budget=options.max_memory)
    except RolloutError as error:
        if error.exit_code != 1:
            raise
        return _outside(path, options, error)
    if reader.attrs.get("rolloutcli_format") in OTHER_FORMATS:
        reader.close()
        return _outside(path, options, None)
    with reader:
        return _report(path, reader, options, progress, per_dim)


def _outside(path: Path, options: RunOptions, error: RolloutError | None) -> dict[str, Any]:
    """The tree report of a file ``describe`` refuses (or another rolloutcli format); a file that cannot even
    be opened raises as before."""
    with H5Input(path, options.safety) as source:
        problems = describe(path, source.datasets, source.attrs)[1]
        if error is not None and not problems:
            raise error
        return tree_report(path, source, problems, options.max_memory)


def _report(
    path: Path, reader: RolloutReader, options: RunOptions, progress: Progress, per_dim: bool = False
) -> dict[str, Any]:
    schema = reader.schema
    warnings: list[str] = []
    try:
        reader.check_values()
    except RolloutError as error:
        warnings.extend(error.problems)
    episodes, moments = _scan(reader, progress)
    input_bytes, padded_bytes = padded_split_bytes(reader, episodes.trajectories)
    blowup = padded_bytes / max(input_bytes, 1)
    gae = {k: schema.attrs[k] for k in GAE_ATTRS if k in schema.attrs}
    timeouts, bad_rule = timeouts_report(path, schema.attrs)
    warnings.extend(bad_rule)
    warnings.extend(_warnings(reader, blowup, gae))
    warnings.extend(env_major_warnings(path, schema.T, episodes.per_env, schema.attrs))
    extra = {"per_dim": per_dim_report(scan_per_dim(reader, progress))} if per_dim else {}
    floats = [n for n in schema.step_names() if schema.fields[n].dtype.kind == "f"]
    return {
        "file": str(path),
        "contract": True,
        "kind": "rollout",
        "size_bytes": os.path.getsize(path),
        "format": {"name": schema.attrs.get("rolloutcli_format"), "version": schema.attrs.get("format_version")},
        "T": schema.T,
        "N": schema.N,
        "fields": [
            {
                "name": spec.name,
                "role": spec.role,
                "shape": list(spec.shape),
                "dtype": str(spec.dtype),
                "chunks": list(spec.chunks) if spec.chunks else None,
                "compression": spec.compression,
                "nbytes": spec.nbytes,
            }
            for spec in schema.fields.values()
        ],
        "observations": dict(schema.observation_keys),
        "extras": schema.names("extra"),
        "episodes": _episodes_report(episodes),
        **{name: moments[name].as_dict() if name in moments else None for name in MOMENT_FIELDS},
        "hidden_states": hidden_layout(reader),
        "gae": gae or None,
        "timeouts": timeouts,
        "split": {
            "trajectories": episodes.trajectories,
            "input_bytes": input_bytes,
            "padded_bytes": padded_bytes,
            "blowup": blowup,
        },
        "attrs": schema.attrs,
        "nonfinite": nonfinite(reader, floats, options.max_memory),
        "warnings": warnings,
        **extra,
    }


def _episodes_report(episodes: EpisodeStats) -> dict[str, Any]:
    per_env = episodes.per_env
    return {
        "completed": episodes.completed,
        "terminations": episodes.terminations,
        "time_outs": episodes.time_outs,
        "started_before_recording": episodes.first_completed,
        "unfinished": episodes.unfinished,
        "autoreset_steps": episodes.autoreset_steps,
        "lengths": episodes.length_summary(),
        "histogram": episodes.histogram(),
        "per_env": {"min": min(per_env), "mean": sum(per_env) / len(per_env), "max": max(per_env), "counts": per_env},
    }


def _scan(reader: RolloutReader, progress: Progress) -> tuple[EpisodeStats, dict[str, Moments]]:
    """Episode statistics and the moments of every float field, streamed in env blocks."""
    fields = reader.schema.fields
    steps = [n for n in ("dones", "time_outs", *MOMENT_FIELDS) if n in fields and n != "last_values"]
    autoreset = [AUTORESET] if AUTORESET in fields else []
    blocks = reader.blocks(steps)
    from_reset = reader.schema.attrs.get("recorded_from_reset") is True
    episodes: EpisodeStats | None = None
    moments: dict[str, Moments] = {}
    progress.start("inspect", len(blocks))
    for start, stop in blocks:
        block = reader.arrays(steps + autoreset, start, stop)
        stats = EpisodeStats.of(block["dones"], block.get("time_outs"), from_reset, block.get(AUTORESET))
        episodes = stats if episodes is None else episodes.merge(stats)
        for name in steps[1:]:
            if name != "time_outs":
                value = Moments.of(block[name])
                moments[name] = moments[name].merge(value) if name in moments else value
        progress.advance()
    progress.finish()
    if "last_values" in fields:
        moments["last_values"] = Moments.of(reader.array("last_values"))
    assert episodes is not None
    return episodes, moments


def _warnings(reader: RolloutReader, blowup: float, gae: dict[str, Any]) -> list[str]:
    schema = reader.schema
    path = reader.path
    found = []
    if "values" not in schema.fields:  # an import, offline data: whatever gae would need more is moot
        found.append(
            f"{path}: no 'values' (no critic): gae cannot run on this file; returns, nstep and batch "
            "--transitions need none."
        )
    elif "last_values" not in schema.fields:
        found.append(
            f"{path}: no 'last_values': gae needs V(s_T) to bootstrap the rollout end; record it, or "
            "run gae with --last-values zero to treat the end as terminal."
        )
    if "time_outs" not in schema.fields:
        found.append(f"{path}: no 'time_outs': truncated episodes cannot be bootstrapped.")
    if blowup > BLOWUP_WARNING:
        found.append(
            f"{path}: split would pad the per-step data {blowup:.1f}x (RSL-RL pads every trajectory to "
            "T); use split --pad-to longest or --max-length K."
        )
    # timeouts_bootstrapped alone is no trace of gae: recorders write it (format 1.1: rewards holding the bootstrap)
    if ("advantages" in schema.fields) != bool(set(gae) - {"timeouts_bootstrapped"}):
        found.append(
            f"{path}: 'advantages' and the gae attributes disagree (one without the other); "
            "re-run gae to be sure how they were computed."
        )
    return found
