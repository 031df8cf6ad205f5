"""The figure of ``rolloutcli plot`` from :func:`rolloutcli.pipeline.plot.plot_data`'s data (matplotlib passed in).

Every panel has a title and labelled axes; a panel without data says so in its middle instead of failing. Rows
are filled: each row's panels share its width, and rows hold as many panels as the others or one fewer.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

COLUMNS = 3  # the most panels in a row of the main grid
ACTION_COLUMNS = 4  # the most action histograms in a row
WIDTH = 12  # grid columns of a row: 12 is divisible by 1, 2, 3 and 4 panels


def row_sizes(panels: int, most: int) -> list[int]:
    """Panels per row: the fewest rows of at most ``most``, as even as can be, so no row holds one panel alone."""
    rows = -(-panels // most)
    return [panels // rows + (1 if r < panels % rows else 0) for r in range(rows)] if panels else []


def _empty(ax: Any, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.4")
    ax.set_xticks([])
    ax.set_yticks([])


def _episodes(ax: Any, episodes: dict[str, Any], key: str, title: str, what: str) -> None:
    """Whole episodes by how they ended, and the parts of the episodes the recording cuts (stacked)."""
    ax.set_title(title)
    ax.set_xlabel(what + (" (cut episodes: the part recorded)" if episodes[f"partial_{key}"].size else ""))
    ax.set_ylabel("episodes")
    whole, time_outs, partial = episodes[key], episodes["time_outs"], episodes[f"partial_{key}"]
    if whole.size + partial.size == 0:
        _empty(ax, "no episode")
        return
    parts = [whole[~time_outs], whole[time_outs], partial]
    labels = [f"whole, terminated ({parts[0].size})", f"whole, timed out ({parts[1].size})"]
    labels.append(f"cut by the recording ({partial.size})")
    values = np.concatenate(parts).astype(np.float64)
    bins = np.histogram_bin_edges(values, bins=min(30, max(np.unique(values).size, 1)))
    ax.hist(parts, bins=bins, stacked=True, label=labels, color=["C0", "C1", "0.6"])
    ax.legend(fontsize="small")


def _reward_per_step(ax: Any, data: dict[str, Any]) -> None:
    ax.set_title("reward per step")
    ax.set_xlabel("step")
    raw = data["rewards_field"] != "rewards"
    ax.set_ylabel(f"{data['rewards_field']} over envs" if raw else "reward over envs")
    per_step, steps = data["reward_per_step"], np.arange(data["T"])
    mean, std = per_step["mean"], per_step["std"]
    ax.fill_between(steps, per_step["min"], per_step["max"], alpha=0.15, color="C0", label="min..max")
    ax.fill_between(steps, mean - std, mean + std, alpha=0.3, color="C0", label="mean ± std")
    ax.plot(steps, mean, color="C0", label="mean")
    ax.legend(fontsize="small")


def _histogram(ax: Any, hist: Any, title: str, what: str) -> None:
    ax.set_title(title)
    ax.set_xlabel(what)
    ax.set_ylabel("steps")
    if hist is None or hist.counts.sum() == 0:
        _empty(ax, "no finite values")
        return
    ax.stairs(hist.counts, hist.edges, fill=True)


def _distribution(ax: Any, data: dict[str, Any], name: str) -> None:
    title, what = f"{name} distribution", name[:-1]  # rewards -> reward
    if name == "rewards" and data["rewards_field"] != "rewards":
        what = f"reward ({data['rewards_field']}: without gae's time-out bootstrap)"
    if name not in data["missing"]:
        _histogram(ax, data["distributions"][name], title, what)
        return
    ax.set_title(title)
    ax.set_xlabel(what)
    ax.set_ylabel("steps")
    _empty(ax, f"no {name} in the file")


def _observation_ranges(ax: Any, key: str, stats: dict[str, Any]) -> None:
    ax.set_title(f"observations/{key}: range per dimension")
    ax.set_xlabel("dimension")
    ax.set_ylabel("value")
    dims = np.arange(len(stats["mean"]))
    known = np.array([m is not None for m in stats["mean"]])
    if not known.any():
        _empty(ax, "no finite values")
        return
    pick = lambda name: np.array([v if v is not None else np.nan for v in stats[name]], float)  # noqa: E731
    ax.fill_between(dims, pick("min"), pick("max"), alpha=0.25, step="mid", label="min..max")
    mean, std = pick("mean"), pick("std")
    ax.errorbar(dims, mean, yerr=std, fmt=".", label="mean ± std")
    ax.legend(fontsize="small")


def _per_env(ax: Any, data: dict[str, Any]) -> None:
    ax.set_title("dones and time-outs per env")
    ax.set_xlabel("env")
    ax.set_ylabel("episodes ended")
    envs, episodes = np.arange(data["N"]), data["episodes"]
    ax.bar(envs, data["dones_per_env"], label=f"dones ({episodes['ended']})")
    if data["time_outs_per_env"] is not None:
        ax.bar(envs, data["time_outs_per_env"], label=f"of which time-outs ({episodes['ended_time_outs']})")
    ax.legend(fontsize="small")


def _blowup(ax: Any, data: dict[str, Any]) -> None:
    ax.set_title("split padding blow-up by --max-length")
    grid = data["blowup"]
    ax.plot(grid["max_length"], grid["blowup"], marker="o")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("--max-length (T: none)")
    ax.set_ylabel("padded / recorded steps")


def _action(ax: Any, data: dict[str, Any], d: int) -> None:
    actions = data["action_histograms"]
    shown = f" (first {len(actions)} of {data['action_dims']})" if data["action_dims"] > len(actions) else ""
    _histogram(ax, actions[d], f"action[{d}] histogram{shown if d == 0 else ''}", f"action[{d}]")


def _panels(data: dict[str, Any]) -> tuple[list[Callable[[Any], None]], list[Callable[[Any], None]]]:
    """The drawers of the main grid's panels and of the action grid's (a single action joins the main grid)."""
    main: list[Callable[[Any], None]] = [
        lambda ax: _episodes(ax, data["episodes"], "returns", "episode returns", "return"),
        lambda ax: _episodes(ax, data["episodes"], "lengths", "episode lengths", "steps"),
        lambda ax: _reward_per_step(ax, data),
        *[lambda ax, n=name: _distribution(ax, data, n) for name in ("rewards", "values", "advantages", "returns")],
        lambda ax: _per_env(ax, data),
        lambda ax: _blowup(ax, data),
        *[lambda ax, k=key, s=stats: _observation_ranges(ax, k, s) for key, stats in data["observations"].items()],
    ]
    actions = [lambda ax, d=d: _action(ax, data, d) for d in range(len(data["action_histograms"]))]
    return (main + actions, []) if len(actions) == 1 else (main, actions)


def figure(data: dict[str, Any], plt: Any) -> Any:
    """The whole report as one matplotlib figure (``plt``: ``matplotlib.pyplot``), every row filled."""
    main, actions = _panels(data)
    sizes = row_sizes(len(main), COLUMNS) + row_sizes(len(actions), ACTION_COLUMNS)
    fig = plt.figure(figsize=(5 * COLUMNS, 3.4 * len(sizes)), layout="constrained")
    grid = fig.add_gridspec(len(sizes), WIDTH)
    drawers = iter(main + actions)
    for row, size in enumerate(sizes):
        width = WIDTH // size
        for i in range(size):
            next(drawers)(fig.add_subplot(grid[row, width * i : width * (i + 1)]))
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
        f"<h1>{_escape(title)}</h1><img alt='rolloutcli plot' style='max-width:100%'"  # fits a narrow window
        f" src='data:image/png;base64,{image}'></body></html>\n",
        encoding="utf-8",
    )


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
