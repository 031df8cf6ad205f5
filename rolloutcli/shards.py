"""``ShardDataset``: read a ``rolloutcli batch`` folder back as RSL-RL mini-batches (a map-style torch ``Dataset``).

::

    from torch.utils.data import DataLoader
    from rolloutcli import ShardDataset

    dataset = ShardDataset("shards/", shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=None, pin_memory=True)   # batch_size=None: items are mini-batches
    for epoch in range(100):
        dataset.set_epoch(epoch)                      # a fresh order of shards (and of rows within them)
        for batch in loader:
            batch = batch.to("cuda", non_blocking=True)
            loss = ppo_loss(batch.observations, batch.actions, batch.advantages, ...)

An item is one mini-batch (one shard); for distillation, one time step (RSL-RL's ``generator()``). One pass covers
one epoch: by default the written epoch ``e % E`` for ``set_epoch(e)`` (``E`` written epochs), in manifest order
unless ``shuffle``; ``epochs="all"`` gives every written epoch in one pass (what RSL-RL's ``PPO.update()`` consumes
in one call), ``epochs=[...]`` the ones named. ``rank``/``world_size`` give each data-parallel process its own
shards of the pass (positions ``rank, rank + world_size, ...``), never overlapping.

Reading the next shard overlaps with the use of the current one: after each item the next shard of the pass is
read in a background thread (``DataLoader`` workers read ahead by themselves: there, no thread is started). Before
any ``fork`` (e.g. ``DataLoader`` starting workers) reads in flight are finished, so no worker inherits a
half-held HDF5 lock.

Batches come in RSL-RL's shapes (:class:`~rolloutcli.minibatch.Batch`; scalars with a trailing 1; observations a
``TensorDict``). History shards (``batch --history K``) come as dicts ``{"observations": {key: [B, K, ...]},
"window_actions": [B, K, ...], "window_rewards": [B, K],
"window_dones": [B, K], "window_env": [B], "window_end": [B]}``. ``as_dict=True`` yields each shard's datasets as
stored plus ``"file"``, ``"epoch"`` and ``"mini_batch"``.
"""

from __future__ import annotations

import bisect
import itertools
import os
import weakref
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset, get_worker_info

from rolloutcli.core.shuffle import epoch_order
from rolloutcli.errors import RolloutError
from rolloutcli.fields import FIELDS
from rolloutcli.hdf5.shards import read_shard
from rolloutcli.minibatch import Batch
from rolloutcli.shard_manifest import REQUIRED, _missing, _text, read_manifest, verify_shard

__all__ = ["ShardDataset", "read_manifest", "verify_shard"]

# per-step scalars of a Batch (stored [B], given [B, 1]): dataset name -> Batch attribute
SCALARS = {row.name: row.batch_name for row in FIELDS if row.trailing_one and row.batch_name and not row.flag}
ROW_SHUFFLED = ("feedforward", "history")  # modes whose rows are independent; recurrent and distillation keep time
Loaded = tuple[dict[str, torch.Tensor], dict[str, Any]]
_PREFETCHING: weakref.WeakSet[ShardDataset] = weakref.WeakSet()  # datasets that have started a prefetch thread


def _settle(pending: dict[int, Future[Loaded]]) -> None:
    """Cancel the reads of ``pending`` not started yet and wait for the others."""
    wait([future for future in list(pending.values()) if not future.cancel()])


def _finish_prefetches() -> None:
    """Before a fork: wait for every read in flight (a thread inside libhdf5 would leave its lock held in the child)."""
    for dataset in list(_PREFETCHING):
        _settle(dataset._ahead)


os.register_at_fork(before=_finish_prefetches)


def _rows(mode: str, tensors: dict[str, torch.Tensor]) -> int:
    """Source rows a loaded shard holds (what the manifest's ``rows`` counts)."""
    if mode == "history":
        return tensors["window_env"].shape[0]
    if mode == "recurrent":
        return tensors["actions"].shape[0] * tensors["actions"].shape[1]
    if mode == "distillation":
        return tensors["dones"].shape[0] * tensors["dones"].shape[1]
    return tensors["actions"].shape[0]


class ShardDataset(Dataset):
    """Mini-batches of a shard folder, verified against its manifest.

    Args:
        folder: output folder of ``rolloutcli batch`` (``manifest.json`` + shard files).
        device: where the items' tensors live (keep ``"cpu"`` with ``DataLoader`` workers; pin, then move).
        as_dict: yield each shard's datasets as stored instead of ``Batch`` objects.
        verify_checksums: check each shard's sha256 against the manifest before using it.
        epochs: the written epochs of one pass: None (default) the epoch ``e % E`` set by ``set_epoch(e)``,
            ``"all"`` every written epoch, or an iterable of epoch numbers.
        tensordict: observations as a ``TensorDict`` or a plain dict. Default: TensorDict in ``Batch`` objects,
            plain dicts in history items.
        shuffle, seed: draw a fresh order of the pass's shards each epoch, and of the rows within feed-forward and
            history shards (recurrent and distillation shards keep their time order); from ``seed`` and the epoch.
        rank, world_size: this process's share of each pass's shards (data-parallel training).
        prefetch: read the next shard in a background thread while the current one is used.
        read_bytes: the most reading one shard may take (default 1 GiB): its datasets' bytes, plus a compressed
            chunk decoded beside them; a shard over it is refused (``RolloutError``, naming its largest dataset)
            before any of its data is read. At most two shards are held (the current one and, with ``prefetch``,
            the next), plus one dataset's copy while ``shuffle`` reorders a shard's rows.
    """

    def __init__(
        self,
        folder: str | Path,
        *,
        device: str | torch.device = "cpu",
        as_dict: bool = False,
        verify_checksums: bool = False,
        epochs: Iterable[int] | str | None = None,
        tensordict: bool | None = None,
        shuffle: bool = False,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        prefetch: bool = True,
        read_bytes: int = 1 << 30,
    ) -> None:
        super().__init__()
        if not 0 <= rank < world_size:
            raise ValueError(
                f"ShardDataset: expected 0 <= rank < world_size, found rank={rank}, world_size={world_size}"
            )
        if isinstance(epochs, str) and epochs != "all":
            raise ValueError(f"ShardDataset: epochs must be None, 'all' or epoch numbers, found {epochs!r}")
        self.folder = Path(folder)
        self.manifest = read_manifest(self.folder)
        self.mode: str = self.manifest["mode"]
        self.epochs = epochs if epochs is None or isinstance(epochs, str) else sorted(set(epochs))
        self.device = torch.device(device)
        self.as_dict = as_dict
        self.verify_checksums = verify_checksums
        self.tensordict = self.mode != "history" if tensordict is None else tensordict
        self.shuffle, self.seed, self.rank, self.world_size = shuffle, seed, rank, world_size
        self.prefetch, self.read_bytes = prefetch, read_bytes
        self.set_epoch(0)

    # ----------------------------------------------------------------------------------------- the pass's items
    def set_epoch(self, epoch: int) -> None:
        """Choose the pass of training epoch ``epoch`` (call it before each epoch, as ``DistributedSampler``'s)."""
        self.epoch = epoch
        shards = self.manifest["shards"]
        written = sorted({e["epoch"] for e in shards})
        wanted = set(written if self.epochs == "all" else self.epochs or [written[epoch % len(written)]])
        positions = [i for i, e in enumerate(shards) if e["epoch"] in wanted]  # manifest order
        if self.shuffle:
            positions = [positions[int(j)] for j in epoch_order(len(positions), self.seed, epoch)]
        self.positions = positions[self.rank :: self.world_size]  # manifest index of each shard of the pass
        self.entries = [shards[i] for i in self.positions]
        self._offsets = list(itertools.accumulate((self._items(e) for e in self.entries), initial=0))
        self._drop_cache()

    def _items(self, entry: dict[str, Any]) -> int:
        """Items one entry yields: one per step of a distillation shard, else one."""
        if self.mode == "distillation" and not self.as_dict:
            return entry["rows"] // int(self.manifest["source"]["N"])
        return 1

    def __len__(self) -> int:
        """Items of one pass (distillation batches: one per time step)."""
        return self._offsets[-1]

    def __getitem__(self, index: int) -> Any:
        size = len(self)
        if not -size <= index < size:
            raise IndexError(f"ShardDataset index {index} out of range for {size} items")
        index %= size
        shard = bisect.bisect_right(self._offsets, index) - 1
        tensors, attrs = self._shard(shard, index)
        entry = self.entries[shard]
        if self.as_dict:
            return {"file": entry["file"], "epoch": entry["epoch"], "mini_batch": entry["mini_batch"], **tensors}
        if self.mode == "distillation":
            return self._step(tensors, index - self._offsets[shard])
        if self.mode == "history":
            return self._history(tensors)
        return self._batch(tensors, attrs, self.folder / entry["file"])

    def __iter__(self) -> Iterator[Any]:
        return (self[i] for i in range(len(self)))

    # ---------------------------------------------------------------------------------------- reading, prefetch
    def _drop_cache(self) -> None:
        _settle(self.__dict__.get("_ahead", {}))
        self._current: tuple[int, Loaded] | None = None
        self._ahead: dict[int, Future[Loaded]] = {}

    def __getstate__(self) -> dict[str, Any]:
        """Pickled for ``DataLoader`` workers without the thread and the shards in memory."""
        state = dict(self.__dict__)
        state.pop("_pool", None)
        state["_current"], state["_ahead"] = None, {}
        return state

    def _shard(self, shard: int, index: int) -> Loaded:
        """The loaded shard at position ``shard`` of the pass; then start reading the one this process needs next."""
        if self._current is None or self._current[0] != shard:
            pending = self._ahead.pop(shard, None)
            self._current = (shard, pending.result() if pending is not None else self._load_position(shard))
        if self.prefetch and get_worker_info() is None:  # DataLoader workers read ahead by themselves
            following = self._offsets[shard + 1]
            if following < len(self) and shard + 1 not in self._ahead:
                if "_pool" not in self.__dict__:
                    self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rolloutcli-prefetch")
                    _PREFETCHING.add(self)
                _settle(self._ahead)  # a read no longer wanted: cancelled, or finished before it is forgotten
                self._ahead = {shard + 1: self._pool.submit(self._load_position, shard + 1)}
        return self._current[1]

    def _load_position(self, shard: int) -> Loaded:
        """A shard of the pass loaded, its rows in this epoch's order where ``shuffle`` reorders them."""
        tensors, attrs = self.load(self.entries[shard])
        if self.shuffle and self.mode in ROW_SHUFFLED:
            rows = next(iter(tensors.values())).shape[0]
            order = epoch_order(rows, self.seed, self.epoch, stream=self.positions[shard] + 1).to(self.device)
            for name in list(tensors):  # one dataset at a time: each original is freed once reordered
                tensors[name] = tensors[name][order]
        return tensors, attrs

    def load(self, entry: dict[str, Any]) -> Loaded:
        """One manifest entry's datasets as tensors on ``device``, and the shard's attributes."""
        path = self.folder / entry["file"]
        if self.verify_checksums:
            verify_shard(self.folder, entry)
        arrays, attrs = read_shard(path, max_bytes=self.read_bytes)  # audited like any input, then bounded
        mode = _text(attrs[""].get("mode", ""))
        if mode != self.mode:
            raise RolloutError.field(path, "mode", repr(self.mode), repr(mode), "The shard is not from this run.")
        for name in REQUIRED[self.mode]:
            if name not in arrays:
                raise _missing(path, name, f"a dataset of every {self.mode} shard")
        if not any(name.startswith("observations/") for name in arrays) and self.mode != "history":
            raise _missing(path, "observations", "one or more datasets observations/<key>")
        N = int(self.manifest["source"]["N"])
        if self.mode == "distillation" and arrays["dones"].shape[:1] != (entry["rows"] // N,):
            found = f"{arrays['dones'].shape[:1]} steps"
            raise RolloutError.field(path, "dones", f"{entry['rows'] // N} steps (the manifest's rows / N)", found)
        tensors = {name: torch.from_numpy(array).to(self.device) for name, array in arrays.items()}
        if _rows(self.mode, tensors) != entry["rows"]:
            fix = "The manifest disagrees with its shard files; run `rolloutcli batch` again."
            found = f"{_rows(self.mode, tensors)} rows"
            raise RolloutError.field(path, "rows", f"{entry['rows']} rows (the manifest's)", found, fix)
        return tensors, attrs

    def _observations(self, tensors: dict[str, torch.Tensor], batch_size: list[int]) -> Any:
        observations = {n.split("/", 1)[1]: v for n, v in tensors.items() if n.startswith("observations/")}
        if not self.tensordict:
            return observations
        from tensordict import TensorDict

        return TensorDict(observations, batch_size=batch_size, device=self.device)

    def _batch(self, tensors: dict[str, torch.Tensor], attrs: dict[str, Any], path: Path) -> Batch:
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
        return Batch(
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

    def _step(self, tensors: dict[str, torch.Tensor], step: int) -> Batch:
        """One step of a distillation shard ``[steps, N, ...]`` as a Batch (RSL-RL's ``generator()``)."""
        dones = tensors["dones"]
        observations = {n: v[step] for n, v in tensors.items() if n.startswith("observations/")}
        return Batch(
            observations=self._observations(observations, [dones.shape[1]]),
            privileged_actions=tensors["privileged_actions"][step],
            dones=dones[step].unsqueeze(-1),
        )
