"""The processes that compile for sm_90 (``python -m rdepc.codegen.sm90``), kept for the
next call from this process.

A compiling process pays about 7 s before its first build (``import torch, triton``, Triton's
first-build set-up); a process that compiles several times (a test session, a benchmark) pays
it once per process it keeps. Each takes one request at a time, a line of JSON, and answers
with one line per build as it finishes, then an end line; a process is kept only while its
answers are whole, and only for the environment it was started with (Triton reads its
settings from it; :data:`VOLATILE` aside). Kept processes exit when this one does: their
standard input closes.
"""

from __future__ import annotations

import atexit
import json
import subprocess
import sys
import tempfile
import threading

from rdepc.toolchain import package_home

END = {"end": True}  # the line after a request's last result
# Variables that change from call to call and that no compile reads: a process started with
# another value of them serves the call (pytest names the running test in one).
VOLATILE = ("PYTEST_CURRENT_TEST",)
KEEP = 4  # idle processes kept at most (each holds torch and Triton: about 400 MB)


class Compiler:
    """One ``python -m rdepc.codegen.sm90`` process started with ``env``."""

    def __init__(self, env: dict[str, str]):
        self.key = _key(env)
        self.err = tempfile.TemporaryFile()  # noqa: SIM115 (closed with the process) a file: a full pipe blocks
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rdepc.codegen.sm90"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self.err, text=True, env=env, cwd=package_home(),
        )  # fmt: skip

    def run(self, request: dict, each) -> str | None:
        """Send ``request``; ``each(result)`` for every result line; None when the answer was
        whole, else what the process wrote to its standard error meanwhile."""
        start = self.err.tell()
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            for line in self.proc.stdout:
                got = json.loads(line)
                if got == END:
                    return None
                each(got)
        except (BrokenPipeError, ValueError):  # it died before reading, or wrote what is no result
            pass
        self.proc.kill()
        self.proc.wait()
        self.err.seek(start)
        text = self.err.read().decode(errors="replace").strip()[-4000:]
        self.err.close()
        return text or f"exit status {self.proc.returncode}"

    def close(self) -> None:
        """Let it exit (its standard input closed), killed if it has not within 5 s."""
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
        self.err.close()


_IDLE: list[Compiler] = []
_LOCK = threading.Lock()


def take(env: dict[str, str]) -> Compiler:
    """The idle process started with ``env`` last given back, else a new one."""
    key = _key(env)
    with _LOCK:
        for i in reversed(range(len(_IDLE))):
            c = _IDLE[i]
            if c.key == key and c.proc.poll() is None:
                return _IDLE.pop(i)
    return Compiler(env)


def _key(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in VOLATILE}


def give_back(c: Compiler) -> None:
    """Keep ``c`` for the next call (the oldest idle one closed beyond :data:`KEEP`)."""
    with _LOCK:
        _IDLE.append(c)
        old = _IDLE[:-KEEP]
        del _IDLE[:-KEEP]
    for o in old:
        o.close()


@atexit.register
def _close_all() -> None:
    with _LOCK:
        idle = list(_IDLE)
        _IDLE.clear()
    for c in idle:
        c.close()
