"""kuberl.util.ports: a port handed to a server that binds it later is one no outgoing connection takes."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from kuberl.util import ports


def test_the_port_is_free_and_outside_the_kernels_ephemeral_range() -> None:
    low, high = ports.ephemeral_range()
    for _ in range(20):
        port = ports.free_port()
        assert not low <= port <= high
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # nothing holds it


def test_a_busy_port_is_passed_over(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        taken = busy.getsockname()[1]
        others = [p for p in range(20000, 20100) if p != taken]
        monkeypatch.setattr(ports, "candidate_ports", lambda _: [taken] * 50 + others)
        monkeypatch.setattr(ports.random, "sample", lambda seq, k: list(seq)[:k])
        assert ports.free_port() != taken


def test_all_candidates_busy_is_an_error_naming_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        monkeypatch.setattr(ports, "candidate_ports", lambda _: [busy.getsockname()[1]] * 5)
        with pytest.raises(OSError, match="127.0.0.1"):
            ports.free_port(attempts=5)


def test_ranges(tmp_path: Path) -> None:
    (tmp_path / "r").write_text("40000\t60999\n")
    assert ports.ephemeral_range(tmp_path / "r") == (40000, 60999)
    assert ports.ephemeral_range(tmp_path / "missing") == (32768, 60999)
    cands = ports.candidate_ports((32768, 60999))
    assert min(cands) == 10000 and 32768 not in cands and 61000 in cands and 65535 in cands
    assert min(ports.candidate_ports((10000, 65535))) == 1024  # nothing above 10000 is left


def test_a_wholly_ephemeral_port_space_falls_back_to_the_kernels_pick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (1, 65535))
    assert 0 < ports.free_port() < 65536
