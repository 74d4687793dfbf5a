"""A tools module that reaches the network while importing (must be refused)."""

import socket

socket.create_connection(("127.0.0.1", 9), timeout=1)


def f():
    return 1
