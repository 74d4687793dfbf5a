"""Example tools module for tests/test_toolexec.py: plain functions named like the tools."""

import os
import socket
import subprocess
import time
from os import system  # imported, not defined here: must not be callable as a tool  # noqa: F401


def get_weather(city, unit="celsius"):
    """Deterministic fake weather: the temperature is derived from the city name."""
    t = sum(map(ord, city)) % 35
    if unit == "fahrenheit":
        t = t * 9 / 5 + 32
    return {"city": city, "unit": unit, "temperature": t}


def add(a, b):
    return a + b


def sleep_long(seconds=60):
    time.sleep(seconds)
    return "woke up"


def connect(port):
    """Reach a server on 127.0.0.1 through the usual route (getaddrinfo, then connect)."""
    with socket.create_connection(("127.0.0.1", port), timeout=2):
        return "connected"


def connect_raw(port):
    """Reach it with a bare socket and an IP literal (no name lookup)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.settimeout(2)
        s.connect(("127.0.0.1", port))
        return "connected"
    finally:
        s.close()


def write_file(path, text="x"):
    with open(path, "w") as f:
        f.write(text)
    with open(path) as f:
        return {"path": path, "cwd_is_home": os.getcwd() == os.environ.get("HOME"), "read": f.read()}


def symlink_write(target):
    """A link inside the working directory that points outside it, then a write through it."""
    os.symlink(target, "link")
    with open("link", "w") as f:
        f.write("escaped")
    return "written"


def where():
    """The working directory, after writing a file into it."""
    with open("here.txt", "w") as f:
        f.write("here")
    return os.getcwd()


def low_level_write(path):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    os.close(fd)
    return "written"


def remove(path):
    os.remove(path)
    return "removed"


def spawn():
    return subprocess.run(["true"]).returncode


def shell():
    return os.system("true")


def fail(n):
    raise TypeError(f"bad n: {n!r}\nsecond line")


def odd_value():
    return {1, 2, 3}


def hog_memory():
    return len(bytearray(2 << 30))


def noisy():
    print("this goes to stderr, not into the result")
    return 7


def env_view():
    return {k: os.environ.get(k) for k in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "PYTHONPATH")}


def _private():
    return "secret"


def exit_early():
    os._exit(3)


def abort():
    os.abort()
