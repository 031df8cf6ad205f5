"""The time-out rule a file asks for (format 1.2): its root attribute ``timeouts_rule``, read and checked, and
the words the commands use to say which rule they applied and why.

A recorder writes the rule of the trainer it recorded (``rsl`` for RSL-RL; ``final-value`` for gymnasium, SB3
and TorchRL); imports write none unless the user names it. ``gae`` applies an explicit ``--timeouts``, else the
file's rule, else the 1.1 default ``rsl`` and says so (:data:`DEFAULT_NOTE`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rolloutcli.core.timeouts import DEFAULT_RULE, RULES, decide_rule
from rolloutcli.errors import EXIT_BAD_DATA, RolloutError

ATTRIBUTE = "timeouts_rule"
SOURCES = {"option": "--timeouts", "file": "the file's timeouts_rule", "default": "default: the file names none"}
DEFAULT_NOTE = (
    "{path}: no timeouts_rule attribute: applied --timeouts " + DEFAULT_RULE + " (RSL-RL's rule); pass --timeouts "
    "final-value for gymnasium, SB3 or TorchRL data."
)

# one line of at most 80 columns after "warning: " for up to 99,999 files (--timeouts names the other rules)
DATASET_DEFAULT_NOTE = "{count} of {files} files lack timeouts_rule: applied --timeouts " + DEFAULT_RULE + " to them"


def recorded_rule(path: Path | str, attrs: Mapping[str, Any]) -> str | None:
    """The file's ``timeouts_rule`` (None when absent); any other value than a rule's name is refused (exit 1)."""
    value = attrs.get(ATTRIBUTE)
    if value is None:
        return None
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    if isinstance(value, str) and value in RULES:
        return value
    raise RolloutError(
        f"{path}: attribute '{ATTRIBUTE}': expected one of {', '.join(RULES)}, found {value!r}. Set it to the "
        f"trainer's rule (h5py: f.attrs['{ATTRIBUTE}'] = 'rsl'), or pass --timeouts.",
        exit_code=EXIT_BAD_DATA,
    )


def describe(rule: str, source: str) -> str:
    """``"final-value (the file's timeouts_rule)"``: the rule applied and where it came from."""
    return f"{rule} ({SOURCES[source]})"


def report(path: Path | str, attrs: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``inspect``'s entry: ``recorded`` (the file's ``timeouts_rule``), ``gae`` (the rule ``gae`` applies to the
    file without ``--timeouts``) with ``from`` (``file`` or ``default``), ``applied`` (the rule an earlier ``gae``
    applied: its ``gae_timeouts``, else None); a bad attribute is a warning here, not an error."""
    try:
        recorded, warnings = recorded_rule(path, attrs), []
    except RolloutError as error:
        recorded, warnings = None, [str(error).removeprefix(f"{path}: ")]
    rule, source = decide_rule(None, recorded)
    applied = attrs.get("gae_timeouts")
    applied = applied.decode("utf-8", "replace") if isinstance(applied, bytes) else applied
    return {"recorded": recorded, "gae": rule, "from": source, "applied": applied}, warnings
