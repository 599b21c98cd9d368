"""kuberl.util.lifetime: what a process starts ends with it, even a server that ignores its SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from kuberl.util.lifetime import start_time

# A parent that starts a server ignoring SIGTERM (in its own session, with a child of its own),
# tied to itself and watched with a grace period, prints their pids, then waits to be killed.
PARENT = textwrap.dedent(
    """
    import subprocess, sys, time
    from kuberl.util.lifetime import reap_on_exit, tied_to_this_process
    stubborn = "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); " \\
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); print(c.pid, flush=True); time.sleep(600)"
    server = subprocess.Popen(tied_to_this_process([sys.executable, "-c", stubborn]), stdout=subprocess.PIPE,
                              text=True, start_new_session=True)
    child = server.stdout.readline().strip()
    reap_on_exit([server.pid], grace_s=float(sys.argv[1]), groups=True)
    print(server.pid, child, flush=True)
    time.sleep(600)
    """
)


def _alive(pid: int) -> bool:
    return start_time(pid) is not None and open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"


def test_a_server_that_ignores_sigterm_goes_with_its_group_after_the_grace_period():
    parent = subprocess.Popen([sys.executable, "-c", PARENT, "1.5"], stdout=subprocess.PIPE, text=True)
    try:
        server, child = (int(x) for x in parent.stdout.readline().split())
        time.sleep(0.5)  # the watchdog is up
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        time.sleep(0.7)
        assert _alive(server) and _alive(child), "the grace period: SIGTERM was sent, nothing killed yet"
        deadline = time.monotonic() + 10
        while (_alive(server) or _alive(child)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(server) and not _alive(child), "the server's whole group is killed after it"
    finally:
        parent.kill()
