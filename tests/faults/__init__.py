"""pglock's fault suite (issue 6, shared/TESTING.md): killed, paused and cut-off holders,
terminated backends, restarted servers, and the oracles that prove nothing was lost.

Helpers:

* :mod:`.cluster`: a throwaway Postgres cluster (own data directory, free port, own settings)
  for restarts and server settings; never the shared server.
* :mod:`.replication`: a primary and a streaming standby (``pg_basebackup -R``), synchronous
  or asynchronous, with cut replication, kill, promote and a multi-host conninfo (T29).
* :mod:`.proxy`: a small threaded TCP proxy (pass, blackhole, reset, drop-responses) and
  :class:`.netfilter.Blackhole`, which drops a connection's packets in the kernel (iptables).
* :mod:`.procs` and ``holder.py``: lock holders in subprocesses, driven over pipes, which the
  tests SIGKILL, SIGSTOP and SIGCONT.
* :mod:`.oracles`: the lost-update counter and set, the overlap audit table, and the check
  that ``pg_locks`` matches what pglock believes.
* :mod:`.linearizability`: a small Wing-Gong-Lowe checker for mutex histories (T27).

Scenario ids T01..T29 (shared/TESTING.md; T29 failover is issue 14) are in the test names.
"""
