"""``rolloutcli split``: every per-step field split at dones and padded, streamed in env blocks; and its inverse.

Split output layout (``rolloutcli_format = "trajectories"``):

| dataset | shape | meaning |
| --- | --- | --- |
| every per-step field (``observations/<k>``, ``actions``, ...) | ``[L, M, ...]`` | padded, same dtype |
| ``masks`` | ``[L, M]`` bool | True on valid steps |
| ``trajectory_env``, ``trajectory_start``, ``trajectory_length`` | ``[M]`` int64 | where each trajectory lies |
| ``hidden_states/<actor|critic>/<i>`` | ``[layers, M, H]`` | state at each trajectory's first step |
| ``rollout/hidden_states/<actor|critic>/<i>`` | ``[T, layers, N, H]`` | recorded states, verbatim (for unpad) |
| any other dataset (``last_values``, extras) | as stored | copied verbatim |

Every attribute and dataset of object references is kept (re-pointed into the output) and ``--unpad`` restores all
of it; a per-step field of references or variable-length data is refused (its bytes point elsewhere in the file).
Fields are moved as raw bytes (rows viewed as ``uint8``), so every dtype round-trips bit for bit.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rolloutcli.core.stats import EpisodeStats
from rolloutcli.core.trajectories import (
    TrajectorySpans,
    clear_trajectories,
    hidden_states_at_starts,
    plan_trajectories,
    scatter_into_trajectories,
    trajectory_buffer_view,
    trajectory_spans,
    unpad_with_spans,
)
from rolloutcli.errors import RolloutError, problem_line
from rolloutcli.hdf5.atomic import atomic_file, check_output_path
from rolloutcli.hdf5.reader import H5Input, RolloutReader
from rolloutcli.hdf5.schema import FORMAT_NAME
from rolloutcli.hdf5.writer import RolloutOutput
from rolloutcli.pipeline.import_limits import check_free_space
from rolloutcli.pipeline.inspect import BLOWUP_WARNING
from rolloutcli.pipeline.options import RunOptions
from rolloutcli.pipeline.progress import Progress
from rolloutcli.pipeline.split_checks import SPAN_NAMES, unpaddable, unpadded_bytes

SPLIT_FORMAT = "trajectories"
FULL_HIDDEN_PREFIX = "rollout/"


@dataclass(frozen=True)
class SplitOptions:
    """``pad_to``: ``"rollout"`` (L = T, RSL-RL; min(T, K) with ``max_length`` K) or ``"longest"``."""

    pad_to: str = "rollout"
    max_length: int | None = None


def _row_bytes(reader: RolloutReader, name: str) -> int:
    spec = reader.schema.fields[name]
    return spec.nbytes // max(spec.shape[0] * spec.shape[1], 1)


def _to_split(name: str) -> str:
    """Where a rollout object lands in the split file (recorded hidden states move under ``rollout/``)."""
    return FULL_HIDDEN_PREFIX + name if name.split("/")[0] == "hidden_states" else name


def _from_split(name: str) -> str | None:
    """Where a split file's object lands in the restored rollout (None: split's own, derived data)."""
    top = name.split("/")[0]
    if name.startswith(FULL_HIDDEN_PREFIX + "hidden_states"):
        return name[len(FULL_HIDDEN_PREFIX) :]
    return None if top in ("rollout", "hidden_states", "masks", *SPAN_NAMES) else name


def _as_byte_rows(array: np.ndarray) -> torch.Tensor:
    """``[T, n, ...]`` of any dtype -> ``[T, n, row_bytes]`` uint8 (a view: no conversion, bit exact)."""
    T, n = array.shape[:2]
    contiguous = np.ascontiguousarray(array)
    return torch.from_numpy(contiguous.reshape(T, n, -1).view(np.uint8))


def _from_byte_rows(rows: torch.Tensor, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    return rows.cpu().numpy().view(dtype).reshape(shape)


def _plan_blocks(
    counts: np.ndarray, T: int, L: int, in_bytes: int, out_bytes: int, budget: int
) -> list[tuple[int, int]]:
    """Env blocks whose input (``T * in_bytes`` per env) plus padded output (``count * L * out_bytes``) fit."""
    per_env = T * in_bytes + counts.astype(np.int64) * L * out_bytes
    blocks, start, used = [], 0, 0
    for env, size in enumerate(per_env.tolist()):
        if env > start and used + size > budget:
            blocks.append((start, env))
            start, used = env, 0
        used += size
    blocks.append((start, len(per_env)))
    return blocks


def run_split(
    src: Path,
    dst: Path,
    options: SplitOptions,
    run: RunOptions,
    *,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Write the split-and-padded trajectories of ``src`` to ``dst`` (see the module docstring)."""
    progress = progress or Progress()
    started = time.perf_counter()
    check_output_path(dst, [src], overwrite=overwrite)  # before the input is read; atomic_file checks again
    with RolloutReader(src, run.safety, budget=run.max_memory) as reader:
        schema = reader.schema
        T, N = schema.T, schema.N
        fields = schema.step_names()  # the per-step fields and the extras laid out [T, N, ...]
        problems = unpaddable(src, {name: schema.fields[name].dtype for name in fields})
        if problems:
            raise RolloutError.many(src, problems)
        counts, lengths = _count_trajectories(reader, options.max_length)
        M = int(counts.sum())
        # L: RSL-RL pads to T; segments of at most K steps never need more than K rows.
        L = T if options.pad_to == "rollout" else int(np.flatnonzero(lengths)[-1])
        if options.max_length is not None and options.pad_to == "rollout":
            L = min(T, options.max_length)
        row_bytes = {name: _row_bytes(reader, name) for name in fields}
        per_row = sum(row_bytes.values())
        input_bytes = sum(schema.fields[name].nbytes for name in fields)
        padded_bytes = (per_row + 1) * L * M  # + masks
        blowup = padded_bytes / max(input_bytes, 1)
        if blowup > BLOWUP_WARNING:
            progress.warn(
                f"{src}: padding multiplies the per-step data {blowup:.1f}x ({M} trajectories padded to "
                f"{L} steps); use --pad-to longest or --max-length K to bound it."
            )
        # Padding can make the output far larger than the input: refused before any of it is written.
        check_free_space(dst, padded_bytes + unpadded_bytes(schema, fields, M))
        blocks = _plan_blocks(counts, T, L, per_row, per_row + 1, max(run.max_memory // 2, 1))
        with atomic_file(dst, inputs=[src], overwrite=overwrite) as tmp, RolloutOutput(tmp, dst, reader) as out:
            _write_split(reader, out, fields, row_bytes, counts, L, options, run, blocks, progress)
            _finish_split(reader, out, fields, options, progress)
    return {
        "input": str(src),
        "output": str(dst),
        "T": T,
        "N": N,
        "trajectories": M,
        "padded_length": L,
        "pad_to": options.pad_to,
        "max_length": options.max_length,
        "fields": fields,
        "trajectory_lengths": EpisodeStats(T, lengths).length_summary(),
        "input_bytes": input_bytes,
        "padded_bytes": padded_bytes,
        "padding_overhead": blowup,
        "blocks": len(blocks),
        "seconds": time.perf_counter() - started,
    }


def _count_trajectories(reader: RolloutReader, max_length: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Pass 1 (dones only): trajectories per env ``[N]`` and the count of each length ``[T + 1]``."""
    counts, lengths = np.zeros(reader.N, np.int64), np.zeros(reader.T + 1, np.int64)
    reader.check_fits(reader.schema.step_names())  # one env's input is read whole: it must fit
    for start, stop in reader.blocks(["dones"]):
        spans = trajectory_spans(reader.tensor("dones", start, stop), max_length)
        counts[start:stop] = torch.bincount(spans.env, minlength=stop - start).numpy()
        lengths += torch.bincount(spans.length, minlength=reader.T + 1).numpy()
    return counts, lengths


def _write_split(
    reader: RolloutReader,
    out: RolloutOutput,
    fields: list[str],
    row_bytes: dict[str, int],
    counts: np.ndarray,
    L: int,
    options: SplitOptions,
    run: RunOptions,
    blocks: list[tuple[int, int]],
    progress: Progress,
) -> None:
    schema = reader.schema
    M = int(counts.sum())
    hidden = [path for paths in schema.hidden.values() for path in paths]
    out.copy(reader.named_types)  # first: the datasets created below may use them
    out.copy([name for name in schema.fields if name not in fields and name not in hidden])
    out.copy(hidden, rename=_to_split)
    for name in fields:
        out.create(name, (L, M, *schema.fields[name].shape[2:]), like=name)
    out.create("masks", (L, M), bool)
    for name in SPAN_NAMES:
        out.create(name, (M,), np.int64)
    for path in hidden:
        out.create(path, (schema.fields[path].shape[1], M, schema.fields[path].shape[3]), like=path)
    first_trajectory = np.concatenate([[0], np.cumsum(counts)])
    device = run.device
    largest = max(int(counts[a:b].sum()) for a, b in blocks) * L
    buffers = {name: torch.zeros(largest * row_bytes[name], dtype=torch.uint8, device=device) for name in fields}
    progress.start("split", len(blocks))
    for start, stop in blocks:
        m0, m1 = int(first_trajectory[start]), int(first_trajectory[stop])
        columns = (slice(None), slice(m0, m1))
        plan = plan_trajectories(reader.tensor("dones", start, stop, device), pad_to=L, max_length=options.max_length)
        for name in fields:
            rows = _as_byte_rows(reader.read(name, start, stop)).to(device)
            view = trajectory_buffer_view(buffers[name], plan, [row_bytes[name]])
            padded = scatter_into_trajectories(rows, plan, view, zero=False)
            spec = schema.fields[name]
            out.write(name, columns, _from_byte_rows(padded, spec.dtype, (L, m1 - m0, *spec.shape[2:])))
            clear_trajectories(view, plan)  # leave the reused buffer all zeros for the next block
        out.write("masks", columns, plan.masks())
        spans = plan.spans
        for name, value in zip(SPAN_NAMES, (spans.env + start, spans.start, spans.length), strict=True):
            out.write(name, (slice(m0, m1),), value)
        for path in hidden:
            state = torch.from_numpy(reader.read(path, start, stop)).to(device)
            out.write(path, columns, hidden_states_at_starts(state, spans))
        progress.advance()
    progress.finish()


def _finish_split(
    reader: RolloutReader, out: RolloutOutput, fields: list[str], options: SplitOptions, progress: Progress
) -> None:
    """Every source attribute, then split's own root attributes."""
    for dropped in out.copy_attrs(_to_split):
        progress.warn(f"{reader.path}: attribute '{dropped}' refers to an object the output does not hold; dropped.")
    out.set_attrs(
        {
            "rolloutcli_format": SPLIT_FORMAT,
            "source_format": str(reader.attrs.get("rolloutcli_format", FORMAT_NAME)),
            "source_T": reader.T,
            "source_N": reader.N,
            "split_pad_to": options.pad_to,
            "split_max_length": options.max_length or 0,
            "split_fields": fields,
        }
    )


def run_unpad(
    src: Path, dst: Path, run: RunOptions, *, overwrite: bool = False, progress: Progress | None = None
) -> dict[str, Any]:
    """Restore the ``[T, N, ...]`` rollout from a split file written by ``run_split`` (exact inverse)."""
    progress = progress or Progress()
    started = time.perf_counter()
    check_output_path(dst, [src], overwrite=overwrite)  # before the input is read; atomic_file checks again
    with H5Input(src, run.safety) as source:
        layout = _split_layout(source)
        with atomic_file(dst, inputs=[src], overwrite=overwrite) as tmp, RolloutOutput(tmp, dst, source) as out:
            _write_unpad(source, out, layout, run, progress)
    return {
        "input": str(src),
        "output": str(dst),
        "T": layout["T"],
        "N": layout["N"],
        "trajectories": layout["M"],
        "fields": layout["fields"],
        "seconds": time.perf_counter() - started,
    }


def _split_layout(source: H5Input) -> dict[str, Any]:
    """Read and check the split file's layout; every problem at once."""
    path, attrs, datasets = source.path, source.attrs, source.datasets
    if attrs.get("rolloutcli_format") != SPLIT_FORMAT:
        raise RolloutError.field(
            path,
            "/ (attribute rolloutcli_format)",
            f"'{SPLIT_FORMAT}' (a file written by rolloutcli split)",
            repr(attrs.get("rolloutcli_format")),
            "--unpad reads the output of split.",
        )
    problems = []
    sizes = {key: _positive_int(attrs.get(key)) for key in ("source_T", "source_N")}
    for key, value in sizes.items():
        if value is None:
            found = repr(attrs.get(key)) if key in attrs else "nothing"
            problems.append(problem_line(path, f"/ (attribute {key})", "a positive integer", found))
    raw_fields = attrs.get("split_fields")
    names = [] if raw_fields is None else np.atleast_1d(raw_fields).tolist()
    fields = [f.decode("utf-8", "replace") if isinstance(f, bytes) else str(f) for f in names]
    if raw_fields is None or not fields:
        problems.append(problem_line(path, "/ (attribute split_fields)", "the names of the split fields", "nothing"))
    for name in (*SPAN_NAMES, "masks", *fields):
        if name not in datasets:
            problems.append(problem_line(path, name, "a dataset written by split", "nothing"))
    problems += unpaddable(path, {name: datasets[name].dtype for name in fields if name in datasets})
    if problems:
        raise RolloutError.many(path, problems)
    T, N = int(sizes["source_T"] or 0), int(sizes["source_N"] or 0)
    masks_shape = datasets["masks"].shape
    L, M = (masks_shape[0], masks_shape[1]) if len(masks_shape) == 2 else (0, -1)
    if len(masks_shape) != 2 or not 0 < L <= T or M > T * N:
        problems.append(problem_line(path, "masks", f"shape [L, M] with L <= T = {T}, M <= T*N", str(masks_shape)))
    for name in (*SPAN_NAMES, *fields):
        shape = datasets[name].shape
        expected = (M,) if name in SPAN_NAMES else (L, M)
        if shape[: len(expected)] != expected or (name in SPAN_NAMES and len(shape) != 1):
            text = "[M]" if name in SPAN_NAMES else "[L, M, ...]"
            problems.append(problem_line(path, name, f"shape {text} = {list(expected)}", f"shape {shape}"))
    if problems:
        raise RolloutError.many(path, problems)
    spans = TrajectorySpans(*(torch.from_numpy(source.slice(name).astype(np.int64)) for name in SPAN_NAMES))
    if not _spans_tile(spans, T, N):
        raise RolloutError.field(
            path,
            "trajectory_env/trajectory_start/trajectory_length",
            f"env-major spans tiling every env's T = {T} steps (N = {N} envs)",
            f"spans covering {int(spans.length.sum()) if M else 0} of {T * N} steps or overlapping",
        )
    counts = np.bincount(spans.env.numpy(), minlength=N)
    return {"T": T, "N": N, "M": M, "L": L, "fields": fields, "spans": spans, "counts": counts}


def _positive_int(value: Any) -> int | None:
    """``value`` as an int when it is a positive integer (a split file's source_T / source_N), else None."""
    if isinstance(value, np.ndarray) and value.size == 1:
        value = value.reshape(()).item()
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None


def _spans_tile(spans: TrajectorySpans, T: int, N: int) -> bool:
    """True when the spans are env-major and each env's trajectories tile its steps ``[0, T)`` exactly."""
    env, start, length = spans.env, spans.start, spans.length
    if env.numel() == 0:
        return T * N == 0
    if bool((length < 1).any()) or bool((start < 0).any()) or bool((start + length > T).any()):
        return False
    if int(env.min()) < 0 or int(env.max()) >= N or bool((env[1:] < env[:-1]).any()):
        return False
    first = torch.ones_like(env, dtype=torch.bool)
    first[1:] = env[1:] != env[:-1]
    last = torch.ones_like(first)
    last[:-1] = first[1:]
    end = start + length
    follows = torch.where(first, start == 0, start == torch.roll(end, 1))
    return bool(follows.all()) and bool((end[last] == T).all()) and int(first.sum()) == N


def _write_unpad(
    source: H5Input, out: RolloutOutput, layout: dict[str, Any], run: RunOptions, progress: Progress
) -> None:
    T, N, L, fields, spans = layout["T"], layout["N"], layout["L"], layout["fields"], layout["spans"]
    counts = layout["counts"]
    first_trajectory = np.concatenate([[0], np.cumsum(counts)])
    shapes = {name: source.datasets[name].shape[2:] for name in fields}
    row_bytes = {name: source.datasets[name].dtype.itemsize * math.prod(shapes[name]) for name in fields}
    blocks = _plan_blocks(counts, T, L, sum(row_bytes.values()), sum(row_bytes.values()), max(run.max_memory // 2, 1))
    rest = [name for name in source.datasets if name not in fields and _from_split(name) is not None]
    out.copy(source.named_types)
    out.copy(rest, rename=lambda name: _from_split(name) or name)
    for name in fields:
        out.create(name, (T, N, *shapes[name]), like=name)
    progress.start("unpad", len(blocks))
    for start, stop in blocks:
        m0, m1 = int(first_trajectory[start]), int(first_trajectory[stop])
        block_spans = TrajectorySpans(spans.env[m0:m1] - start, spans.start[m0:m1], spans.length[m0:m1])
        for name in fields:
            padded = source.slice(name, (slice(None), slice(m0, m1)))
            restored = unpad_with_spans(_as_byte_rows(padded).to(run.device), block_spans, T, stop - start)
            out.write(
                name,
                (slice(None), slice(start, stop)),
                _from_byte_rows(restored, padded.dtype, (T, stop - start, *shapes[name])),
            )
        progress.advance()
    progress.finish()
    for dropped in out.copy_attrs(_from_split):
        progress.warn(f"{source.path}: attribute '{dropped}' refers to an object the output does not hold; dropped.")
    out.delete_attrs(["source_T", "source_N", "split_pad_to", "split_max_length", "split_fields", "source_format"])
    out.set_attrs({"rolloutcli_format": source.attrs.get("source_format", FORMAT_NAME)})
