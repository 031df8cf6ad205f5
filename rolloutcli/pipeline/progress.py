"""How pipelines report progress without printing: they call a ``Progress`` the caller provides."""

from __future__ import annotations


class Progress:
    """Receives progress events and ignores them (library use); the CLI's ``RichProgress`` draws bars."""

    def start(self, description: str, total: int) -> None:
        pass

    def advance(self, amount: int = 1) -> None:
        pass

    def finish(self) -> None:
        pass

    def warn(self, message: str) -> None:
        pass
