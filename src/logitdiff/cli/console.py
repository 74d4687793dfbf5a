"""The one console and progress helper every command uses.

Messages and progress bars go to stderr (so stdout stays the tables a user may pipe);
tables go to stdout, at a fixed width when stdout is not a terminal.
"""

from __future__ import annotations

import sys


def console():
    """The stderr console: messages, errors, progress. Not a terminal (a CI log, a file): one
    message a line, never wrapped at rich's default 80 columns, so a gate line or a stage can
    be grepped whole."""
    from rich.console import Console

    return Console(stderr=True, soft_wrap=not sys.stderr.isatty())


def table_console(width: int = 160):
    """The stdout console for tables; when piped (no terminal) a width that fits them."""
    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=width)


def progress(total: int | None, description: str):
    """A progress bar on stderr (drawn only on a terminal) and its ``advance(n=1)``."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    p = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console(),
        transient=False,
        disable=not sys.stderr.isatty(),
    )
    task = p.add_task(description, total=total)
    return p, (lambda n=1: p.advance(task, n))


class Bars:
    """Successive progress bars for a library call that reports stages (``bar(total,
    label) -> advance``); each new bar stops the previous one. Use as a context manager so
    the last bar is stopped however the call ends."""

    def __init__(self):
        self._bars = []

    def bar(self, total: int | None, label: str):
        for p in self._bars:
            p.stop()
        p, advance = progress(total, label)
        p.start()
        self._bars.append(p)
        return advance

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for p in self._bars:
            p.stop()
