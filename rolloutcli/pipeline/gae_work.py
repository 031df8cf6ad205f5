"""The work of ``rolloutcli gae`` once its output's copy is under way (see :mod:`rolloutcli.pipeline.gae`).

Imported by :func:`rolloutcli.pipeline.gae.run_gae` only after the background copy has started, so that
loading h5py, numpy and the kernels overlaps the copy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from rolloutcli.core import native as native_kernels
from rolloutcli.core.gae_numpy import bootstrap_time_outs_array, normalize_array
from rolloutcli.core.moments import EnvMoments, Moments
from rolloutcli.errors import EXIT_BAD_DATA, EXIT_USAGE, RolloutError, problem_line
from rolloutcli.hdf5.filecopy import BackgroundCopy
from rolloutcli.hdf5.reader import RolloutReader
from rolloutcli.hdf5.safety import HDF5_ERRORS, translate_write_error
from rolloutcli.hdf5.writer import create_empty, open_for_update, write_env_block
from rolloutcli.pipeline.gae import WRITTEN, GaeOptions
from rolloutcli.pipeline.options import RunOptions
from rolloutcli.pipeline.progress import Progress


def compute_into(
    src: Path,
    dst: Path,
    tmp: Path,
    copy: BackgroundCopy,
    options: GaeOptions,
    run: RunOptions,
    progress: Progress,
) -> tuple[dict[str, Any], bool, bool]:
    """Validate ``src``, compute GAE and add the results to ``tmp`` (``src``'s copy, once ``copy`` completes).

    Returns ``(summary, bootstrapped by this run, bootstrapped before)``.
    """
    try:
        with RolloutReader(src, run.safety, budget=run.max_memory) as reader:
            bootstrap = _check(reader, options)
            already = bool(reader.schema.attrs.get("timeouts_bootstrapped", False))
            return _write(reader, tmp, copy, options, run, bootstrap, progress), bootstrap, already
    except HDF5_ERRORS as exc:
        raise translate_write_error(dst, exc, src) from exc


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


Kernel = Callable[[dict[str, np.ndarray], float, float], tuple[np.ndarray, np.ndarray]]


def _kernel(device: str) -> Kernel:
    """``kernel(block, gamma, lam) -> (A, returns)``, float32 ``[T, n]`` host arrays, for one env block.

    ``block`` holds ``rewards``, ``values``, ``dones``, ``last_values`` and (to bootstrap) ``time_outs`` as
    :meth:`RolloutReader.array` returns them. On the CPU the compiled C kernel runs on the arrays themselves
    (numba's where the C file was not compiled); any other device gets a copy of the block and the torch scan.
    """
    if device == "cpu":
        native = native_kernels.gae_kernel()  # the compiled kernel: loads in microseconds
        if native is None:  # not compiled here: numba's kernel (~0.28 s to load; equal up to float32
            # rounding where it cuts a long rollout of few envs into time chunks)
            from rolloutcli.core import gae_kernels

            threads = gae_kernels.cpu_threads()

        def on_cpu(block: dict[str, np.ndarray], gamma: float, lam: float) -> tuple[np.ndarray, np.ndarray]:
            rewards, values, dones = block["rewards"], block["values"], block["dones"]
            time_outs, last_values = block.get("time_outs"), block["last_values"]
            advantages, returns = np.empty_like(rewards), np.empty_like(rewards)
            if native is not None:
                native(rewards, values, dones, time_outs, last_values, gamma, lam, advantages, returns)
            else:
                gae_kernels.gae_into(
                    rewards, values, dones, last_values, time_outs, gamma, lam, threads, advantages, returns
                )
            return advantages, returns

        return on_cpu

    import torch

    from rolloutcli.core.gae import compute_gae

    def on_device(block: dict[str, np.ndarray], gamma: float, lam: float) -> tuple[np.ndarray, np.ndarray]:
        tensors = {name: torch.from_numpy(array).to(device) for name, array in block.items()}
        advantages, returns = compute_gae(
            tensors["rewards"],
            tensors["values"],
            tensors["dones"],
            tensors["last_values"],
            gamma=gamma,
            lam=lam,
            time_outs=tensors.get("time_outs"),
        )
        return advantages.cpu().numpy(), returns.cpu().numpy()

    return on_device


def _write(
    reader: RolloutReader,
    tmp: Path,
    copy: BackgroundCopy,
    options: GaeOptions,
    run: RunOptions,
    bootstrap: bool,
    progress: Progress,
) -> dict[str, Any]:
    schema = reader.schema
    T, N = schema.T, schema.N
    inputs = [n for n in ("rewards", "values", "dones", "time_outs") if n in schema.fields]
    # bytes per env in flight: inputs as stored + float32 copies + A, R (and bootstrapped rewards)
    blocks = reader.blocks(inputs, budget=max(run.max_memory // 4, 1))
    touched = set(WRITTEN) | ({"rewards"} if bootstrap else set())
    needed = ["rewards", "values", "dones"] + (["time_outs"] if bootstrap else [])
    if "last_values" in schema.fields and options.last_values == "recorded":
        needed.append("last_values")
    kernel = _kernel(run.device)  # loads the kernel (C; numba or torch where that is not built) during the copy
    moments = EnvMoments()
    advantage_moments = Moments()
    return_moments = Moments()
    bootstrapped = 0
    single = len(blocks) == 1
    kept: np.ndarray | None = None
    out: Any = None  # the temporary output, opened once the copy is complete
    datasets: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:

        def output() -> dict[str, Any]:
            """The output's new datasets, created once the copy is complete (the first block is computed
            while the copy runs)."""
            nonlocal out
            if out is None:
                copy.wait(progress.advance)
                out = stack.enter_context(open_for_update(tmp))
                datasets.update(_prepare_output(out, touched, bootstrap, T, N))
                progress.start("gae", len(blocks) * (2 if options.normalize and not single else 1))
            return datasets

        for start, stop in blocks:
            block = reader.arrays(needed, start, stop)
            if "last_values" not in block:
                block["last_values"] = np.zeros(stop - start, np.float32)
            advantages, returns = kernel(block, options.gamma, options.lam)
            if options.normalize:
                moments.add(advantages)
            return_moments = return_moments.merge(Moments.of(returns))
            written = output()
            if bootstrap:
                time_outs = block["time_outs"]
                bootstrapped += int(np.count_nonzero(time_outs))
                rewards = bootstrap_time_outs_array(block["rewards"], block["values"], time_outs, options.gamma)
                write_env_block(written["rewards"], 1, start, stop, rewards)
            write_env_block(written["returns"], 1, start, stop, returns)
            if options.normalize and single:
                kept = advantages
            else:
                write_env_block(written["advantages"], 1, start, stop, advantages)
                advantage_moments = advantage_moments.merge(Moments.of(advantages))
            progress.advance()
        written = output()  # also for T * N = 0 (no blocks)
        raw_mean = raw_std = None
        if options.normalize:
            raw_mean, raw_std = moments.mean_std()
            for start, stop in blocks:
                raw = kept if single else written["advantages"][:, start:stop]
                assert raw is not None
                normalized = normalize_array(raw, raw_mean, raw_std)
                write_env_block(written["advantages"], 1, start, stop, normalized)
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


def _prepare_output(out: Any, touched: set[str], bootstrap: bool, T: int, N: int) -> dict[str, Any]:
    """Make room in the copied file: keep the recorded rewards as ``rewards_raw`` when bootstrapping, drop any
    earlier ``advantages``/``returns``; return the new empty float32 ``[T, N]`` datasets by name."""
    if bootstrap:
        if "rewards_raw" in out:
            del out["rewards_raw"]
        out.move("rewards", "rewards_raw")
        out["rewards_raw"].attrs["meaning"] = "rewards as recorded, before time-out bootstrapping"
    for name in touched:
        if name in out:
            del out[name]
    return {name: create_empty(out, name, (T, N), "float32") for name in sorted(touched)}
