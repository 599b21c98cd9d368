"""sandbox/containment/kfiles.py: raw reads and writes behave as open() did for the worker's files."""

from __future__ import annotations

import os

import pytest

from kuberl.sandbox.containment.kfiles import read_bytes, write_text


def test_read_bytes_reads_a_whole_file_of_any_size(tmp_path):
    big = os.urandom(200_000)  # several reads' worth
    (tmp_path / "big").write_bytes(big)
    assert read_bytes(str(tmp_path / "big")) == big
    assert read_bytes("/proc/self/status").startswith(b"Name:")
    with pytest.raises(FileNotFoundError):
        read_bytes(str(tmp_path / "missing"))


def test_write_text_creates_and_truncates_like_open_w(tmp_path):
    path = tmp_path / "pids.max"
    write_text(str(path), "32768")
    write_text(str(path), "16")  # a shorter value leaves nothing of the longer one behind
    assert path.read_text() == "16"
    with pytest.raises(IsADirectoryError):
        write_text(str(tmp_path), "1")
