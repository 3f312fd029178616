"""The test side of the holder subprocesses (``holder.py``): start, drive, kill, pause, resume."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HOLDER = Path(__file__).with_name("holder.py")
REPO = Path(__file__).resolve().parents[2]


class HolderError(RuntimeError):
    """The holder replied with an error (``.reply`` has its type, message and SQLSTATE)."""

    def __init__(self, reply: dict[str, Any]) -> None:
        self.reply = reply
        super().__init__(
            f"{reply.get('error')}: {reply.get('message')}\n{reply.get('traceback', '')}"
        )

    @property
    def error(self) -> str:
        return str(self.reply.get("error"))


class Holder:
    """One holder process. Requests are answered in order, one reply each."""

    def __init__(self, *, wait: bool = True) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(
            os.pathsep
        )
        self.proc = subprocess.Popen(
            [sys.executable, str(HOLDER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
            env=env,
        )
        self._replies: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._stderr: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._read_err, daemon=True).start()
        self.pid = self.proc.pid
        if wait:
            self.wait_ready()

    def wait_ready(self, timeout: float = 60) -> None:
        """Wait for the process to have imported pglock and psycopg."""
        ready = self.reply(timeout)
        assert ready.get("ready"), ready

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with contextlib.suppress(ValueError):
                self._replies.put(json.loads(line))
        self._replies.put(None)

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._stderr.append(line)

    @property
    def stderr(self) -> str:
        return "".join(self._stderr)

    def send(self, op: str, **kwargs: Any) -> None:
        """Send a request without waiting for its reply (collect it later with :meth:`reply`)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **kwargs}) + "\n")
        self.proc.stdin.flush()

    def reply(self, timeout: float = 30) -> dict[str, Any]:
        try:
            out = self._replies.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"holder {self.proc.pid} did not reply within {timeout} s") from None
        if out is None:
            raise RuntimeError(f"holder {self.proc.pid} exited ({self.proc.poll()}): {self.stderr}")
        return out

    def request(
        self, op: str, *, timeout: float = 30, check: bool = True, **kwargs: Any
    ) -> dict[str, Any]:
        self.send(op, **kwargs)
        out = self.reply(timeout)
        if check and not out.get("ok"):
            raise HolderError(out)
        return out

    # -- faults ----------------------------------------------------------------------------

    def kill(self) -> float:
        """SIGKILL; returns the monotonic time it was sent."""
        t = time.monotonic()
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        return t

    def stop(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def cont(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                os.kill(self.proc.pid, signal.SIGCONT)
            try:
                self.send("exit")
                self.proc.wait(5)
            except (OSError, subprocess.TimeoutExpired, ValueError):
                self.proc.kill()
                self.proc.wait(5)
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            with contextlib.suppress(Exception):
                if f is not None:
                    f.close()
