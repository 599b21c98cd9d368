"""The one error a cluster command ends with: its message names what to install or fix."""

from __future__ import annotations


class ClusterError(RuntimeError):
    """The control plane could not be built, started or stopped; the message says what to do."""
