"""moto's S3 server in a process of its own, for the S3 benchmarks (``bench_s3.py``).

A real S3 never shares a process with its clients. moto run in the benchmark's own process
(``ThreadedMotoServer``) shares one interpreter, and so its lock (the GIL), with the clients
it is measuring them against: every request the server answers takes the interpreter from
the client threads, and a client's CPU time is the server's too. ``MotoProcess`` starts the
same server (moto's WSGI app behind werkzeug's threaded server, as ``ThreadedMotoServer``
runs it) as a child process bound to 127.0.0.1 on a free port, and asks it over a pipe for

- its CPU time (``time.process_time`` there: every thread's, those that have ended too), so a
  benchmark can report the server's work apart from the clients'; and
- the requests it answered, by method as S3's rate classes count them (``GET``, ``PUT``,
  ``HEAD``, ``DELETE``, ``POST``, ``COPY``, ``LIST``), counted in the server as each one arrives.

Not a benchmark itself (the leading underscore). Run as a script it is the child: it prints
``endpoint <url>`` once the server listens, answers each ``stat`` line on stdin with one line
of JSON ``{"cpu": seconds, "requests": {method: count}}``, and stops when stdin closes.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import subprocess
import sys
import threading
import time
import urllib.parse
from typing import Any

__all__ = ["MotoProcess"]


class MotoProcess:
    """The child process running moto's S3 server (see module docstring); stop it with ``stop``."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        assert self.proc.stdout is not None and self.proc.stdin is not None
        first = self.proc.stdout.readline().split()
        if len(first) != 2 or first[0] != "endpoint":
            self.stop()
            raise RuntimeError(f"the moto server process did not start (it said {' '.join(first)!r})")
        self.endpoint = first[1]
        self.pid = self.proc.pid

    def stat(self) -> tuple[float, collections.Counter[str]]:
        """(the server process's CPU seconds so far, the requests it has answered so far, by method)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("stat\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the moto server process ended (exit status {self.proc.poll()})")
        answer = json.loads(line)
        return float(answer["cpu"]), collections.Counter(answer["requests"])

    def stop(self) -> None:
        """Close its stdin (it shuts the server down and exits) and wait; killed after 30 s."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _method(environ: dict[str, Any]) -> str:
    """A request's method as S3's rate classes count it (a listing is a GET on the bucket)."""
    method = environ["REQUEST_METHOD"]
    query = urllib.parse.parse_qs(environ.get("QUERY_STRING", ""), keep_blank_values=True)
    if method == "PUT" and environ.get("HTTP_X_AMZ_COPY_SOURCE"):
        return "COPY"
    if method == "GET" and ("list-type" in query or "prefix" in query):
        return "LIST"
    return method


def _serve() -> None:
    from moto.server import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    counts: collections.Counter[str] = collections.Counter()
    lock = threading.Lock()
    app = DomainDispatcherApplication(create_backend_app)

    def counted(environ: dict[str, Any], start_response: Any) -> Any:
        method = _method(environ)
        with lock:
            counts[method] += 1
        return app(environ, start_response)

    server = make_server("127.0.0.1", 0, counted, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    host, port = server.server_address[:2]
    print(f"endpoint http://{host}:{port}", flush=True)
    for line in sys.stdin:
        if line.strip() == "stat":
            with lock:
                snapshot = dict(counts)
            print(json.dumps({"cpu": time.process_time(), "requests": snapshot}), flush=True)
    server.shutdown()
    thread.join()


if __name__ == "__main__":
    _serve()
