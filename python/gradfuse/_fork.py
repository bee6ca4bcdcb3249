"""Fork state: whether this process was made by ``os.fork()`` from one that had imported gradfuse.

A module of its own so that the ops layer (which imports it with the package, before any fork)
and the CPU backend (which reads it, possibly first loaded after a fork) both depend on it and
not on each other.
"""

from __future__ import annotations

import os

#: Whether this process was made by os.fork() from one that had imported gradfuse. Its CPU
#: thread pools (torch's OpenMP team, rayon's pool) did not come along: the CPU backend then
#: runs its loops on a pool of its own (rust/parallel.rs), also when first loaded after the fork.
forked_child = False


def _after_fork_in_child() -> None:
    global forked_child
    forked_child = True


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_after_fork_in_child)
