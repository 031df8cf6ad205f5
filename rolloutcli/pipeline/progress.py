"""How pipelines report progress without printing: they call a ``Progress`` the caller provides."""

from __future__ import annotations

from typing import Protocol


class Progress(Protocol):
    """Receives progress events; the CLI renders them as rich bars on stderr."""

    def start(self, description: str, total: int) -> None: ...

    def advance(self, amount: int = 1) -> None: ...

    def finish(self) -> None: ...

    def warn(self, message: str) -> None: ...


class NoProgress:
    """A ``Progress`` that ignores every event (library use, ``--quiet``)."""

    def start(self, description: str, total: int) -> None:
        pass

    def advance(self, amount: int = 1) -> None:
        pass

    def finish(self) -> None:
        pass

    def warn(self, message: str) -> None:
        pass
