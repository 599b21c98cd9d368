"""What contains a call: each mechanism in a module of its own.

- ``slot``: a worker's cgroup, uid, scratch space, filesystem view and filter together.
- ``fsview``: the filesystem and environment a call sees; ``landlock``: its writes (and reads)
  confined; ``seccomp``: its syscall filter; ``cgroups``: memory, pids and CPU limits.
- ``procs``: finding and killing what a call left running; ``kfiles``: the small /proc and
  cgroupfs files they read and write.
"""
