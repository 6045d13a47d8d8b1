"""Start a supervised child so that it dies with its supervisor: ``python -m keelctl.lifeline PID ARGV...``.

Arms Linux's parent-death signal (prctl PR_SET_PDEATHSIG = SIGTERM, so a stage still drains what
it has in flight), checks that the supervisor ``PID`` is still its parent (it may have died before
the signal was armed), then execs ``ARGV``; the signal survives the exec. The kernel sends it when
the thread that forked the child ends (shared/parentdeath.py), so the supervisor forks every child
from its main thread.
"""
from __future__ import annotations

import os
import signal
import sys

from shared import parentdeath


def main(argv: list[str]) -> int:
    supervisor, command = int(argv[0]), argv[1:]
    if not parentdeath.arm(signal.SIGTERM, supervisor):
        print(f"supervisor {supervisor} is gone; not starting {command[0]}", file=sys.stderr)
        return 1
    os.execv(command[0], command)
    return 1  # not reached: execv replaces this process


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
