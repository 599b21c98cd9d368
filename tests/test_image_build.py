"""kuberl's images built here for real (buildah on a debootstrap base, no registry) and the sandbox
image run as its SandboxPool pod runs, under a containerd of the test's own.

Marker ``images``; without root, buildah, debootstrap, runc or containerd the tests skip with the
reason, except where ``KUBERL_REQUIRE_IMAGES=1`` (CI), where they fail. The image store is the
builder's cache ($KUBERL_IMAGES_CACHE, default ~/.cache/kuberl/images): a warm CI run reuses it.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from image_context import copy_context

from kuberl.api.sandbox_pool import SandboxPool
from kuberl.cluster.errors import ClusterError
from kuberl.cluster.image_build import (
    Buildah,
    Built,
    build_image,
    cache_dir,
    chain_id,
    containerd_image_id,
    default_base,
    ensure_base,
    load_into,
    require_tools,
    unpacked,
)
from kuberl.cluster.images import (
    IMAGES,
    INPUTS_LABEL,
    image_inputs_digest,
)
from kuberl.operator.render.builders import build_sandbox_pool

pytestmark = [pytest.mark.images, pytest.mark.timeout(3600)]
ROOT = Path(__file__).resolve().parent.parent
# what the sandbox reports inside a pod under containerd's default seccomp profile, uid 65532 and
# no capabilities (docs/sandbox.md's table): its own layers, nothing that needs a namespace or root
POD_LAYERS = {"seccomp", "landlock", "rlimits", "pids", "fs_view", "setsid", "env_allowlist"}
POD_ABSENT = {"uid", "cgroup_memory", "cgroup_pids", "cgroup_cpu", "namespaces", "private_root"}


def _require() -> None:
    try:
        require_tools(("buildah", "debootstrap", "runc", "ctr", "containerd"))
    except ClusterError as err:
        reason = f"cannot build images here: {err}"
        if os.environ.get("KUBERL_REQUIRE_IMAGES") == "1":
            pytest.fail(f"KUBERL_REQUIRE_IMAGES=1 but {reason}")
        pytest.skip(reason)


@pytest.fixture(scope="module")
def store() -> Buildah:
    _require()
    return Buildah(cache_dir())


@pytest.fixture(scope="module")
def built(store: Buildah) -> dict[str, Built]:
    recipe = default_base()
    out = {"base": ensure_base(store, recipe, log=print)}
    for name in ("sandbox", "operator"):
        out[name] = build_image(store, IMAGES[name], ROOT, recipe, log=print)
    print({k: (b.cached, round(b.seconds, 1)) for k, b in out.items()})
    return out


def test_the_sandbox_and_operator_images_build(store, built):
    recipe = default_base()
    for name in ("sandbox", "operator"):
        spec = IMAGES[name]
        found = store.inspect(built[name].image_id)  # by id: a checkout sharing the store may retag
        assert found is not None and built[name].ref == spec.ref
        config = found["Docker"]["config"]
        assert config["Labels"][INPUTS_LABEL] == image_inputs_digest(ROOT, spec, recipe)
        assert config["User"] == "65532:65532"
        assert "PATH=/opt/kuberl/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" in config["Env"]
    sandbox, operator = (store.inspect(built[n].image_id)["Docker"]["config"] for n in ("sandbox", "operator"))
    assert sandbox["Entrypoint"] == ["kuberl", "sandbox", "serve"]
    assert operator["Cmd"] == ["operator", "--all-namespaces"]
    assert store.label(built["base"].ref) == recipe.digest()


def test_a_second_build_is_a_cache_hit(store, built):
    recipe = default_base()
    t0 = time.monotonic()
    again = [build_image(store, IMAGES[n], ROOT, recipe) for n in ("sandbox", "operator")]
    seconds = time.monotonic() - t0
    print(f"warm build of sandbox + operator: {seconds:.1f} s")
    assert all(b.cached for b in again) and seconds < 30
    assert [b.image_id for b in again] == [built["sandbox"].image_id, built["operator"].image_id]
    assert ensure_base(store, recipe).cached


def test_a_changed_source_file_rebuilds_only_the_layers_after_the_dependencies(store, built, tmp_path):
    spec = IMAGES["sandbox"]
    copy_context(ROOT, tmp_path, spec.dockerfile)
    changed = tmp_path / "sandbox" / "__init__.py"
    changed.write_text(changed.read_text() + f"\n# changed by the images test at {time.time()}\n")
    ref = "localhost/kuberl-test/sandbox:changed"
    try:
        rebuilt = build_image(store, spec, tmp_path, default_base(), ref=ref)
        print(f"rebuild after a source change: {rebuilt.seconds:.1f} s")
        assert not rebuilt.cached
        log = rebuilt.log.read_text().splitlines()
        steps = {line.split(":", 1)[1].split()[0] + " " + line.split(":", 1)[1].split()[1]: log[i + 1]
                 for i, line in enumerate(log[:-1]) if line.startswith("STEP ")}
        cached = {step for step, after in steps.items() if after.startswith("--> Using cache")}
        assert {"RUN python3", "COPY pyproject.toml", "COPY operator/"} <= cached, steps
        assert not {"COPY sandbox/", "COPY cluster/", "RUN pip"} & cached, steps
        # by id: another checkout sharing the store may have retagged spec.ref meanwhile
        old, new = store.layers(built["sandbox"].image_id), store.layers(rebuilt.image_id)
        base_layers = len(store.layers(built["base"].ref))
        common = next((i for i, (a, b) in enumerate(zip(old, new, strict=False)) if a != b), len(old))
        # base, the dependencies and the COPYs before sandbox/ are kept; sandbox/ and what follows
        # (the other folders' COPYs, the `pip install --no-deps .` layer) are new
        assert common >= base_layers + 2 and new[-1] != old[-1], (base_layers, common, len(new))
        assert len(new) == len(old)
    finally:
        subprocess.run(store.cmd("rmi", ref), capture_output=True, timeout=300)


@pytest.fixture(scope="module")
def containerd(store, built):
    from private_containerd import private_containerd

    with private_containerd() as ctd:
        yield ctd


def test_loading_into_containerd_is_skipped_when_it_has_the_image(store, built, containerd):
    ref, image_id = IMAGES["sandbox"].ref, built["sandbox"].image_id
    t0 = time.monotonic()
    assert load_into(store, ref, containerd.address, containerd.namespace, image_id=image_id) is True
    first = time.monotonic() - t0
    assert containerd_image_id(containerd.address, containerd.namespace, ref) == image_id
    t0 = time.monotonic()
    assert load_into(store, ref, containerd.address, containerd.namespace, image_id=image_id) is False
    print(f"load into containerd: {first:.1f} s, again (skipped) {time.monotonic() - t0:.1f} s")


REPLACED = "localhost/kuberl-test/replaced:1"


def _snapshots(ctd) -> dict[str, str]:
    """Every snapshot in ``ctd``: key -> when it was created (a layer unpacked again gets a new one)."""
    listed = subprocess.run(ctd.ctr("snapshots", "ls"), capture_output=True, text=True, timeout=60).stdout
    return {key: json.loads(subprocess.run(ctd.ctr("snapshots", "info", key), capture_output=True, text=True,
                                           timeout=60).stdout)["Created"]
            for key in (line.split()[0] for line in listed.splitlines()[1:])}


def _collect(ctd) -> None:
    """A garbage collection of ``ctd``, done before this returns (deleting a lease with --sync)."""
    lease = subprocess.run(ctd.ctr("leases", "create"), capture_output=True, text=True, timeout=60).stdout.split()[0]
    subprocess.run(ctd.ctr("leases", "delete", "--sync", lease), check=True, capture_output=True, timeout=120)


@pytest.fixture(scope="module")
def own_containerd(store, built):
    """A containerd holding only what the replacing tests load (no other image shares its layers)."""
    from private_containerd import private_containerd

    with private_containerd() as ctd:
        yield ctd


def test_a_new_image_under_a_loaded_name_keeps_the_layers_both_share(store, built, own_containerd, monkeypatch):
    """kuberl's images keep their names across builds, so a load usually replaces the image a name
    had. ``ctr images import`` moves the name before it unpacks, and containerd collects the
    snapshots no image refers to: here a collection is made to fall in between (the worst moment;
    in a CI run one failed the trainer's import with "parent snapshot ... does not exist"). The
    layers both images share are neither collected nor unpacked again; afterwards the old image's
    own layers are collected and no second name is left."""
    from kuberl.cluster import image_build

    ctd, first, second = own_containerd, built["operator"], built["sandbox"]
    assert load_into(store, REPLACED, ctd.address, ctd.namespace, image_id=first.image_id) is True
    before = _snapshots(ctd)
    chain = [chain_id(store.layers(second.image_id)[: i + 1]) for i in range(len(store.layers(second.image_id)))]
    shared = [key for key in chain if key in before]
    assert shared, "the operator and sandbox images share no layer: nothing here tests the replacement"
    real_run = image_build._run

    def collect_before_the_unpack(cmd: list[str], *args, **kw) -> str:
        if cmd[-3:-1] == ["images", "import"]:
            real_run([*cmd[:-1], "--no-unpack", cmd[-1]])  # the name moves to the new image
            _collect(ctd)
        return real_run(cmd, *args, **kw)

    monkeypatch.setattr(image_build, "_run", collect_before_the_unpack)
    assert load_into(store, REPLACED, ctd.address, ctd.namespace, image_id=second.image_id) is True
    monkeypatch.undo()
    after = _snapshots(ctd)
    assert {key: after.get(key) for key in shared} == {key: before[key] for key in shared}
    assert containerd_image_id(ctd.address, ctd.namespace, REPLACED) == second.image_id
    names = subprocess.run(ctd.ctr("images", "ls", "-q"), capture_output=True, text=True, timeout=60).stdout.split()
    assert names == [REPLACED]
    _collect(ctd)
    assert set(_snapshots(ctd)) == set(chain)


def test_an_image_whose_layers_are_gone_is_loaded_again(store, built, own_containerd):
    """The name and image id alone do not make a load unnecessary: an import that failed part-way
    leaves the new image under its name with its layers not unpacked, and a pod of it cannot start."""
    ctd, image = own_containerd, built["sandbox"]
    load_into(store, REPLACED, ctd.address, ctd.namespace, image_id=image.image_id)
    top = chain_id(store.layers(image.image_id))
    subprocess.run(ctd.ctr("snapshots", "rm", top), check=True, capture_output=True, timeout=60)
    assert not unpacked(ctd.address, ctd.namespace, store.layers(image.image_id))
    assert load_into(store, REPLACED, ctd.address, ctd.namespace, image_id=image.image_id) is True
    assert unpacked(ctd.address, ctd.namespace, store.layers(image.image_id))
    assert load_into(store, REPLACED, ctd.address, ctd.namespace, image_id=image.image_id) is False


def _exec(containerd, task: str, code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    exec_id = f"probe-{time.monotonic_ns()}"
    return subprocess.run(containerd.ctr("tasks", "exec", "--exec-id", exec_id, task, "python", "-c", code),
                          capture_output=True, text=True, timeout=timeout)


_READYZ = ("import urllib.request, urllib.error, sys\n"
           "try:\n r = urllib.request.urlopen('http://127.0.0.1:{port}/readyz', timeout=5)\n"
           "except urllib.error.HTTPError as e:\n r = e\n"
           "sys.stdout.write(str(r.status) + ' ' + r.read().decode())\n")
_EXECUTE = ("import json, urllib.request\n"
            "body = json.dumps({{'id': 'img-1', 'code': 'print(6 * 7)', 'stdin': ''}}).encode()\n"
            "req = urllib.request.Request('http://127.0.0.1:{port}/v1/execute', body, "
            "{{'Content-Type': 'application/json'}})\n"
            "print(urllib.request.urlopen(req, timeout=30).read().decode())\n")
_SELF = ("import os, json\n"
         "status = dict(l.split(':', 1) for l in open('/proc/1/status').read().splitlines() if ':' in l)\n"
         "def writable(p):\n try:\n  open(p, 'w').close(); os.unlink(p); return True\n except OSError:\n  return False\n"
         "print(json.dumps({{k: status[k].strip() for k in ('Uid', 'CapBnd', 'CapEff', 'NoNewPrivs', 'Seccomp')}}"
         " | {{'root_writable': writable('/x'), 'tmp_writable': writable('/tmp/x'), "
         "'work_writable': writable('/work/x')}}))\n")


def test_the_sandbox_image_serves_as_its_pod_runs_it(store, built, containerd, tmp_path):
    from private_containerd import ctr_run_args

    ref = IMAGES["sandbox"].ref
    load_into(store, ref, containerd.address, containerd.namespace, image_id=built["sandbox"].image_id)
    pool = SandboxPool.model_validate({"metadata": {"name": "img"}, "spec": {"workersPerPod": 2}})
    deploy = next(m for m in build_sandbox_pool(pool) if m["kind"] == "Deployment")
    pod = deploy["spec"]["template"]["spec"]
    container = pod["containers"][0]
    port = container["ports"][0]["containerPort"]
    flags = ctr_run_args(container, pod["securityContext"], pod["volumes"],
                         store.inspect(built["sandbox"].image_id)["Docker"]["config"]["User"])
    task = "sandbox-img"
    log = tmp_path / "sandbox.log"
    run = subprocess.run(containerd.ctr("run", "-d", "--log-uri", f"file://{log}", *flags, ref, task,
                                        *container["command"], *container["args"]),
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    t0 = time.monotonic()
    status, ready = 0, {}
    while time.monotonic() - t0 < 120:
        res = _exec(containerd, task, _READYZ.format(port=port))
        if res.returncode == 0 and res.stdout.startswith("200 "):
            status, ready = 200, json.loads(res.stdout[4:])
            break
        time.sleep(1)
    log_text = log.read_text() if log.exists() else ""
    assert status == 200, f"/readyz never said 200: {res.stdout} {res.stderr}\n{log_text[-3000:]}"
    print(f"ready in {time.monotonic() - t0:.1f} s; /readyz protections: {json.dumps(ready['protections'])}")
    (store.cache / "logs" / "sandbox-readyz.json").write_text(json.dumps(ready, indent=1))
    assert ready["workers_up"] == 2 and ready["isolation"] in ("basic", "auto", "full")
    active = {k for k, v in ready["protections"].items() if v}
    assert POD_LAYERS <= active and not (POD_ABSENT & active), ready["protections"]

    answer = _exec(containerd, task, _EXECUTE.format(port=port))
    assert answer.returncode == 0, answer.stderr
    result = json.loads(answer.stdout)
    assert (result["outcome"], result["output"].strip()) == ("stdout", "42"), result

    facts = json.loads(_exec(containerd, task, _SELF.format()).stdout)
    print(f"the server process: {facts}")
    assert facts["Uid"].split()[:2] == ["65532", "65532"]
    assert int(facts["CapBnd"], 16) == 0 and int(facts["CapEff"], 16) == 0
    assert facts["NoNewPrivs"] == "1" and facts["Seccomp"] == "2"  # 2: a filter (the default profile)
    assert facts["root_writable"] is False and facts["tmp_writable"] is True and facts["work_writable"] is True
