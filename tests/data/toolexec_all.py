"""A tools module that names its tools in __all__ (an imported function among them)."""

from json import dumps

__all__ = ["dumps", "double"]


def double(x):
    return 2 * x


def hidden(x):
    return x
