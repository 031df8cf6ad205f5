"""A shard folder's ``manifest.json`` checked against its files (the reader's side; ``hdf5/shards.py`` writes it)."""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rolloutcli.errors import EXIT_BAD_DATA, EXIT_IO, RolloutError, problem_line
from rolloutcli.hdf5.shards import FORMAT_VERSION, MANIFEST_FORMAT, MANIFEST_NAME, manifest_text

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
    found = file_sha256(path)
    if found != entry["sha256"]:
        raise RolloutError.field(path, "sha256", entry["sha256"], found, _DAMAGED)


def file_sha256(path: Path) -> str:
    """The sha256 of a file's bytes (hex), as the manifest records a shard's."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()
