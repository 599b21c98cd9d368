"""The zygote's trimmed after-fork hooks (sandbox/process/forkhooks.py), in a fresh interpreter each:
the hook list is the interpreter's own and these tests change it."""

from __future__ import annotations

import json
import subprocess
import sys

FORKS = """
import json, os, random, resource, sys, threading
from kuberl.sandbox.process.forkhooks import ForkHooks

def forks(n, restore=None):
    out = []
    for _ in range(n):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            if restore is not None:
                restore.restore()
            os.write(w, json.dumps([faults, random.random(), threading.active_count()]).encode())
            os._exit(0)
        os.close(w)
        out.append(json.loads(os.read(r, 1000)))
        os.close(r)
        os.waitpid(pid, 0)
    return out
"""


def _run(body: str) -> dict:
    done = subprocess.run([sys.executable, "-c", FORKS + body], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_trimmed_hooks_reseed_random_skip_threadings_and_cost_fewer_faults():
    out = _run(
        "full = forks(3)\n"
        "hooks = ForkHooks.trim()\n"
        "lean = forks(3, hooks)\n"
        "names = [f'{type(h).__name__} {h.__qualname__}' for h in hooks.lean]\n"
        "print(json.dumps({'full': full, 'lean': lean, 'names': names, 'parent': random.random()}))\n"
    )
    # random's reseeding as the C method; threading's hook is gone
    assert out["names"] == ["builtin_function_or_method Random.seed"]
    draws = [r[1] for r in out["full"] + out["lean"]] + [out["parent"]]
    assert len(set(draws)) == len(draws)  # every child reseeded, none repeats the parent
    assert all(r[2] == 1 for r in out["lean"])
    # a count, not a time: threading's hook alone runs Python over its registry in every child
    assert max(r[0] for r in out["lean"]) < min(r[0] for r in out["full"]) - 40, out


def test_a_child_that_restored_the_hooks_forks_as_python_does():
    """After restore(), the child's own fork runs threading's hook again: in the grandchild a
    thread started before the fork is known to be gone."""
    out = _run(
        "hooks = ForkHooks.trim()\n"
        "r, w = os.pipe()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    hooks.restore()\n"
        "    stop = threading.Event()\n"
        "    t = threading.Thread(target=stop.wait); t.start()\n"
        "    if os.fork() == 0:\n"
        "        os.write(w, json.dumps([threading.active_count(), t.is_alive()]).encode()); os._exit(0)\n"
        "    os.wait(); stop.set(); t.join(); os._exit(0)\n"
        "os.close(w); print(json.dumps({'grandchild': json.loads(os.read(r, 100))})); os.waitpid(pid, 0)\n"
    )
    assert out["grandchild"] == [1, False]


def test_no_trim_while_another_thread_runs():
    out = _run(
        "stop = threading.Event()\n"
        "t = threading.Thread(target=stop.wait); t.start()\n"
        "from kuberl.sandbox.process.forkhooks import _hook_list\n"
        "before = len(_hook_list())\n"
        "trimmed = ForkHooks.trim()\n"
        "after = len(_hook_list())\n"
        "stop.set(); t.join()\n"
        "print(json.dumps({'trimmed': trimmed is not None, 'before': before, 'after': after}))\n"
    )
    assert out == {"trimmed": False, "before": 2, "after": 2}
