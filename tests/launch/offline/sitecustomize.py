"""Put first on a job's PYTHONPATH, this makes its Python processes refuse network access.

Python runs `sitecustomize` at start-up, before the script: every connection and name lookup
made from Python then fails, and prints a line the test looks for, since the library that
tried may catch the error and carry on.
"""

import socket
import sys

ATTEMPT_MARKER = "NETWORK ACCESS ATTEMPTED"


def _refuse(what):
    def refused(*args, **kwargs):
        print(f"{ATTEMPT_MARKER}: {what}{args}", file=sys.stderr, flush=True)
        raise OSError(f"{what}: no network access in an offline test")

    return refused


socket.socket.connect = _refuse("socket.connect")
socket.socket.connect_ex = _refuse("socket.connect_ex")
socket.getaddrinfo = _refuse("socket.getaddrinfo")
