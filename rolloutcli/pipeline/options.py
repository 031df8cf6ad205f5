"""Options every command shares, resolved once and passed down (device, memory budget, safety)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from rolloutcli.errors import EXIT_USAGE, RolloutError
from rolloutcli.hdf5.reader import DEFAULT_MAX_MEMORY
from rolloutcli.hdf5.safety import SafetyOptions

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """``64K``, ``256M``, ``2G``, ``1.5G``, ``1048576`` -> bytes (binary units)."""
    match = _SIZE.match(str(text))
    if not match:
        raise RolloutError(
            f"--max-memory: expected a size such as 64K, 256M or 2G, found '{text}'.", exit_code=EXIT_USAGE
        )
    size = int(float(match.group(1)) * _UNITS[match.group(2).upper()])
    if size < 1024:
        raise RolloutError(f"--max-memory: expected at least 1K, found '{text}'.", exit_code=EXIT_USAGE)
    return size


def resolve_device(name: str) -> torch.device:
    """``auto`` -> CUDA when available, else CPU; ``cpu``; ``cuda`` / ``cuda:i`` (must exist)."""
    name = name.strip().lower()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if re.fullmatch(r"cuda(:\d+)?", name):
        if not torch.cuda.is_available():
            raise RolloutError(
                f"--device: expected an available CUDA device, found '{name}' but no CUDA GPU "
                "is visible. Use --device cpu or --device auto.",
                exit_code=EXIT_USAGE,
            )
        device = torch.device(name)
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise RolloutError(
                f"--device: expected cuda:0..cuda:{torch.cuda.device_count() - 1}, found '{name}'.",
                exit_code=EXIT_USAGE,
            )
        return device
    raise RolloutError(f"--device: expected auto, cpu, cuda or cuda:<index>, found '{name}'.", exit_code=EXIT_USAGE)


@dataclass(frozen=True)
class RunOptions:
    """Resolved global options."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    max_memory: int = DEFAULT_MAX_MEMORY
    safety: SafetyOptions = field(default_factory=SafetyOptions)

    @classmethod
    def from_cli(cls, device: str = "auto", max_memory: str = "1G", allow_external: bool = False) -> RunOptions:
        return cls(resolve_device(device), parse_size(max_memory), SafetyOptions(allow_external=allow_external))
