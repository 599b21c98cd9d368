"""``python -m kuberl.util.relay CMD ...``: run CMD, pass it the SIGTERM (and SIGINT) this process
gets, and end as CMD does, except that a CMD that fails after a SIGTERM ends with 143.

A multi-process trainer runs under torchrun, which ends with 1 on SIGTERM (its SignalException),
even when every rank stopped at its step boundary and checkpointed. The trainer Job's pod failure
policy tells a trainer stopped by SIGTERM (exit 143: its Job suspended or preempted) from a failed
one by the exit code, so the trainer pod runs torchrun under this relay.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Sequence

SIGTERM_EXIT = 128 + signal.SIGTERM


def relay(cmd: Sequence[str]) -> int:
    """Run ``cmd`` to its end; its exit code, or 143 if it failed after this process got SIGTERM."""
    proc = subprocess.Popen(list(cmd))
    stopped = False

    def forward(signum: int, _frame: object) -> None:
        nonlocal stopped
        stopped = stopped or signum == signal.SIGTERM
        proc.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    code = proc.wait()
    return SIGTERM_EXIT if stopped and code != 0 else code


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python -m kuberl.util.relay CMD [ARG ...]")
    sys.exit(relay(sys.argv[1:]))
