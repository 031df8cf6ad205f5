"""``ShardDataset``: read a ``rolloutcli batch`` folder back as RSL-RL mini-batches (a torch ``IterableDataset``).

::

    from torch.utils.data import DataLoader
    from rolloutcli import ShardDataset

    dataset = ShardDataset("shards/", verify_checksums=True)
    for batch in DataLoader(dataset, batch_size=None, num_workers=2):   # batch_size=None: shards are batches
        loss = ppo_loss(batch.observations, batch.actions, batch.advantages, ...)

Items come in manifest order (epoch, mini-batch, then step for distillation); with ``W`` ``DataLoader``
workers, worker ``w`` yields the items ``w, w + W, ...`` of a pass and reads only the shards that hold them.

Batches come in RSL-RL's shapes (scalars with a trailing 1; observations a ``TensorDict``, so batches go
straight into RSL-RL's ``update()``): feed-forward and recurrent shards as RSL-RL's mini-batches, distillation
as one batch per time step (RSL-RL's ``generator()``). History shards (``batch --history K``) come as dicts
``{"observations": {key: [B, K, ...]}, "window_actions": [B, K, ...], "window_rewards": [B, K],
"window_dones": [B, K], "window_env": [B], "window_end": [B]}``.
``as_dict=True`` yields each shard's datasets as stored plus ``"file"``, ``"epoch"`` and ``"mini_batch"``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from rolloutcli.errors import EXIT_BAD_DATA, EXIT_IO, RolloutError, problem_line
from rolloutcli.fields import FIELDS
from rolloutcli.hdf5.shards import FORMAT_VERSION, MANIFEST_FORMAT, MANIFEST_NAME, manifest_text, read_shard
from rolloutcli.storage import RolloutStorage

# per-step scalars of a Batch (stored [B], given [B, 1]): dataset name -> Batch attribute
SCALARS = {row.name: row.batch_name for row in FIELDS if row.trailing_one and row.batch_name and not row.flag}

ENTRY_KEYS = ("file", "epoch", "mini_batch", "rows", "sha256")
MODES = ("feedforward", "recurrent", "distillation", "history")
_FILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*\.h5$")  # a plain name inside the folder, no path
_DAMAGED = "The shard was modified or damaged after it was written; run `rolloutcli batch` again."
REQUIRED = {  # datasets every shard of a mode holds (besides observations/<key>)
    "feedforward": ("actions", "index"),
    "recurrent": ("actions", "masks"),
    "distillation": ("privileged_actions", "dones"),
    "history": ("window_dones", "window_env", "window_end"),
}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _missing(path: Path, name: str, expected: str) -> RolloutError:
    return RolloutError.field(path, name, expected, "nothing", _DAMAGED)


def _check_source(manifest: dict[str, Any], bad: Any) -> None:
    source = manifest.get("source")
    if not isinstance(source, dict):
        bad("source", "an object with the source's T and N", source)
        return
    for key in ("T", "N"):
        value = source.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            bad(f"source.{key}", "an integer >= 1", value)


def _check_entry(folder: Path, where: str, entry: Any, bad: Any) -> None:
    if not isinstance(entry, dict) or any(key not in entry for key in ENTRY_KEYS):
        bad(where, f"an object with keys {', '.join(ENTRY_KEYS)}", entry)
        return
    name = entry["file"]
    inside = os.path.realpath(folder)
    if not isinstance(name, str) or not _FILE_NAME.match(name):
        bad(f"{where}.file", "a plain .h5 file name inside the folder", name)
    elif os.path.dirname(os.path.realpath(folder / name)) != inside:
        bad(f"{where}.file", "a shard file inside the folder", f"{name} resolving to {os.path.realpath(folder / name)}")
    elif not (folder / name).is_file():
        bad(f"{where}.file", "an existing shard file", f"{name} missing")
    for key in ("epoch", "mini_batch", "rows"):
        if not isinstance(entry[key], int) or isinstance(entry[key], bool) or entry[key] < 0:
            bad(f"{where}.{key}", "an integer >= 0", entry[key])
    if not isinstance(entry["sha256"], str) or not re.fullmatch(r"[0-9a-f]{64}", entry["sha256"]):
        bad(f"{where}.sha256", "64 hex digits", entry["sha256"])


def read_manifest(folder: Path | str) -> dict[str, Any]:
    """Read and check ``folder/manifest.json``: format, mode, source, shard entries, and that every file exists
    inside the folder (a link resolving elsewhere is refused). RolloutError listing every problem."""
    folder = Path(folder)
    path = folder / MANIFEST_NAME
    if not folder.is_dir():
        raise RolloutError(f"{folder}: no such shard folder. Run `rolloutcli batch` to create it.", exit_code=EXIT_IO)
    try:
        manifest = json.loads(manifest_text(path))
    except FileNotFoundError as exc:
        raise RolloutError(
            f"{path}: no manifest; the folder is not a complete `rolloutcli batch` output.", exit_code=EXIT_IO
        ) from exc
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise RolloutError.field(path, "(file)", "a JSON manifest", f"unreadable content ({reason})") from exc
    problems: list[str] = []

    def bad(field: str, expected: str, found: object) -> None:
        problems.append(problem_line(path, field, expected, repr(found)))

    if not isinstance(manifest, dict):
        raise RolloutError.field(path, "(root)", "a JSON object", type(manifest).__name__)
    if manifest.get("format") != MANIFEST_FORMAT:
        bad("format", repr(MANIFEST_FORMAT), manifest.get("format"))
    if manifest.get("format_version") != FORMAT_VERSION:
        bad("format_version", str(FORMAT_VERSION), manifest.get("format_version"))
    if manifest.get("mode") not in MODES:
        bad("mode", "feedforward, recurrent, distillation or history", manifest.get("mode"))
    _check_source(manifest, bad)
    shards = manifest.get("shards")
    if not isinstance(shards, list) or not shards:
        bad("shards", "a non-empty list", shards)
        shards = []
    for i, entry in enumerate(shards):
        _check_entry(folder, f"shards[{i}]", entry, bad)
    if problems:
        raise RolloutError.many(path, problems, exit_code=EXIT_BAD_DATA)
    return manifest


def verify_shard(folder: Path, entry: Mapping[str, Any]) -> None:
    """Raise ``RolloutError`` (exit 1) when a shard's bytes do not match the manifest's sha256."""
    path = Path(folder) / entry["file"]
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(8 << 20):
            digest.update(chunk)
    if digest.hexdigest() != entry["sha256"]:
        raise RolloutError.field(path, "sha256", entry["sha256"], digest.hexdigest(), _DAMAGED)


class ShardDataset(IterableDataset):
    """Mini-batches of a shard folder, verified against its manifest.

    Args:
        folder: output folder of ``rolloutcli batch`` (``manifest.json`` + shard files).
        device: where the yielded tensors live (keep ``"cpu"`` with ``DataLoader`` workers).
        as_dict: yield each shard's datasets as stored instead of ``RolloutStorage.Batch`` objects.
        verify_checksums: check each shard's sha256 against the manifest before using it.
        epochs: only these epochs (default: all).
        tensordict: observations as a ``TensorDict`` or a plain dict. Default: TensorDict in ``Batch`` objects,
            plain dicts in history items (a ``DataLoader``'s default collation cannot copy a TensorDict in a dict).
    """

    def __init__(
        self,
        folder: str | Path,
        *,
        device: str | torch.device = "cpu",
        as_dict: bool = False,
        verify_checksums: bool = False,
        epochs: Iterable[int] | None = None,
        tensordict: bool | None = None,
    ) -> None:
        super().__init__()
        self.folder = Path(folder)
        self.manifest = read_manifest(self.folder)
        self.mode: str = self.manifest["mode"]
        wanted = None if epochs is None else set(epochs)
        self.entries = [e for e in self.manifest["shards"] if wanted is None or e["epoch"] in wanted]
        self.device = torch.device(device)
        self.as_dict = as_dict
        self.verify_checksums = verify_checksums
        self.tensordict = self.mode != "history" if tensordict is None else tensordict

    def _items(self, entry: dict[str, Any]) -> int:
        """Items one entry yields: one per step of a distillation shard, else one."""
        if self.mode == "distillation" and not self.as_dict:
            return entry["rows"] // int(self.manifest["source"]["N"])
        return 1

    def __len__(self) -> int:
        """Items one pass yields (distillation batches: one per time step)."""
        return sum(self._items(e) for e in self.entries)

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        first = 0  # the pass's index of the entry's first item
        for entry in self.entries:
            count = self._items(entry)
            mine = [i for i in range(count) if (first + i) % workers == worker]
            first += count
            if not mine:
                continue
            tensors, attrs = self.load(entry)
            if self.as_dict:
                yield {"file": entry["file"], "epoch": entry["epoch"], "mini_batch": entry["mini_batch"], **tensors}
            elif self.mode == "distillation":
                yield from (self._step(tensors, step) for step in mine)
            elif self.mode == "history":
                yield self._history(tensors)
            else:
                yield self._batch(tensors, attrs, self.folder / entry["file"])

    def load(self, entry: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """One manifest entry's datasets as tensors on ``device``, and the shard's attributes."""
        path = self.folder / entry["file"]
        if self.verify_checksums:
            verify_shard(self.folder, entry)
        arrays, attrs = read_shard(path)  # audited like any input, with the default limits
        mode = _text(attrs[""].get("mode", ""))
        if mode != self.mode:
            raise RolloutError.field(path, "mode", repr(self.mode), repr(mode), "The shard is not from this run.")
        for name in REQUIRED[self.mode]:
            if name not in arrays:
                raise _missing(path, name, f"a dataset of every {self.mode} shard")
        if not any(name.startswith("observations/") for name in arrays) and self.mode != "history":
            raise _missing(path, "observations", "one or more datasets observations/<key>")
        if self.mode == "distillation" and arrays["dones"].shape[:1] != (self._items(entry),):
            found = f"{arrays['dones'].shape[:1]} steps"
            raise RolloutError.field(path, "dones", f"{self._items(entry)} steps (the manifest's rows / N)", found)
        return {name: torch.from_numpy(array).to(self.device) for name, array in arrays.items()}, attrs

    def _observations(self, tensors: dict[str, torch.Tensor], batch_size: list[int]) -> Any:
        observations = {n.split("/", 1)[1]: v for n, v in tensors.items() if n.startswith("observations/")}
        if not self.tensordict:
            return observations
        from tensordict import TensorDict

        return TensorDict(observations, batch_size=batch_size, device=self.device)

    def _batch(self, tensors: dict[str, torch.Tensor], attrs: dict[str, Any], path: Path) -> RolloutStorage.Batch:
        """A feed-forward or recurrent shard as RSL-RL's Batch."""
        order = [_text(n) for n in attrs.get("distribution", {}).get("order", [])]
        for name in order:
            if f"distribution/{name}" not in tensors:
                raise _missing(path, f"distribution/{name}", "a dataset named by the group's order attribute")
        params = tuple(tensors[f"distribution/{name}"] for name in order) or None
        scalars = {field: tensors[name].unsqueeze(-1) for name, field in SCALARS.items() if name in tensors}
        hidden: list[Any] = []
        for net in ("actor", "critic"):
            states = [tensors[f"hidden_states/{net}/{i}"] for i in (0, 1) if f"hidden_states/{net}/{i}" in tensors]
            hidden.append(None if not states else states[0] if len(states) == 1 else tuple(states))
        masks = tensors.get("masks")
        batch_size = list(masks.shape) if masks is not None else [tensors["actions"].shape[0]]
        return RolloutStorage.Batch(
            observations=self._observations(tensors, batch_size),
            actions=tensors["actions"],
            old_distribution_params=params,
            hidden_states=(hidden[0], hidden[1]),
            masks=masks,
            **scalars,
        )

    def _history(self, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        """A history shard as a dict (see the module docstring)."""
        dones = tensors["window_dones"]
        out: dict[str, Any] = {"observations": self._observations(tensors, list(dones.shape))}
        names = ("window_actions", "window_rewards", "window_dones", "window_env", "window_end")
        out.update({name: tensors[name] for name in names if name in tensors})  # actions, rewards: since 1.1
        return out

    def _step(self, tensors: dict[str, torch.Tensor], step: int) -> RolloutStorage.Batch:
        """One step of a distillation shard ``[steps, N, ...]`` as a Batch (RSL-RL's ``generator()``)."""
        dones = tensors["dones"]
        observations = {n: v[step] for n, v in tensors.items() if n.startswith("observations/")}
        return RolloutStorage.Batch(
            observations=self._observations(observations, [dones.shape[1]]),
            privileged_actions=tensors["privileged_actions"][step],
            dones=dones[step].unsqueeze(-1),
        )
