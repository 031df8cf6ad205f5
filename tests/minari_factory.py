"""Synthetic episode plans and chunk streams for the export writers' tests (independent of the reader).

Every value is identifiable: step ``s`` of episode ``e`` holds ``e * 1000 + s`` (plus ``k / 100`` along a float
observation's last axis; ``(e * 31 + s + k) % 256`` for uint8 images), so a row in the wrong place shows. Each
episode is cut into pieces over consecutive files and each piece into chunks; chunks of different episodes of
one file arrive interleaved, file by file, each episode's in order of offset, as the reader yields them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rolloutcli.pipeline.episode_plan import Chunk, Episode, EpisodePlan


@dataclass
class Spec:
    """One episode to build: its length and how it ends."""

    steps: int
    terminated: bool = True
    truncated: bool = False
    has_next: bool = True
    partial_start: bool = False
    partial_end: bool = False


FLOAT_OBS = {"policy": (np.dtype(np.float32), (3,))}
DICT_OBS = {
    "policy": (np.dtype(np.float32), (3,)),
    "critic": (np.dtype(np.float64), (2,)),
    "camera/rgb": (np.dtype(np.uint8), (32, 32, 3)),
}
EXTRA_FIELDS = {"values": (np.dtype(np.float32), ()), "infos/speed": (np.dtype(np.float64), (2,))}


def observation(e: int, s: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """Observation after ``s`` steps of episode ``e``."""
    k = np.arange(int(np.prod(shape))).reshape(shape) if shape else np.array(0)
    if dtype == np.uint8:
        return ((e * 31 + s + k) % 256).astype(np.uint8)
    return (e * 1000 + s + k / 100).astype(dtype)


def episode_rows(e: int, spec: Spec, obs: dict, actions: tuple, extra: dict) -> dict[str, np.ndarray]:
    """Every row of episode ``e`` (``observations/<key>`` with ``steps + 1`` rows: the last one is the
    observation after the last step)."""
    s = np.arange(spec.steps)
    rows = {
        f"observations/{key}": np.stack([observation(e, t, *spec_) for t in range(spec.steps + 1)])
        for key, spec_ in obs.items()
    }
    dtype, shape = actions
    rows["actions"] = (e * 1000 + s.reshape(-1, *[1] * len(shape)) + np.zeros(shape)).astype(dtype)
    rows["rewards"] = (e + s / 10).astype(np.float32)
    ended = spec.terminated or spec.truncated
    rows["dones"] = (s == spec.steps - 1) & ended
    rows["time_outs"] = (s == spec.steps - 1) & spec.truncated
    for name, (dtype, shape) in extra.items():
        rows[name] = (-(e * 1000 + s.reshape(-1, *[1] * len(shape))) + np.zeros(shape)).astype(dtype)
    return rows


def build(
    specs: list[Spec],
    *,
    obs: dict | None = None,
    actions: tuple = (np.dtype(np.float64), (2,)),
    extra: dict | None = None,
    files: int = 3,
    seed: int = 0,
) -> tuple[EpisodePlan, list[Chunk], list[dict[str, np.ndarray]]]:
    """(plan, chunks in reading order, each episode's rows)."""
    obs = FLOAT_OBS if obs is None else obs
    extra = {} if extra is None else extra
    rng = np.random.default_rng(seed)
    episodes, rows, pieces = [], [], {f: [] for f in range(files)}
    for e, spec in enumerate(specs):
        first = int(rng.integers(files))
        inner = rng.integers(1, spec.steps, size=min(files - 1 - first, 2)) if spec.steps > 1 else []
        cuts = sorted({0, spec.steps, *(int(c) for c in inner)})
        last = first + len(cuts) - 2
        episode = Episode(
            e, "rec", e % 4, e * 10, spec.steps, spec.partial_start, spec.partial_end,
            spec.terminated, spec.truncated, spec.has_next, first, last,
        )
        episodes.append(episode)
        rows.append(episode_rows(e, spec, obs, actions, extra))
        for i, (a, b) in enumerate(itertools.pairwise(cuts)):
            pieces[first + i].append((episode, a, b))
    chunks = []
    for f in range(files):
        queues = [_cut(episode, a, b, f, rows[episode.number], obs, rng) for episode, a, b in pieces[f]]
        while any(queues):  # one chunk of each episode in turn: episodes interleaved, each in order
            for queue in queues:
                if queue:
                    chunks.append(queue.pop(0))
    fields = {name: (np.dtype(value.dtype), value.shape[1:]) for name, value in rows[0].items()}
    plan = EpisodePlan([Path(f"iter_{f:03d}.h5") for f in range(files)], episodes, fields, dict(obs))
    plan.partial = sum(s.partial_start or s.partial_end for s in specs)
    return plan, chunks, rows


def _cut(episode: Episode, a: int, b: int, f: int, rows: dict, obs: dict, rng: np.random.Generator) -> list[Chunk]:
    """Steps ``a:b`` of ``episode`` (all in file ``f``) as chunks of 1 to 3 steps."""
    out, start = [], a
    while start < b:
        stop = min(b, start + int(rng.integers(1, 4)))
        chunk = Chunk(episode, start, f, {name: value[start:stop] for name, value in rows.items()})
        if stop == episode.steps and episode.has_next:
            chunk.next_observation = {key: rows[f"observations/{key}"][stop] for key in obs}
        out.append(chunk)
        start = stop
    return out
