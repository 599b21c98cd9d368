"""The sandbox's process tree: the workers the service starts and the calls they fork.

- ``worker``: a warm fork-server per core (``python -m kuberl.sandbox.process.worker``).
- ``zygote``: forked from a worker, preloads and freezes numpy, sympy, scipy and math-verify
  (full) or the standard library only (light); ``routing`` picks one per call.
- ``calls``: a call's parent side (fork ahead, hand over, watch, answer); ``child``: its forked
  side, up to the result; ``forkhooks``: the child's interpreter hooks.
"""
