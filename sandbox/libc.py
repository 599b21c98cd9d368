"""The C library, loaded once per process and shared by every module of the sandbox.

Loaded at import, in the worker and the zygotes: a forked child finds every handle ready, and
building one (or looking a function up for the first time) in the child costs the call page
faults.
"""

from __future__ import annotations

import ctypes

LIBC = ctypes.CDLL(None, use_errno=True)
LIBC.syscall.restype = ctypes.c_long
# PyDLL: the GIL stays held across the call, as os.fork holds it across fork() (the zygote's clone)
PYAPI = ctypes.PyDLL(None, use_errno=True)
PYAPI.syscall.restype = ctypes.c_long
