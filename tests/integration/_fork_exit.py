"""Run by test_fork.py: ``_fork_exit.py KIND HOW DSN APP_NAME LOCK_NAME``.

The parent takes a hold of KIND (a ``with`` block's entry) and forks inside the block. The child
leaves the block with ``sys.exit(0)`` (HOW ``sys_exit``) or normally, then reaches the end of the
script (``script_end``): either way its atexit handlers and garbage collection run. The parent
waits for it, then prints one JSON line: the child's exit status, whether Postgres shows its hold
unchanged, what happened to its sessions, its own release's error (None) and whether Postgres
then shows nothing held.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import warnings

from _forking import KINDS, CancelSpy, observer, sessions, untouched


def main() -> None:
    kind_name, how, dsn, app_name, lock_name = sys.argv[1:6]
    kind = {k.name: k for k in KINDS}[kind_name](dsn, lock_name)
    kind.hold()
    with observer(dsn) as obs:  # closed before the fork: the child inherits no observer
        truth, before = kind.truth(obs), sessions(obs, app_name)
    pid = -1
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork() with threads (3.12+)
            pid = os.fork()
        if pid == 0:
            spy = CancelSpy(set(before))  # checked first at exit (atexit runs the last first)
            atexit.register(lambda: spy.sent and os._exit(3))
        if pid == 0 and how == "sys_exit":
            sys.exit(0)
    except BaseException as exc:
        if pid == 0:  # the with block's exit, as the exception leaves it
            kind.entered.__exit__(type(exc), exc, exc.__traceback__)
        raise
    if pid == 0:
        kind.entered.__exit__(None, None, None)  # the end of the with block, then of the script
        return
    _, status = os.waitpid(pid, 0)
    report: dict[str, object] = {"child": os.waitstatus_to_exitcode(status)}
    with observer(dsn) as obs:
        report["truth_kept"] = kind.truth(obs) == truth
        report["sessions"] = untouched(before, sessions(obs, app_name), kind.busy)
        try:
            kind.release()
            report["release"] = None
        except BaseException as exc:
            report["release"] = repr(exc)
        report["released"] = kind.released(obs)
    kind.close()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
