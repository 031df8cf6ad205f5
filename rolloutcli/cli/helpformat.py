"""How a command's help names its arguments: as a user types them (``FILE...``, ``SRC``), not as typer's types
(``{FILE}...``, ``FILE <list[str]>``, ``SRC <path>``). Options keep typer's rows (choices, ranges, defaults)."""

from __future__ import annotations

from typing import Any

from typer.core import TyperCommand

# click's Parameter, Context and HelpFormatter: typer vendors its own click, not the package of that name
Click = Any


def argument_name(param: Click) -> str:
    """``FILE...`` for an argument taking several values, ``FILE`` for one; in brackets when optional."""
    name = (param.metavar or param.name or "").upper() + ("..." if param.nargs != 1 else "")
    return name if param.required else f"[{name}]"


class Command(TyperCommand):
    """A typer command whose usage line and ``Arguments`` section show ``argument_name``."""

    def collect_usage_pieces(self, ctx: Click) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        return pieces + [argument_name(p) for p in self.get_params(ctx) if p.param_type_name == "argument"]

    def format_options(self, ctx: Click, formatter: Click) -> None:
        params = self.get_params(ctx)
        rows: dict[str, list[Any]] = {"argument": [], "option": []}
        for param in params:
            if param.param_type_name == "argument" and not getattr(param, "hidden", False):
                text = (getattr(param, "help", None) or "") + ("  [required]" if param.required else "")
                rows["argument"].append((argument_name(param), text))
            elif param.param_type_name == "option" and (row := param.get_help_record(ctx)) is not None:
                rows["option"].append(row)
        for title, kind in (("Arguments", "argument"), ("Options", "option")):
            if rows[kind]:
                with formatter.section(title):
                    formatter.write_dl(rows[kind])
