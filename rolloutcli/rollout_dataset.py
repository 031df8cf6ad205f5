"""Row-level datasets over rollout files themselves (no shards): ``RolloutDataset`` and ``TrajectoryDataset``.

::

    from torch.utils.data import DataLoader
    from rolloutcli import RolloutDataset

    dataset = RolloutDataset("run_gae.h5")                      # or a list of files, or a folder of *.h5 files
    for batch in DataLoader(dataset, batch_size=256, shuffle=True, num_workers=2):
        ...                                                    # a Batch: actions [256, A], advantages [256, 1]

``RolloutDataset``: ``len()`` = rows (``T * N`` per file, files one after the other, row ``t * N + n`` of a file);
an item is one row as a Batch of one row (``[1, ...]``, so that the default collation concatenates items into a
Batch in RSL-RL's feed-forward shapes). ``TrajectoryDataset``: ``len()`` = trajectories (cut at ``dones`` and at
the end of each env, in RSL-RL's env-major order); an item is one trajectory ``[length, 1, ...]`` with ``masks``
and the hidden states fed at its first step, and a batch pads them to the longest in the batch (``[L, M, ...]``,
``masks [L, M]``, hidden states ``[layers, M, H]``).

A ``DataLoader`` asks for a whole batch of rows at once (``__getitems__``). Files are checked when the dataset is
built and opened lazily in each worker process, which keeps whole fields in memory up to ``cache_bytes``.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from rolloutcli.core.trajectories import TrajectorySpans, trajectory_spans
from rolloutcli.errors import EXIT_IO, RolloutError
from rolloutcli.fields import field_of
from rolloutcli.hdf5.limits import SafetyOptions
from rolloutcli.hdf5.rows import FileInfo, RowReader, check_row_costs, describe_files
from rolloutcli.minibatch import Batch

SCALAR_ATTRS = {"values", "advantages", "returns", "actions_log_prob", "dones"}  # [B] in files, [B, 1] in a Batch


def _files(source: str | Path | Iterable[str | Path]) -> list[Path]:
    """A file, a folder (its ``*.h5`` files by name), or a list of files."""
    if isinstance(source, str | Path):
        path = Path(source)
        if path.is_dir():
            files = sorted(p for p in path.glob("*.h5") if not p.name.startswith("."))
            if not files:
                raise RolloutError(
                    f"{path}: expected rollout files (*.h5) in the folder, found none.", exit_code=EXIT_IO
                )
            return files
        return [path]
    return [Path(p) for p in source]


def _selected(info: FileInfo, fields: Sequence[str] | None, hidden: bool) -> list[str]:
    """Dataset paths to read: ``fields`` names rows of the field table (``observations``) or datasets
    (``observations/policy``); default every field a Batch holds."""
    names = []
    for name in info.fields:
        row = field_of(name)
        if row is None or row.batch_name is None or (row.name == "hidden_states" and not hidden):
            continue
        if fields is None or name in fields or row.name in fields:
            names.append(name)
    unknown = [f for f in fields or () if not any(n == f or n.startswith(f"{f}/") for n in names)]
    if unknown:
        raise RolloutError.field(info.path, unknown[0], "a field of the file that a Batch holds", "nothing")
    return names


class RolloutDataset(Dataset):
    """Rows of one or more rollout files (see the module docstring).

    Args:
        source: a rollout file, a list of them, or a folder of ``*.h5`` rollout files (same fields in each).
        fields: field names (``observations``, ``actions``, ``advantages``, ...) or datasets (``observations/policy``)
            to read; default: every field a ``Batch`` holds (RL fields, ``privileged_actions``, ``dones``).
        device: where items and batches go (keep ``"cpu"`` with ``DataLoader`` workers).
        allow_external: trust links and storage outside the files (refused by default, as by every command).
        cache_bytes: whole fields each process keeps in memory (default 256 MiB); larger ones are read by steps.
        read_bytes: the most reading one row of a field may take (default 64 MiB): its bytes, or the compressed
            chunk libhdf5 decodes whole to get at it; a field over it is refused (``RolloutError``) when built.
    """

    recurrent = False

    def __init__(
        self,
        source: str | Path | Iterable[str | Path],
        *,
        fields: Sequence[str] | None = None,
        device: str | torch.device = "cpu",
        allow_external: bool = False,
        cache_bytes: int = 256 << 20,
        read_bytes: int = 64 << 20,
    ) -> None:
        safety = SafetyOptions(allow_external=allow_external)
        self.paths = _files(source)
        self.infos = describe_files(self.paths, safety)
        self.names = _selected(self.infos[0], fields, self.recurrent)
        for info in self.infos[1:]:
            ours = {n: self.infos[0].fields[n] for n in self.names}
            theirs = {n: info.fields.get(n) for n in self.names}
            if ours != theirs:
                name = next(n for n in self.names if ours[n] != theirs[n])
                raise RolloutError.field(info.path, name, f"{ours[name]} as in {self.paths[0]}", str(theirs[name]))
        for info in self.infos:
            check_row_costs(info, self.names, read_bytes)
        self.device = torch.device(device)
        self.reader = RowReader(self.paths, safety, cache_bytes, read_bytes)
        self.offsets = list(itertools.accumulate((self._count(i) for i in self.infos), initial=0))

    def _count(self, info: FileInfo) -> int:
        return info.T * info.N

    def __len__(self) -> int:
        return self.offsets[-1]

    def _locate(self, index: int) -> tuple[int, int]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"{type(self).__name__} index {index} out of range for {len(self)} items")
        index %= len(self)
        file = bisect.bisect_right(self.offsets, index) - 1
        return file, index - self.offsets[file]

    def __getitem__(self, index: int) -> Batch:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[Batch]:
        """The rows ``indices`` (read file by file, each field once per step), one Batch of one row each."""
        located = [self._locate(int(i)) for i in indices]
        batch = np.arange(len(located))
        out: dict[str, np.ndarray] = {}
        for file in sorted({f for f, _ in located}):
            mine = np.array([k for k, (f, _) in enumerate(located) if f == file])
            rows = np.array([located[k][1] for k in mine], dtype=np.int64)
            for name in self.names:
                data = self.reader.rows(file, name, rows)
                if name not in out:
                    out[name] = np.empty((len(located), *data.shape[1:]), data.dtype)
                out[name][mine] = data
        full = self._batch({n: torch.from_numpy(v).to(self.device) for n, v in out.items()}, self.infos[0])
        return [_row(full, int(k)) for k in batch]

    def _batch(self, tensors: dict[str, torch.Tensor], info: FileInfo) -> Batch:
        """Datasets ``{path: [B, ...]}`` as a Batch (scalars ``[B, 1]``, observations a TensorDict)."""
        from tensordict import TensorDict

        lead = next(iter(tensors.values())).shape[: 2 if self.recurrent else 1]
        observations = {n.split("/", 1)[1]: v for n, v in tensors.items() if n.startswith("observations/")}
        attrs: dict[str, Any] = {}
        for name, value in tensors.items():
            row = field_of(name)
            assert row is not None and row.batch_name is not None
            if row.name in SCALAR_ATTRS:
                attrs[row.batch_name] = value.unsqueeze(-1)
            elif not row.group:
                attrs[row.batch_name] = value
        order = [f"distribution/{n}" for n in info.distribution if f"distribution/{n}" in tensors]
        return Batch(
            observations=TensorDict(observations, batch_size=list(lead), device=self.device) if observations else None,
            old_distribution_params=tuple(tensors[n] for n in order) or None,
            **attrs,
        )


def _row(batch: Batch, k: int) -> Batch:
    """Row ``k`` of a feed-forward Batch, as a Batch of one row."""
    return batch.apply(lambda t: t[k : k + 1], lambda td: td[k : k + 1])


class TrajectoryDataset(RolloutDataset):
    """Whole trajectories of rollout files for recurrent training (see the module docstring); each item holds
    every step of one trajectory ``[length, 1, ...]``, ``masks`` and the hidden states at its first step."""

    recurrent = True

    def _count(self, info: FileInfo) -> int:
        return self._spans_of(info).env.numel()

    def _spans_of(self, info: FileInfo) -> TrajectorySpans:
        """Env, start and length of the file's trajectories (RSL-RL's order), computed once."""
        cache = self.__dict__.setdefault("_spans", {})
        if info.path not in cache:
            cache[info.path] = trajectory_spans(torch.from_numpy(info.dones))
        return cache[info.path]

    def __getitems__(self, indices: Sequence[int]) -> list[Batch]:
        return [self._trajectory(*self._locate(int(i))) for i in indices]

    def _trajectory(self, file: int, index: int) -> Batch:
        spans = self._spans_of(self.infos[file])
        env, start, length = (int(spans.env[index]), int(spans.start[index]), int(spans.length[index]))
        tensors, hidden = {}, {}
        for name in self.names:
            if field_of(name).name == "hidden_states":  # type: ignore[union-attr]
                state = self.reader.steps(file, name, start, start + 1, env)  # [1, layers, H]
                hidden[name] = torch.from_numpy(state).permute(1, 0, 2).to(self.device)  # [layers, 1, H]
            else:
                data = self.reader.steps(file, name, start, start + length, env)
                tensors[name] = torch.from_numpy(data).unsqueeze(1).to(self.device)  # [length, 1, ...]
        batch = self._batch(tensors, self.infos[file])
        batch.masks = torch.ones(length, 1, dtype=torch.bool, device=self.device)
        states = []
        for net in ("actor", "critic"):
            parts = [hidden[n] for n in sorted(hidden) if n.startswith(f"hidden_states/{net}/")]
            states.append(None if not parts else parts[0] if len(parts) == 1 else tuple(parts))
        batch.hidden_states = (states[0], states[1])
        return batch
