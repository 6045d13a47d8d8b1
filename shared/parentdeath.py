"""Have the kernel signal this process when its parent ends (Linux's prctl PR_SET_PDEATHSIG).

The signal survives an exec. The kernel sends it when the *thread* that forked this process ends,
so a parent forks such children from a thread that lives as long as it does (its main thread).
"""
from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1


def arm(sig: signal.Signals, parent: int) -> bool:
    """Arm `sig` for the parent's death; False when `parent` is no longer this process's parent
    (it died before the signal was armed, and nothing would send it)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG): {os.strerror(err)}")
    return os.getppid() == parent
