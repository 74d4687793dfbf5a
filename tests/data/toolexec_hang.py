"""A tools module whose import never finishes."""

import time

time.sleep(60)


def f():
    return 1
