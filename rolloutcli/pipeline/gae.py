"""``rolloutcli gae``: advantages and returns for a rollout file, streamed in env blocks.

GAE is independent per env, so the file is processed in env blocks sized by ``--max-memory``:
pass 1 computes ``A`` and ``returns`` per block and gathers per-env moments of ``A``; when normalising,
pass 2 rewrites ``advantages = (A - mean) / (std + 1e-8)`` with the global mean and unbiased std.
Datasets GAE does not touch are carried over by copying the file's bytes (``copy_file_range``/``sendfile``,
nothing decoded), then the copy is opened ``r+`` and only ``advantages``, ``returns`` (and bootstrapped
``rewards``, the recorded ones kept as ``rewards_raw``) are written.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rolloutcli.core.gae import bootstrap_time_outs, compute_gae, normalize_with
from rolloutcli.core.stats import EnvMoments, Moments
from rolloutcli.errors import EXIT_BAD_DATA, EXIT_IO, EXIT_USAGE, RolloutError, problem_line
from rolloutcli.hdf5.atomic import atomic_file, check_output_path
from rolloutcli.hdf5.reader import RolloutReader
from rolloutcli.hdf5.safety import HDF5_ERRORS, check_regular_file, translate_write_error
from rolloutcli.hdf5.writer import copy_file_bytes, create_empty, open_for_update, write_env_block
from rolloutcli.pipeline.options import RunOptions
from rolloutcli.pipeline.progress import NoProgress, Progress

WRITTEN = ("advantages", "returns")


@dataclass(frozen=True)
class GaeOptions:
    """What ``gae`` computes.

    Attributes:
        gamma, lam: discount and GAE lambda.
        normalize: normalise advantages over the whole rollout (returns are never normalised).
        bootstrap_timeouts: apply ``r_t += gamma * V(s_t) * time_out_t``; None = when ``time_outs`` exists.
        last_values: ``"recorded"`` (require the dataset) or ``"zero"`` (treat the rollout end as terminal).
    """

    gamma: float = 0.99
    lam: float = 0.95
    normalize: bool = True
    bootstrap_timeouts: bool | None = None
    last_values: str = "recorded"


def _check(reader: RolloutReader, options: GaeOptions) -> bool:
    """Validate what GAE needs; return whether rewards get bootstrapped by this run."""
    path, fields, attrs = reader.path, reader.schema.fields, reader.schema.attrs
    problems = []
    if not 0.0 <= options.gamma <= 1.0 or not 0.0 <= options.lam <= 1.0:
        raise RolloutError(
            f"--gamma/--lam: expected values in [0, 1], found gamma={options.gamma}, lam={options.lam}.",
            exit_code=EXIT_USAGE,
        )
    if options.last_values not in ("recorded", "zero"):
        raise RolloutError(
            f"--last-values: expected 'recorded' or 'zero', found '{options.last_values}'.", exit_code=EXIT_USAGE
        )
    if "values" not in fields:
        problems.append(
            problem_line(
                path, "values", "a dataset [T, N] of V(s_t)", "nothing", "gae needs the critic's values; record them."
            )
        )
    if "last_values" not in fields and options.last_values == "recorded":
        problems.append(
            problem_line(
                path,
                "last_values",
                "a dataset [N] of V(s_T) to bootstrap the rollout end",
                "nothing",
                "Record it, or pass --last-values zero to treat the end of the rollout as terminal.",
            )
        )
    if options.bootstrap_timeouts and "time_outs" not in fields:
        problems.append(
            problem_line(
                path,
                "time_outs",
                "a dataset [T, N] for --bootstrap-timeouts",
                "nothing",
                "Record time-outs, or pass --no-bootstrap-timeouts.",
            )
        )
    if problems:
        raise RolloutError.many(path, problems, exit_code=EXIT_BAD_DATA)
    wanted = options.bootstrap_timeouts if options.bootstrap_timeouts is not None else "time_outs" in fields
    already = bool(attrs.get("timeouts_bootstrapped", False))
    return bool(wanted) and not already


def run_gae(
    src: Path,
    dst: Path | None,
    options: GaeOptions,
    run: RunOptions,
    *,
    overwrite: bool = False,
    in_place: bool = False,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Write ``dst`` (or replace ``src`` when ``in_place``) = ``src`` + advantages, returns, attributes."""
    progress = progress or NoProgress()
    started = time.perf_counter()
    src = Path(src)
    if in_place:
        dst = Path(os.path.realpath(src))  # replace the file itself, not a symlink to it
    if dst is None:
        raise RolloutError(
            "gae: expected an output path (-o OUT.h5) or --in-place, found neither.", exit_code=EXIT_USAGE
        )
    # Refuse a bad output before the (possibly long) validation pass; atomic_file checks again.
    check_output_path(dst, [src], overwrite=overwrite or in_place, replace_input=in_place)
    if in_place:
        check_regular_file(src)
        if not os.access(src, os.W_OK):
            raise RolloutError(
                f"{src}: the input is write-protected; refusing to replace it with --in-place. "
                "Make it writable (chmod u+w) or write a new file with -o OUT.h5.",
                exit_code=EXIT_IO,
            )
    with RolloutReader(src, run.safety, budget=run.max_memory) as reader:
        bootstrap = _check(reader, options)
        already = bool(reader.schema.attrs.get("timeouts_bootstrapped", False))
        with atomic_file(dst, inputs=[src], overwrite=overwrite, replace_input=in_place) as tmp:
            try:
                summary = _write(reader, tmp, options, run, bootstrap, progress)
            except HDF5_ERRORS as exc:
                raise translate_write_error(dst, exc, src) from exc
    summary.update(
        {
            "input": str(src),
            "output": str(dst),
            "in_place": in_place,
            "gamma": options.gamma,
            "lambda": options.lam,
            "normalized": options.normalize,
            "timeouts_bootstrapped": bootstrap or already,
            "bootstrapped_by_this_run": bootstrap,
            "last_values": options.last_values,
            "seconds": time.perf_counter() - started,
        }
    )
    return summary


def _write(
    reader: RolloutReader, tmp: Path, options: GaeOptions, run: RunOptions, bootstrap: bool, progress: Progress
) -> dict[str, Any]:
    schema = reader.schema
    T, N = schema.T, schema.N
    inputs = [n for n in ("rewards", "values", "dones", "time_outs") if n in schema.fields]
    # bytes per env in flight: inputs as stored + float32 copies + A, R (and bootstrapped rewards)
    blocks = reader.blocks(inputs, budget=max(run.max_memory // 4, 1))
    touched = set(WRITTEN) | ({"rewards"} if bootstrap else set())
    # Everything GAE does not touch is carried over by copying the file's bytes (kernel copy, as fast as
    # cp, nothing decoded); the copy is then opened r+ and the written datasets are replaced.
    progress.start("copy", max(1, reader.path.stat().st_size))
    copy_file_bytes(reader.path, tmp, progress.advance)
    with open_for_update(tmp) as out:
        if bootstrap:
            if "rewards_raw" in out:
                del out["rewards_raw"]
            out.move("rewards", "rewards_raw")
            out["rewards_raw"].attrs["meaning"] = "rewards as recorded, before time-out bootstrapping"
        for name in touched:
            if name in out:
                del out[name]
        datasets = {name: create_empty(out, name, (T, N), "float32") for name in touched}
        moments = EnvMoments()
        advantage_moments = Moments()
        return_moments = Moments()
        bootstrapped = 0
        progress.start("gae", len(blocks) * (2 if options.normalize and len(blocks) > 1 else 1))
        single = len(blocks) == 1
        kept: torch.Tensor | None = None
        needed = ["rewards", "values", "dones"] + (["time_outs"] if bootstrap else [])
        if "last_values" in schema.fields and options.last_values == "recorded":
            needed.append("last_values")
        for start, stop in blocks:
            block = reader.tensors(needed, start, stop, run.device)
            rewards, values, dones = block["rewards"], block["values"], block["dones"]
            last_values = block.get("last_values")
            if last_values is None:
                last_values = torch.zeros(stop - start, device=run.device)
            time_outs = block.get("time_outs")
            advantages, returns = compute_gae(
                rewards, values, dones, last_values, gamma=options.gamma, lam=options.lam, time_outs=time_outs
            )
            if bootstrap:
                assert time_outs is not None
                bootstrapped += int(time_outs.sum())
                bootstrapped_rewards = bootstrap_time_outs(rewards, values, time_outs, options.gamma)
                write_env_block(datasets["rewards"], 1, start, stop, bootstrapped_rewards)
            write_env_block(datasets["returns"], 1, start, stop, returns)
            return_moments = return_moments.merge(Moments.of(returns))
            if options.normalize:
                moments.add(advantages)
            if options.normalize and single:
                kept = advantages
            else:
                write_env_block(datasets["advantages"], 1, start, stop, advantages)
                advantage_moments = advantage_moments.merge(Moments.of(advantages))
            progress.advance()
        raw_mean = raw_std = None
        if options.normalize:
            raw_mean, raw_std = moments.mean_std()
            for start, stop in blocks:
                raw = kept if single else torch.from_numpy(datasets["advantages"][:, start:stop]).to(run.device)
                assert raw is not None
                normalized = normalize_with(raw, raw_mean, raw_std)
                write_env_block(datasets["advantages"], 1, start, stop, normalized)
                advantage_moments = advantage_moments.merge(Moments.of(normalized))
                if not single:
                    progress.advance()
        progress.finish()
        out.attrs["gae_gamma"] = options.gamma
        out.attrs["gae_lambda"] = options.lam
        out.attrs["advantages_normalized"] = options.normalize
        out.attrs["timeouts_bootstrapped"] = bootstrap or bool(schema.attrs.get("timeouts_bootstrapped", False))
        out.attrs["last_values_mode"] = options.last_values
        if raw_mean is not None:
            out.attrs["advantages_raw_mean"] = raw_mean
            out.attrs["advantages_raw_std"] = raw_std
    return {
        "T": T,
        "N": N,
        "blocks": len(blocks),
        "bootstrapped_rewards": bootstrapped,
        "advantages": advantage_moments.as_dict(),
        "returns": return_moments.as_dict(),
        "advantages_raw_mean": raw_mean,
        "advantages_raw_std": raw_std,
    }
