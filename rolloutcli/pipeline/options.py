"""Options every command shares, resolved once and passed down (device, memory budget, safety)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from fractions import Fraction

from rolloutcli.errors import EXIT_USAGE, RolloutError, one_line
from rolloutcli.hdf5.limits import DEFAULT_MAX_MEMORY, SafetyOptions

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
MAX_SIZE = 1 << 50  # 1024T: a budget beyond any machine, and far from any integer overflow


def parse_size(text: str) -> int:
    """``64K``, ``256M``, ``2G``, ``1.5G``, ``1048576`` -> bytes (binary units)."""
    match = _SIZE.match(str(text))
    if not match:
        raise RolloutError(
            f"--max-memory: expected a size such as 64K, 256M or 2G, found '{text}'.", exit_code=EXIT_USAGE
        )
    size = int(Fraction(match.group(1)) * _UNITS[match.group(2).upper()])  # exact: no float overflow
    if size < 1024:
        raise RolloutError(f"--max-memory: expected at least 1K, found '{text}'.", exit_code=EXIT_USAGE)
    if size > MAX_SIZE:
        raise RolloutError(f"--max-memory: expected at most 1024T, found '{one_line(text)}'.", exit_code=EXIT_USAGE)
    return size


def resolve_device(name: str) -> str:
    """``auto`` -> ``"cuda"`` when available, else ``"cpu"``; ``cpu``; ``cuda`` / ``cuda:i`` (must exist).
    Torch is imported only for a name other than ``cpu``."""
    name = name.strip().lower()
    if name == "cpu":
        return "cpu"
    if name != "auto" and not re.fullmatch(r"cuda(:\d+)?", name):
        raise RolloutError(
            f"--device: expected auto, cpu, cuda or cuda:<index>, found '{one_line(name)}'.", exit_code=EXIT_USAGE
        )
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if not torch.cuda.is_available():
        raise RolloutError(
            f"--device: expected an available CUDA device, found '{name}' but no CUDA GPU is visible. "
            "Use --device cpu or --device auto.",
            exit_code=EXIT_USAGE,
        )
    count = torch.cuda.device_count()
    if ":" in name and int(name.split(":")[1]) >= count:
        raise RolloutError(f"--device: expected cuda:0..cuda:{count - 1}, found '{name}'.", exit_code=EXIT_USAGE)
    return name


@dataclass(frozen=True)
class RunOptions:
    """Resolved global options."""

    device: str = "cpu"
    max_memory: int = DEFAULT_MAX_MEMORY
    safety: SafetyOptions = field(default_factory=SafetyOptions)

    @classmethod
    def from_cli(cls, device: str = "cpu", max_memory: str = "1G", allow_external: bool = False) -> RunOptions:
        """Options from their command-line spelling; commands that compute nothing on a device leave ``cpu``."""
        return cls(resolve_device(device), parse_size(max_memory), SafetyOptions(allow_external=allow_external))
