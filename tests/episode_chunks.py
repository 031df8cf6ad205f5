"""Synthetic episodes for the export tests: an :class:`EpisodePlan` and the chunk stream a reader would yield.

Values are identifiable: observation ``key`` of episode ``e`` at step ``t`` holds ``e * 1000 + t + k / 100``
(k the feature; images ``(e * 7 + t) % 256``), actions ``e * 1000 + t + 0.5``, rewards ``e + t / 1000``, so
every exported row can be traced to its episode and step. Each episode is cut into chunks, chunk ``j`` read
from file ``first_file + j``; the stream goes file by file, and within a file the episodes' chunks come in
reverse episode order (chunks of different episodes interleave, each episode's in order of offset).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from rolloutcli.pipeline.episode_plan import Chunk, Episode, EpisodePlan

OBS = {"policy": (np.dtype(np.float32), (3,)), "camera": (np.dtype(np.uint8), (4, 4, 3))}


@dataclass
class Spec:
    """One episode to make: its chunk lengths, how it ended, whether the observation after it was recorded."""

    cuts: list[int]
    terminated: bool = True
    has_next: bool = True
    partial_start: bool = False
    partial_end: bool = False
    first_file: int = 0

    @property
    def steps(self) -> int:
        return sum(self.cuts)


@dataclass
class Made:
    plan: EpisodePlan
    chunks: list[Chunk]
    # episode number -> field -> its whole rows ([steps, ...]); "next/<key>": the observation after the last step
    truth: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)


def observation(key: str, dtype: np.dtype, shape: tuple[int, ...], e: int, steps: np.ndarray) -> np.ndarray:
    if dtype == np.uint8:
        return np.broadcast_to(
            ((e * 7 + steps) % 256).astype(np.uint8).reshape(-1, *[1] * len(shape)), (len(steps), *shape)
        ).copy()
    k = np.arange(int(np.prod(shape))).reshape(shape) / 100
    return (e * 1000 + steps.reshape(-1, *[1] * len(shape)) + k).astype(dtype)


def make(specs: list[Spec], obs: dict | None = None, reward_dtype=np.float32, action_dtype=np.float32) -> Made:
    obs = OBS if obs is None else obs
    files = max(s.first_file + len(s.cuts) for s in specs)
    episodes, truth = [], {}
    for e, s in enumerate(specs):
        episodes.append(
            Episode(
                number=e,
                recording=f"rec{e % 2}",
                lane=e,
                start=e * 3,
                steps=s.steps,
                partial_start=s.partial_start,
                partial_end=s.partial_end,
                terminated=s.terminated and not s.partial_end,
                truncated=not s.terminated and not s.partial_end,
                has_next=s.has_next,
                first_file=s.first_file,
                last_file=s.first_file + len(s.cuts) - 1,
            )
        )
        t = np.arange(s.steps + 1)
        rows = {f"observations/{k}": observation(k, d, sh, e, t) for k, (d, sh) in obs.items()}
        rows["actions"] = np.stack([e * 1000 + t[:-1] + 0.5, -t[:-1]], 1).astype(action_dtype)
        rows["rewards"] = (e + t[:-1] / 1000).astype(reward_dtype)
        dones = np.zeros(s.steps, bool)
        dones[-1] = not s.partial_end
        rows["dones"], rows["time_outs"] = dones, dones & (not s.terminated)
        rows["values"] = np.full(s.steps, e, np.float32)
        whole = {k: v[: s.steps] for k, v in rows.items()}
        whole.update({f"next/{k}": rows[f"observations/{k}"][s.steps] for k in obs})
        truth[e] = whole
    plan = EpisodePlan(
        files=[Path(f"/data/iter_{i}.h5") for i in range(files)],
        episodes=episodes,
        fields={
            **{f"observations/{k}": v for k, v in obs.items()},
            "actions": (np.dtype(action_dtype), (2,)),
            "rewards": (np.dtype(reward_dtype), ()),
            "dones": (np.dtype(bool), ()),
            "time_outs": (np.dtype(bool), ()),
            "values": (np.dtype(np.float32), ()),
        },
        observations=dict(obs),
        not_held=["hidden_states/actor/0"],
    )
    return Made(plan, _chunks(specs, episodes, truth, obs, files), truth)


def _chunks(specs: list[Spec], episodes: list[Episode], truth: dict, obs: dict, files: int) -> list[Chunk]:
    per_file: dict[int, list[Chunk]] = {f: [] for f in range(files)}
    for e, s in enumerate(specs):
        offset = 0
        for j, cut in enumerate(s.cuts):
            rows = {k: v[offset : offset + cut] for k, v in truth[e].items() if not k.startswith("next/")}
            last = offset + cut == s.steps
            after = {k: truth[e][f"next/{k}"] for k in obs} if last and s.has_next else None
            per_file[s.first_file + j].append(Chunk(episodes[e], offset, s.first_file + j, rows, after))
            offset += cut
    return [chunk for f in range(files) for chunk in reversed(per_file[f])]


def kept(spec_or_episode) -> int:
    return spec_or_episode.steps - (0 if spec_or_episode.has_next else 1)


STANDARD = [
    Spec([3, 4], terminated=True, first_file=0),  # across two files
    Spec([5], terminated=False, first_file=1),  # a time-out
    Spec([2, 2, 2], terminated=True, has_next=False, first_file=0),  # the observation after it not recorded
    Spec([1], terminated=True, has_next=False, first_file=2),  # nothing left once its last step is out
    Spec([4, 1], terminated=False, partial_start=True, partial_end=True, first_file=1),  # partial both ends
    Spec([6], terminated=True, first_file=2),
]
