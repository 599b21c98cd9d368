"""The light zygote (sandbox/process/routing.py): which zygote forks a call, and a lost zygote costs no call."""

from __future__ import annotations

import contextlib
import os
import signal

import pytest

from kuberl.sandbox.containment.slot import Slot
from kuberl.sandbox.process.calls import run_call
from kuberl.sandbox.process.routing import Zygotes, zygote_for
from kuberl.sandbox.process.worker import preload_light
from kuberl.sandbox.process.zygote import Zygote, ZygoteGone

pytestmark = pytest.mark.slot_config(pool="routing", memory_mb=1024)


def _exec(code: str) -> dict:
    return {"op": "exec", "code": code, "stdin": "", "timeout": 30.0}


LIGHT = {
    "arithmetic": "print(2 + 3)",
    "expression": "sum(i * i for i in range(10))",
    "stdlib": "import math, itertools\nfrom fractions import Fraction\nprint(math.comb(10, 3), Fraction(1, 3))",
    "aliases": "import collections.abc as cabc, re\nfrom decimal import (Decimal,\n  getcontext)\nprint(Decimal(1))",
    "stdin": "n = int(input())\nprint(n * 2)",
    "empty": "",
    "strings_that_look_alike": "print('numbers', 'scalar', 'import_it')",
}

FULL = {
    "import_numpy": "import numpy as np\nprint(np.arange(3))",
    "from_scipy": "from scipy.special import comb\nprint(comb(5, 2))",
    "import_sympy_later": "import math\nx = 1\nimport sympy",
    "submodule": "import numpy.linalg",
    "in_a_list": "import os, sympy",
    "math_verify": "from math_verify import parse",
    "mpmath": "import mpmath",
    "uppercase": "import NumPy",
    "third_party": "import pandas as pd",
    "unknown_module": "import networkx",
    "dunder_import": "m = __import__('num' + 'py')",
    "importlib": "import importlib\nm = importlib.import_module('sym' + 'py')",
    "from_importlib": "from importlib import import_module",
    "exec_string": "exec('import ' + 'nu' + 'mpy')",
    "eval_string": 'eval("__imp" + "ort__(\'sympy\')")',
    "compile": "c = compile('import os', 'x', 'exec')",
    "getattr_builtins": "import builtins\nf = getattr(builtins, '__imp' + 'ort__')",
    "dunder_builtins": "f = __builtins__.__dict__['__imp' + 'ort__']",
    "sys_modules": "import sys\nprint(sys.modules)",
    "globals": "g = globals()['__builtins__']",
    "vars": "v = vars(object)",
    "subclasses": "().__class__.__base__.__subclasses__()",
    "fn_globals": "f = (lambda: 0).__globals__",
    "attrgetter": "from operator import attrgetter\nattrgetter('x')",
    "methodcaller": "import operator\noperator.methodcaller('x')",
    "pickle": "import pickle\npickle.loads(b'')",
    "marshal": "import marshal",
    "runpy": "import runpy",
    "pkgutil": "import pkgutil",
    "pydoc_locate": "from pydoc import locate",
    "help": "help('mod' + 'ules')",
    "breakpoint": "breakpoint()",
    "timeit": "import timeit\ntimeit.timeit('1')",
    "ctypes": "import ctypes",
    "logging_config": "import logging.config",
    "unittest_mock": "from unittest import mock",
    "get_type_hints": "import typing\ntyping.get_type_hints(object)",
    "fullwidth_exec": "\uff45\uff58\uff45\uff43('import os')",  # NFKC: exec
    "fullwidth_module": "import \uff4e\uff55\uff4d\uff50\uff59",  # NFKC: numpy
    "line_continuation": "import \\\nnumpy",
    "from_continuation": "from \\\nscipy import special",
    "semicolon": "x = 1; import sympy",
    "tab": "import\tsympy",
    "code_module": "import code",
}


@pytest.mark.parametrize("name", sorted(LIGHT))
def test_plain_standard_library_code_goes_to_the_light_zygote(name):
    assert zygote_for(_exec(LIGHT[name])) == "light"


@pytest.mark.parametrize("name", sorted(FULL))
def test_code_that_names_or_could_reach_a_heavy_library_goes_to_the_full_zygote(name):
    assert zygote_for(_exec(FULL[name])) == "full"


@pytest.mark.parametrize(
    "req",
    [
        {"op": "verify", "prediction": "1", "gold": "1", "timeout": 5.0},
        {"op": "verify", "code": "print(1)"},  # even if it carried light code
        {"op": "exec"},
        {"op": "exec", "code": None},
        {"op": "exec", "code": b"print(1)"},
        {"code": "print(1)"},
        None,
        "print(1)",
    ],
)
def test_verifications_and_malformed_requests_go_to_the_full_zygote(req):
    assert zygote_for(req) == "full"


# ---- the pair of zygotes -------------------------------------------------------------------------

# the full zygote's witness: the code below is written to pass the scan (no heavy name, no
# "sys.modules"), so that it lands on the zygote asked for
WITNESS = "import sys\ntable = sys\nprint(sum(k.endswith('_multiarray_umath') for k in table.modules))"


def _full_preload() -> None:
    preload_light()
    import numpy  # noqa: F401


@pytest.fixture
def zygotes(slot):
    full = Zygote.start(slot, slot.cfg, close=(), preload=_full_preload)
    light = Zygote.start(slot, slot.cfg, close=(full.sock.fileno(),), preload=preload_light)
    pair = Zygotes(full, light)
    slot.keep_alive = frozenset(pair.pids)
    yield pair
    pair.close()


def _call(slot: Slot, pair: Zygotes, code: str, kind: str) -> dict:
    prepared = pair.take(slot, kind)
    result = run_call(slot, slot.cfg, prepared, _exec(code))
    with contextlib.suppress(ChildProcessError):  # run_call reaps it if it saw the exit
        os.waitpid(prepared.pid, 0)
    slot.after_call()
    return result


def _numpy_preloaded_in_the_test_process() -> bool:
    import sys

    return any(k.endswith("_multiarray_umath") for k in sys.modules)


def test_each_kind_forks_from_its_own_zygote_and_the_light_one_imports_cold(slot, zygotes):
    """A light child starts without numpy (forked from an image that never loaded it), yet a
    call routed there that imports numpy still works: it merely imports it cold."""
    if _numpy_preloaded_in_the_test_process():
        # every zygote forked from this process would hold numpy: the same test, in a fresh one
        import subprocess
        import sys

        test = f"{__file__}::test_each_kind_forks_from_its_own_zygote_and_the_light_one_imports_cold"
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", test],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        # rc 0 (rc 5: no test collected); -rs names a skip, which a fresh process must not take
        assert proc.returncode == 0 and "SKIPPED" not in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]
        return
    assert zygote_for(_exec(WITNESS)) == "light"
    assert set(zygotes.pids) == {zygotes.full.pid, zygotes.light.pid} and set(zygotes.pids) <= slot.protected
    full = _call(slot, zygotes, WITNESS, "full")
    light = _call(slot, zygotes, WITNESS, "light")
    assert (full["meta"]["status"], full["stdout"]) == ("ok", "1\n"), full
    assert (light["meta"]["status"], light["stdout"]) == ("ok", "0\n"), light
    cold = _call(slot, zygotes, "import numpy\nprint(numpy.arange(4).sum())\n" + WITNESS, "light")
    assert (cold["meta"]["status"], cold["stdout"]) == ("ok", "6\n1\n"), cold


@pytest.mark.parametrize("lost", ["light", "full"])
def test_a_lost_zygote_costs_no_call_the_other_forks_every_kind(slot, zygotes, lost):
    gone = zygotes.light if lost == "light" else zygotes.full
    zygotes.ask(slot)  # children forked ahead by both, as in the worker
    os.kill(gone.pid, signal.SIGKILL)
    for kind in ("light", "full", "light", "full"):
        r = _call(slot, zygotes, "import math\nprint(math.factorial(5))", kind)
        assert (r["meta"]["status"], r["stdout"]) == ("ok", "120\n"), (kind, r)
        zygotes.ask(slot)
    assert zygotes.pids == tuple(z.pid for z in (zygotes.full, zygotes.light) if z is not None)
    assert gone.pid not in zygotes.pids and len(zygotes.pids) == 1


def test_with_both_zygotes_gone_the_worker_is_told(slot, zygotes):
    for z in (zygotes.full, zygotes.light):
        os.kill(z.pid, signal.SIGKILL)
    with pytest.raises(ZygoteGone):
        zygotes.take(slot, "light")


def _alive_process(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:  # gone: ENOENT, or ESRCH while it is being reaped
        return False


def test_the_other_zygotes_child_forked_ahead_survives_a_calls_cleanup(slot, zygotes):
    """Without a pids cgroup (basic isolation) the worker clears the slot by killing every
    child of its own but the ones it keeps: the child the other zygote forked ahead is kept,
    so the next call of that kind does not wait for a fork."""
    assert not slot.cgroup.pids
    zygotes.ask(slot)
    r = _call(slot, zygotes, "print(1)", "light")
    assert r["stdout"] == "1\n", r
    waiting = zygotes.full.ready
    assert waiting is not None and _alive_process(waiting.pid)
    prepared = zygotes.take(slot, "full")
    assert prepared.pid == waiting.pid
    result = run_call(slot, slot.cfg, prepared, _exec("print(2)"))
    with contextlib.suppress(ChildProcessError):  # run_call reaps it if it saw the exit
        os.waitpid(prepared.pid, 0)
    assert result["stdout"] == "2\n", result


def test_a_child_forked_ahead_that_died_while_it_waited_is_replaced_before_it_is_needed(slot, zygotes):
    """Another call of the same uid (basic isolation) can kill a child waiting for its call: the
    worker's next ask replaces it, so no call is handed a dead child."""
    zygotes.ask(slot)
    _call(slot, zygotes, "print(1)", "light")  # the full zygote's child is received, waits on
    dead = zygotes.full.ready
    assert dead is not None
    os.kill(dead.pid, signal.SIGKILL)
    os.waitpid(dead.pid, 0)  # as the slot's sweep would (it reaps every zombie)
    zygotes.ask(slot)
    prepared = zygotes.take(slot, "full")
    assert prepared.pid != dead.pid
    result = run_call(slot, slot.cfg, prepared, _exec("print(2)"))
    with contextlib.suppress(ChildProcessError):  # run_call reaps it if it saw the exit
        os.waitpid(prepared.pid, 0)
    assert result["stdout"] == "2\n", result
