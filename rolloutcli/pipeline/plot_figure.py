"""The figure of ``rolloutcli plot`` from :func:`rolloutcli.pipeline.plot.plot_data`'s data (matplotlib passed in).

Every panel has a title; a panel without data says so in its middle instead of failing.
"""

from __future__ import annotations

import base64
import io
import math
from pathlib import Path
from typing import Any

import numpy as np

COLUMNS = 3


def _empty(ax: Any, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.4")
    ax.set_xticks([])
    ax.set_yticks([])


def _episodes(ax: Any, values: np.ndarray, time_outs: np.ndarray, title: str, what: str) -> None:
    ax.set_title(title)
    if values.size == 0:
        _empty(ax, "no completed episode")
        return
    bins = np.histogram_bin_edges(values.astype(np.float64), bins=min(30, max(values.size, 1)))
    ax.hist([values[~time_outs], values[time_outs]], bins=bins, stacked=True, label=["terminations", "time-outs"])
    ax.set_xlabel(what)
    ax.set_ylabel("episodes")
    ax.legend(fontsize="small")


def _histogram(ax: Any, hist: Any, title: str) -> None:
    ax.set_title(title)
    if hist is None or hist.counts.sum() == 0:
        _empty(ax, "no finite values")
        return
    edges = hist.edges
    ax.stairs(hist.counts, edges, fill=True)


def _observation_ranges(ax: Any, key: str, stats: dict[str, Any]) -> None:
    ax.set_title(f"observations/{key}: range per dimension")
    dims = np.arange(len(stats["mean"]))
    known = np.array([m is not None for m in stats["mean"]])
    if not known.any():
        _empty(ax, "no finite values")
        return
    pick = lambda name: np.array([v if v is not None else np.nan for v in stats[name]], float)  # noqa: E731
    ax.fill_between(dims, pick("min"), pick("max"), alpha=0.25, step="mid", label="min..max")
    mean, std = pick("mean"), pick("std")
    ax.errorbar(dims, mean, yerr=std, fmt=".", label="mean ± std")
    ax.set_xlabel("dimension")
    ax.legend(fontsize="small")


def _per_env(ax: Any, data: dict[str, Any]) -> None:
    ax.set_title("dones and time-outs per env")
    envs = np.arange(data["N"])
    ax.bar(envs, data["dones_per_env"], label="dones")
    if data["time_outs_per_env"] is not None:
        ax.bar(envs, data["time_outs_per_env"], label="time-outs")
    ax.set_xlabel("env")
    ax.legend(fontsize="small")


def _blowup(ax: Any, data: dict[str, Any]) -> None:
    ax.set_title("split padding blow-up by --max-length")
    grid = data["blowup"]
    ax.plot(grid["max_length"], grid["blowup"], marker="o")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("--max-length (T: none)")
    ax.set_ylabel("padded / recorded steps")


def figure(data: dict[str, Any], plt: Any) -> Any:
    """The whole report as one matplotlib figure (``plt``: ``matplotlib.pyplot``)."""
    actions = data["action_histograms"]
    action_rows = math.ceil(len(actions) / 4)
    panels = 8 + len(data["observations"])
    rows = math.ceil(panels / COLUMNS)
    fig = plt.figure(figsize=(5 * COLUMNS, 3.4 * (rows + action_rows)), layout="constrained")
    grid = fig.add_gridspec(rows + action_rows, 12)
    axes = [fig.add_subplot(grid[i // COLUMNS, 4 * (i % COLUMNS) : 4 * (i % COLUMNS) + 4]) for i in range(panels)]
    episodes = data["episodes"]
    _episodes(axes[0], episodes["returns"], episodes["time_outs"], "episode returns", "return")
    _episodes(axes[1], episodes["lengths"], episodes["time_outs"], "episode lengths", "steps")
    for ax, name in zip(axes[2:6], ("rewards", "values", "advantages", "returns"), strict=True):
        if name in data["missing"]:
            ax.set_title(f"{name} distribution")
            _empty(ax, f"no {name} in the file")
        else:
            _histogram(ax, data["distributions"][name], f"{name} distribution")
    _per_env(axes[6], data)
    _blowup(axes[7], data)
    for ax, (key, stats) in zip(axes[8:], data["observations"].items(), strict=True):
        _observation_ranges(ax, key, stats)
    shown = f" (first {len(actions)} of {data['action_dims']})" if data["action_dims"] > len(actions) else ""
    for d, hist in enumerate(actions):
        ax = fig.add_subplot(grid[rows + d // 4, 3 * (d % 4) : 3 * (d % 4) + 3])
        _histogram(ax, hist, f"action[{d}] histogram{shown if d == 0 else ''}")
    fig.suptitle(f"{data['file']}  (T={data['T']}, N={data['N']})")
    return fig


def save(fig: Any, path: Path, suffix: str) -> None:
    """Write ``fig`` as PNG, SVG, or an HTML page holding the PNG."""
    if suffix != ".html":
        fig.savefig(path, format=suffix[1:], dpi=80)
        return
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=80)
    image = base64.b64encode(buffer.getvalue()).decode("ascii")
    title = fig._suptitle.get_text() if fig._suptitle is not None else "rollout"
    Path(path).write_text(
        f"<!doctype html><html><head><meta charset='utf-8'><title>{_escape(title)}</title></head><body>"
        f"<h1>{_escape(title)}</h1><img alt='rolloutcli plot' src='data:image/png;base64,{image}'></body></html>\n",
        encoding="utf-8",
    )


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
