"""One error type whose message is the single line the CLI prints; and the one way a renamed
parameter keeps its old name for a release (docs/migration.md)."""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import Any, Callable, TypeVar

_F = TypeVar("_F", bound=Callable[..., Any])

# The first release without the old names of the reference RUN: `--teacher` (now `--reference`)
# and the `teacher=` parameters (now `reference=`, `reference_run=` in layers); docs/migration.md.
DEPRECATED_UNTIL = "0.3"


class LogitdiffError(Exception):
    """A user-facing error: bad input, mismatched runs, unreachable source.

    The message must be one line naming the file, item, position or field at fault.
    The CLI prints ``error: <message>`` and exits with status 2.
    """


def renamed_parameters(**renamed: str) -> Callable[[_F], _F]:
    """A function whose keyword parameters were renamed (``old="new"``): a call by an old name
    still works until DEPRECATED_UNTIL, with one DeprecationWarning pointing at the caller's
    line; the old and the new name together are a LogitdiffError. Calls by the new names (or
    by position) pass straight through."""

    def decorate(fn: _F) -> _F:
        sig = inspect.signature(fn)
        name = fn.__qualname__.removesuffix(".__init__")  # a class by its name
        for old, new in renamed.items():
            if new not in sig.parameters or old in sig.parameters:
                raise TypeError(f"{fn.__qualname__}: cannot rename {old!r} to {new!r}")

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            for old, new in renamed.items():
                if old not in kwargs:
                    continue
                value = kwargs.pop(old)
                try:
                    given = new in sig.bind_partial(*args, **kwargs).arguments
                except TypeError:  # another argument is wrong: the call itself says so below
                    given = new in kwargs
                if given:
                    raise LogitdiffError(f"{name}: both {old}= and {new}= given; {old}= is the deprecated name of "
                                         f"{new}= (accepted until {DEPRECATED_UNTIL}): give {new}= only")
                warnings.warn(f"{name}: {old}= is deprecated, use {new}= (accepted until {DEPRECATED_UNTIL})",
                              DeprecationWarning, stacklevel=2)
                kwargs[new] = value
            return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate
