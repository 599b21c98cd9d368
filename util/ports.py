"""A free TCP port to hand to a server that binds it later (a vLLM subprocess, kopf's health
endpoint, a test's Prometheus).

``bind(("127.0.0.1", 0))`` and closing returns a port from the kernel's ephemeral range, the same
range every outgoing connection's local port comes from. Between that close and the server's own
bind, any connect() on the machine may take the port, and the server's bind fails with EADDRINUSE
while many clients are connecting. A port picked outside that range is
only taken by another explicit bind, so the window is closed for the common case; the bind check
still rules out a port that is in use now.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10000  # below this: well-known and commonly configured service ports


def ephemeral_range(path: Path = _EPHEMERAL) -> tuple[int, int]:
    """The kernel's range for connections' local ports (Linux's default where unreadable)."""
    try:
        low, high = (int(p) for p in path.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def candidate_ports(ephemeral: tuple[int, int]) -> list[int]:
    """Unprivileged ports outside ``ephemeral``, at or above 10000 where the range leaves any."""
    low, high = ephemeral
    ports = [p for p in range(_LOWEST, 65536) if not low <= p <= high]
    return ports or [p for p in range(1024, 65536) if not low <= p <= high]


def free_port(host: str = "127.0.0.1", *, attempts: int = 200) -> int:
    """A port on ``host`` that nothing listens on now and that no outgoing connection will take
    before a server binds it. Raises OSError naming the host when ``attempts`` picks were all busy."""
    ports = candidate_ports(ephemeral_range())
    if not ports:  # the whole port space is ephemeral: only the kernel's pick is left
        with socket.socket() as s:
            s.bind((host, 0))
            return int(s.getsockname()[1])
    for port in random.sample(ports, min(attempts, len(ports))):
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise OSError(f"no free TCP port on {host} outside the ephemeral range after {attempts} tries")
