"""``rolloutcli plot``: pictures of a rollout file (PNG, SVG or HTML), from two streamed passes over env blocks.

Pass 1 gathers the episodes (whole and cut by the recording), the reward per step, dones and time-outs per
env, split's trajectory lengths, the per-dimension statistics of observations and actions, and the range of
every distribution; pass 2 counts the histograms in bins fixed by those ranges. Only these summaries stay in
memory (the episodes: 17 bytes each, at most two cut ones per env; the reward per step: 32 bytes a step); the
figure is drawn by :mod:`rolloutcli.pipeline.plot_figure` (matplotlib, the ``plot`` extra, imported only here).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from rolloutcli.core.moments import Moments
from rolloutcli.core.per_dim import DimMoments
from rolloutcli.core.plot_data import (
    Episodes,
    Histogram,
    PerStep,
    max_length_grid,
    padding_blowup,
    split_length_counts,
)
from rolloutcli.errors import EXIT_USAGE, RolloutError
from rolloutcli.hdf5.atomic import atomic_file, check_output_path
from rolloutcli.hdf5.reader import RolloutReader
from rolloutcli.pipeline.options import RunOptions
from rolloutcli.pipeline.progress import Progress

FORMATS = (".png", ".svg", ".html")
DISTRIBUTIONS = ("rewards", "values", "advantages", "returns")
ACTION_DIMS = 16  # the action grid shows at most this many dimensions


def _sources(reader: RolloutReader) -> dict[str, str]:
    """The dataset of each distribution in the file: a ``gae`` output's raw rewards, as its episodes earned them.

    Under the ``rsl`` rule ``gae`` adds the time-out bootstrap to ``rewards`` (``timeouts_bootstrapped``) and
    keeps the raw ones in ``rewards_raw``; plotting the bootstrapped ones would inflate every timed-out return.
    """
    fields = reader.schema.fields
    bootstrapped = reader.schema.attrs.get("timeouts_bootstrapped", False) in (True, 1)
    raw = fields.get("rewards_raw")
    usable = raw is not None and raw.shape[:2] == (reader.T, reader.N) and raw.dtype.kind == "f"
    sources = {"rewards": "rewards_raw" if bootstrapped and usable else "rewards"}
    return sources | {name: name for name in DISTRIBUTIONS[1:] if name in fields}


def load_matplotlib() -> Any:
    """``matplotlib.pyplot`` on the headless Agg backend, or exit 2 saying how to install it."""
    try:
        import matplotlib
    except ImportError as exc:
        raise RolloutError(
            'plot: matplotlib is not installed; install the plot extra: pip install "rolloutcli[plot]".',
            exit_code=EXIT_USAGE,
        ) from exc
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _first_pass(reader: RolloutReader, names: list[str], sources: dict[str, str], progress: Progress) -> dict[str, Any]:
    fields, T = reader.schema.fields, reader.T
    from_reset = bool(reader.schema.attrs.get("recorded_from_reset", False))
    episodes, lengths, per_step = Episodes(), np.zeros(T + 1, dtype=np.int64), PerStep(T)
    dones_per_env, time_outs_per_env = [], []
    ranges = {name: Moments() for name in sources}
    observations = {key: None for key in reader.schema.observation_keys}
    actions: DimMoments | None = None
    blocks = reader.blocks(names)
    progress.start("plot: pass 1", len(blocks))
    for start, stop in blocks:
        block = reader.arrays([n for n in names if not n.startswith("observations")], start, stop)
        time_outs = block.get("time_outs")
        rewards = block[sources["rewards"]]
        episodes.add(rewards, block["dones"], time_outs, from_reset)
        per_step.add(rewards)
        lengths += split_length_counts(block["dones"])
        dones_per_env.append(block["dones"].sum(axis=0))
        time_outs_per_env.append(time_outs.sum(axis=0) if time_outs is not None else np.zeros(stop - start))
        for name in ranges:
            ranges[name] = ranges[name].merge(Moments.of(block[sources[name]]))
        step_actions = DimMoments.of(block["actions"].reshape((stop - start) * T, -1))
        actions = step_actions if actions is None else actions.merge(step_actions)
        for key, path in reader.schema.observation_keys.items():
            obs = reader.array(path, start, stop)
            moments = DimMoments.of(obs.reshape(obs.shape[0] * obs.shape[1], -1))
            observations[key] = moments if observations[key] is None else observations[key].merge(moments)
        progress.advance()
    progress.finish()
    return {
        "blocks": blocks,
        "episodes": episodes,
        "reward_per_step": per_step.as_dict(),
        "split_lengths": lengths,
        "dones_per_env": np.concatenate(dones_per_env),
        "time_outs_per_env": np.concatenate(time_outs_per_env),
        "has_time_outs": "time_outs" in fields,
        "ranges": ranges,
        "actions": actions,
        "observations": observations,
    }


def _histograms(
    reader: RolloutReader, first: dict[str, Any], sources: dict[str, str], progress: Progress
) -> dict[str, Any]:
    """Pass 2: the distributions and the per-dimension action histograms in bins of pass 1's ranges."""
    hists = {n: Histogram(m.minimum, m.maximum) for n, m in first["ranges"].items() if m.count}
    action_hists = [
        Histogram(m.minimum, m.maximum, 20) if m.count else None for m in first["actions"].dims[:ACTION_DIMS]
    ]
    progress.start("plot: pass 2", len(first["blocks"]))
    for start, stop in first["blocks"]:
        for name, hist in hists.items():
            hist.add(reader.array(sources[name], start, stop))
        actions = reader.array("actions", start, stop)
        actions = actions.reshape(actions.shape[0] * actions.shape[1], -1)
        for d, hist in enumerate(action_hists):
            if hist is not None:
                hist.add(actions[:, d])
        progress.advance()
    progress.finish()
    return {"distributions": hists, "actions": action_hists}


def plot_data(reader: RolloutReader, progress: Progress) -> dict[str, Any]:
    """Everything the figure shows (see the module docstring), from the open rollout ``reader``."""
    fields = reader.schema.fields
    sources = _sources(reader)
    names = ["dones", "actions", *sources.values(), *[n for n in ("time_outs",) if n in fields]]
    names += list(reader.schema.observation_keys.values())
    first = _first_pass(reader, names, sources, progress)
    second = _histograms(reader, first, sources, progress)
    grid = max_length_grid(reader.T)
    episodes: Episodes = first["episodes"]
    returns, lengths, time_outs = episodes.arrays()
    partial_returns, partial_lengths = episodes.partial()
    return {
        "file": str(reader.path),
        "T": reader.T,
        "N": reader.N,
        "episodes": {
            "returns": returns,
            "lengths": lengths,
            "time_outs": time_outs,
            "partial_returns": partial_returns,
            "partial_lengths": partial_lengths,
            "ended": episodes.ended,
            "ended_time_outs": episodes.ended_time_outs,
        },
        "reward_per_step": first["reward_per_step"],
        "rewards_field": sources["rewards"],
        "distributions": second["distributions"],
        "missing": [n for n in DISTRIBUTIONS if n not in second["distributions"]],
        "action_histograms": second["actions"],
        "action_dims": len(first["actions"].dims),
        "observations": {k: m.as_dict() for k, m in first["observations"].items()},
        "dones_per_env": first["dones_per_env"],
        "time_outs_per_env": first["time_outs_per_env"] if first["has_time_outs"] else None,
        "blowup": {"max_length": grid, "blowup": padding_blowup(first["split_lengths"], reader.N, grid)},
    }


def rollout_figure(src: Path, run: RunOptions | None = None, progress: Progress | None = None) -> tuple[Any, dict]:
    """The matplotlib figure of the rollout file ``src`` and the data drawn (the library's entry point)."""
    plt = load_matplotlib()
    from rolloutcli.pipeline.plot_figure import figure

    run = run or RunOptions()
    with RolloutReader(src, run.safety, budget=run.max_memory) as reader:
        data = plot_data(reader, progress or Progress())
    return figure(data, plt), data


def run_plot(
    src: Path, dst: Path, run: RunOptions, *, overwrite: bool = False, progress: Progress | None = None
) -> dict[str, Any]:
    """Write the picture ``dst`` (``.png``, ``.svg`` or ``.html``) of the rollout file ``src``."""
    started, progress = time.perf_counter(), progress or Progress()
    src, dst = Path(src), Path(dst)
    if dst.suffix.lower() not in FORMATS:
        raise RolloutError(
            f"-o: expected a file ending in {', '.join(FORMATS)}, found '{dst.name}'.", exit_code=EXIT_USAGE
        )
    plt = load_matplotlib()
    check_output_path(dst, [src], overwrite=overwrite)
    from rolloutcli.pipeline.plot_figure import save

    fig, data = rollout_figure(src, run, progress)
    try:
        with atomic_file(dst, inputs=[src], overwrite=overwrite) as tmp:
            save(fig, tmp, dst.suffix.lower())
    finally:
        plt.close(fig)
    episodes = data["episodes"]
    titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
    return {
        "input": str(src),
        "output": str(dst),
        "episodes": episodes["lengths"].size,
        "partial_episodes": episodes["partial_lengths"].size,
        "episodes_ended": episodes["ended"],
        "panels": titles,
        "seconds": time.perf_counter() - started,
    }
