"""What ``import`` reads before it plans: a ``torch.save`` source read tensor by tensor, Minari's metadata.json
parsed within bounds, and a source's datasets checked for shapes and kinds before any is indexed.

Every refusal is one line (exit 1) naming the file, the dataset or key, what was expected and what was found.
"""

from __future__ import annotations

import json
import math
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from rolloutcli.errors import RolloutError, problem_line
from rolloutcli.hdf5.schema import DatasetInfo

MAX_METADATA_BYTES = 16 * 2**20  # Minari writes a few kilobytes
MAX_METADATA_DEPTH = 64
PLAIN_KEY = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")  # a tensor's key becomes a dataset name
# Flag datasets read to find episode ends: [rows, ...] with at least one number per row.
FLAGS = {
    "d4rl": ("terminals", "timeouts"),
    "ikostrikov": ("masks", "bad_masks"),
    "minari": ("terminations", "truncations"),
    "robomimic": ("dones",),
}


class TensorSource:
    """A ``torch.save``d dict of tensors (an ikostrikov storage's state) read like an ``H5Input``: loaded with
    ``mmap=True``, each tensor converted only when its rows are read."""

    def __init__(self, path: Path) -> None:
        _check_stored(path)
        import torch

        self.path, self.attrs = path, {}
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch warns on stderr about what it then refuses
                state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:  # torch raises many kinds for a foreign pickle
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise RolloutError(
                f"{path}: cannot load it as tensors ({first[:200]}). Save the storage's tensors as a dict: "
                "torch.save({k: getattr(storage, k) for k in ('obs', 'masks', 'bad_masks', ...)}, path)."
            ) from exc
        if not isinstance(state, dict):
            state = {}
        self.tensors = {_key(path, k): _tensor(path, k, v) for k, v in state.items()}
        self.datasets = {k: DatasetInfo(tuple(t.shape), _numpy_dtype(t)) for k, t in self.tensors.items()}

    def slice(self, name: str, index: tuple[Any, ...] = ()) -> np.ndarray:
        tensor = self.tensors[name].detach().resolve_conj().resolve_neg()
        return np.array(tensor[index].numpy()) if index else np.array(tensor.numpy())

    def close(self) -> None:
        self.tensors.clear()


def _check_stored(path: Path) -> None:
    """torch.save stores its members uncompressed, so they can be memory-mapped; a compressed one would be
    inflated whole, whatever its declared size."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as archive:
            packed = [i for i in archive.infolist() if i.compress_type != zipfile.ZIP_STORED]
    except Exception as exc:  # zipfile raises many kinds for a damaged archive
        raise RolloutError(f"{path}: cannot read it as a torch.save archive ({str(exc)[:200]}).") from exc
    if packed:
        raise RolloutError(
            f"{path}: member '{packed[0].filename[:120]}': expected torch.save's uncompressed members (read "
            f"memory-mapped), found it compressed ({packed[0].file_size} bytes declared). Load it with torch and "
            "save it again with torch.save."
        )


def _key(path: Path, key: object) -> str:
    if not isinstance(key, str) or not PLAIN_KEY.match(key):
        raise RolloutError(
            f"{path}: key {str(key)[:80]!r}: expected a plain name (letters, digits, _ . -), found another; "
            "it cannot name a dataset. Save the tensors under plain keys."
        )
    return key


def _tensor(path: Path, key: str, value: Any) -> Any:
    """``value`` when it is a dense CPU tensor numpy can hold; else a one-line refusal naming ``key``."""
    import torch

    found = None
    if not isinstance(value, torch.Tensor):
        found = f"a {type(value).__name__}"
    elif value.layout != torch.strided:
        found = f"a {str(value.layout).removeprefix('torch.')} tensor"
    elif value.device.type != "cpu":
        found = f"a tensor on device '{value.device.type}' (no data)"
    elif value.is_quantized:
        found = "a quantized tensor"
    elif value.dtype in (torch.bfloat16,) or _numpy_dtype(value) is None:
        found = f"dtype {str(value.dtype).removeprefix('torch.')}"
    if found is None:
        return value
    raise RolloutError(
        problem_line(
            path,
            key,
            "a dense CPU tensor of a numpy dtype (bool, integers, float16/32/64, complex)",
            found,
            "Convert it before saving (tensor.to_dense().float().cpu()), or leave it out of the dict.",
        )
    )


def _numpy_dtype(tensor: Any) -> np.dtype | None:
    import torch

    try:
        return torch.empty(0, dtype=tensor.dtype).numpy().dtype
    except (TypeError, RuntimeError):
        return None


def read_metadata(meta_path: Path) -> dict[str, Any]:
    """Minari's metadata.json: a JSON object of at most ``MAX_METADATA_BYTES``, nested at most
    ``MAX_METADATA_DEPTH`` deep (checked before parsing)."""
    try:
        size = meta_path.stat().st_size
        if size > MAX_METADATA_BYTES:
            raise RolloutError(
                f"{meta_path}: expected Minari metadata of at most {MAX_METADATA_BYTES // 2**20} MiB, found "
                f"{size} bytes. Check that this is the metadata.json Minari wrote."
            )
        text = meta_path.read_text(errors="replace")
    except OSError as exc:
        raise RolloutError(f"{meta_path}: unreadable Minari metadata ({exc}).", exit_code=3) from exc
    depth = _depth(text)
    if depth > MAX_METADATA_DEPTH:
        raise RolloutError(
            f"{meta_path}: expected Minari metadata nested at most {MAX_METADATA_DEPTH} deep, found {depth} "
            "levels. Check that this is the metadata.json Minari wrote."
        )
    try:
        meta = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise RolloutError(f"{meta_path}: unreadable Minari metadata ({str(exc)[:200]}).") from exc
    if not isinstance(meta, dict):
        raise RolloutError(
            f"{meta_path}: expected Minari metadata as a JSON object, found a JSON {type(meta).__name__}. "
            "Check that this is the metadata.json Minari wrote."
        )
    return meta


def _depth(text: str) -> int:
    """How deep ``text``'s brackets nest outside strings (an upper bound on the JSON's depth)."""
    depth = deepest = 0
    for token in re.finditer(r'"(?:[^"\\]|\\.)*"|[\[{]|[\]}]', text):
        mark = token.group(0)
        if mark in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif mark in "]}":
            depth -= 1
    return deepest


def episode_key(number: str) -> tuple[int, str]:
    """The order of an episode's digits (demo_2 before demo_10) without int(): names may hold thousands."""
    digits = number.lstrip("0")
    return len(digits), digits


def check_listing(path: object, layout: str, listing: dict[str, Any]) -> None:
    """Refuse (one line) a flag dataset that is not ``[rows, ...]`` numbers with a value per row, or a
    per-step dataset the plan indexes by rows that has no rows axis."""
    names = set(FLAGS[layout])
    for name, info in listing.items():
        leaf = name.rsplit("/", 1)[-1]
        nested = layout in ("minari", "robomimic") and name.count("/") == (1 if layout == "minari" else 2)
        if (leaf in names and (nested or "/" not in name)) and (
            not info.shape or math.prod(info.shape[1:]) == 0 or info.dtype.kind not in "biuf"
        ):
            raise RolloutError(
                problem_line(
                    path,
                    name,
                    "one flag per step: shape [rows] or [rows, ...] of numbers, at least one per row",
                    f"shape {list(info.shape)}, dtype {info.dtype}",
                    "Re-export the recording with its episode-end flags.",
                )
            )
        if leaf == "actions" and not info.shape:
            raise RolloutError(
                problem_line(path, name, "one row per step", "a scalar dataset", "Re-export the recording.")
            )


def check_episode_fields(path: object, layout: str, listing: dict[str, Any]) -> None:
    """Every episode stores the same datasets: one lacking what another has would be imported with zeros."""
    pattern = {"minari": r"^(episode_\d+)/(.+)$", "robomimic": r"^(data/demo_\d+)/(.+)$"}.get(layout)
    if pattern is None:
        return
    regex = re.compile(pattern)
    episodes: dict[str, set[str]] = {}
    for name in listing:
        if m := regex.match(name):
            episodes.setdefault(m.group(1), set()).add(m.group(2))
    every = set().union(*episodes.values()) if episodes else set()
    for episode, names in episodes.items():
        if missing := sorted(every - names):
            raise RolloutError(
                f"{path}: episode '{episode}': expected '{missing[0]}' as other episodes store it, found it "
                f"missing{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}; importing would fill it "
                "with zeros. Re-export the episode with every field, or remove the field from every episode."
            )


def next_observation_mismatch(
    source: Any, listing: dict[str, Any], dones: Callable[[int, int], np.ndarray], budget: int
) -> dict[str, int]:
    """D4RL: for each ``next_observations`` dataset, how many rows inside an episode (``dones(start, stop)``
    0) differ from the next ``observations`` row (NaN equal to NaN), read in blocks of at most about ``budget``
    bytes."""
    found = {}
    for name in listing:
        top, _, key = name.partition("/")
        obs = f"observations/{key}" if key else "observations"
        if top != "next_observations" or obs not in listing or listing[obs].shape != listing[name].shape:
            continue
        T = listing[name].shape[0]
        row = max(math.prod(listing[name].shape[1:]) * listing[name].dtype.itemsize, 1)
        step, count = max(1, budget // (4 * row)), 0
        for start in range(0, T - 1, step):
            stop = min(start + step, T - 1)
            ahead = source.slice(name, (slice(start, stop),))
            after = source.slice(obs, (slice(start + 1, stop + 1),))
            differ = (ahead != after) & ~((ahead != ahead) & (after != after))
            differ = differ.reshape(stop - start, -1).any(axis=1) & (dones(start, stop).reshape(-1) == 0)
            count += int(np.count_nonzero(differ))
        if count:
            found[name] = count
    return found
