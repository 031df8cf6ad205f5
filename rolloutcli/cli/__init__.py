"""The ``rolloutcli`` command line: one module per command (or family), the shared options, signals, renderers.

Nothing here computes: each command parses its options, calls one pipeline function and renders the plain dict it
returns. ``app.py`` holds the typer app and ``main``; this package's ``__init__`` imports nothing, so a command
module can be imported without the whole app.
"""
