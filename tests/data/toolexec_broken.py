"""A tools module that fails to import."""

import logitdiff_no_such_module_for_tests  # noqa: F401


def f():
    return 1
