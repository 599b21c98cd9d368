"""The shared-memory weight handoff without a server: the raw weights format both sides read
(trainer/shm_weights.py writes, rollout/vllm_shm.py reads), slot turns, the refusals, where the
slots go, the plugin's installation into a vLLM environment and the server flag.
The real server's side is tests/test_vllm_real.py (a push through it changes what it samples)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest
import torch

from kuberl.rollout import vllm_env
from kuberl.rollout.vllm_server import SHM_BACKEND, VLLMServerConfig
from kuberl.rollout.vllm_shm import (
    ALIGN,
    MANIFEST,
    RawWeightsError,
    is_raw_folder,
    iter_weights,
    read_manifest,
)
from kuberl.trainer import shm_weights
from kuberl.trainer.shm_weights import SharedMemorySlots, remove_orphans, shm_root


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(7, 5, generator=g),
        "model.layers.0.mlp.up_proj.weight": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "model.norm.weight": torch.randn(5, generator=g).to(torch.float16),
        "model.rotary.inv_freq": torch.arange(3, dtype=torch.int64),
        "scalar": torch.tensor(2.5),
    }


def test_a_published_version_reads_back_bit_for_bit_in_order(tmp_path):
    slots = SharedMemorySlots(tmp_path / "w")
    sent = _tensors(0)
    path = slots.publish(sent, 7)
    assert is_raw_folder(path)
    doc = read_manifest(path, 7)
    assert [t["offset"] % ALIGN for t in doc["tensors"]] == [0] * len(sent)
    got = list(iter_weights(path, 7))
    assert [n for n, _ in got] == list(sent)
    for (name, t), want in zip(got, sent.values(), strict=True):
        assert t.dtype == want.dtype and t.shape == want.shape, name
        assert torch.equal(t, want), name


def test_versions_take_the_slots_in_turn_and_a_rewritten_slot_is_refused(tmp_path):
    slots = SharedMemorySlots(tmp_path / "w")
    p1 = slots.publish(_tensors(1), 1)
    p2 = slots.publish(_tensors(2), 2)
    assert p1 != p2 and slots.current == p2
    # version 1 stays whole while version 2 is written: an engine joining then loads it
    assert torch.equal(dict(iter_weights(p1, 1))["model.embed_tokens.weight"], _tensors(1)["model.embed_tokens.weight"])
    p3 = slots.publish(_tensors(3), 3)
    assert p3 == p1
    with pytest.raises(RawWeightsError, match="holds version 3, not 1: it was overwritten"):
        list(iter_weights(p1, 1))
    assert torch.equal(dict(iter_weights(p3, 3))["model.norm.weight"], _tensors(3)["model.norm.weight"])


def test_a_slot_being_rewritten_has_no_manifest_and_a_reader_says_so(tmp_path, monkeypatch):
    slots = SharedMemorySlots(tmp_path / "w")
    first = slots.publish(_tensors(1), 1)
    slots.publish(_tensors(2), 2)
    seen = {}
    real = SharedMemorySlots._mapping

    def spy(self, index, size):  # the moment the data is about to change
        seen["manifest"] = (Path(first) / MANIFEST).exists()
        with pytest.raises(RawWeightsError, match="no manifest.json: no complete version"):
            read_manifest(first)
        return real(self, index, size)

    monkeypatch.setattr(SharedMemorySlots, "_mapping", spy)
    slots.publish(_tensors(3), 3)
    assert seen == {"manifest": False}


def test_a_model_of_another_size_remaps_its_slot(tmp_path):
    slots = SharedMemorySlots(tmp_path / "w")
    slots.publish(_tensors(1), 1)
    slots.publish(_tensors(2), 2)
    bigger = {"w": torch.randn(100, 100)}
    path = slots.publish(bigger, 3)
    assert torch.equal(dict(iter_weights(path, 3))["w"], bigger["w"])
    assert read_manifest(path)["bytes"] == 100 * 100 * 4


def test_manifests_that_cannot_be_loaded_are_refused_naming_why(tmp_path):
    slots = SharedMemorySlots(tmp_path / "w")
    path = Path(slots.publish(_tensors(1), 1))
    doc = json.loads((path / MANIFEST).read_text())
    (path / MANIFEST).write_text("{")
    with pytest.raises(RawWeightsError, match="is not JSON"):
        read_manifest(path)
    (path / MANIFEST).write_text(json.dumps({**doc, "format": "other/9"}))
    with pytest.raises(RawWeightsError, match="not a kuberl-raw-weights/1 manifest"):
        read_manifest(path)
    (path / MANIFEST).write_text(json.dumps({**doc, "bytes": doc["bytes"] * 10}))
    with pytest.raises(RawWeightsError, match="the manifest says"):
        read_manifest(path)
    bad = [{**doc["tensors"][0], "dtype": "complex64"}]
    (path / MANIFEST).write_text(json.dumps({**doc, "tensors": bad}))
    with pytest.raises(RawWeightsError, match="unknown dtype complex64"):
        read_manifest(path)
    past = [{**doc["tensors"][0], "offset": doc["bytes"] - 4}]
    (path / MANIFEST).write_text(json.dumps({**doc, "tensors": past}))
    with pytest.raises(RawWeightsError, match="runs past the end"):
        list(iter_weights(path))


def test_close_removes_the_slots(tmp_path):
    slots = SharedMemorySlots(tmp_path / "w")
    slots.publish(_tensors(1), 1)
    slots.close()
    assert not (tmp_path / "w").exists() and slots.current is None


def test_slots_go_to_shared_memory_only_where_two_fit(tmp_path, monkeypatch):
    root = shm_root("job", 1000, base=tmp_path)
    assert root is not None and root.parent == tmp_path and root.name.endswith(f"-{shm_weights.owner_id(os.getpid())}")
    free = 2 * 1000 * shm_weights.HEADROOM
    monkeypatch.setattr(shm_weights.shutil, "disk_usage", lambda _: type("U", (), {"free": free - 1})())
    assert shm_root("job", 1000, base=tmp_path) is None
    assert shm_root("job", 1000, base=tmp_path / "absent") is None


def test_slots_left_by_a_dead_run_are_removed_and_live_ones_kept(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone = tmp_path / f"{shm_weights.PREFIX}job-0-{int(dead.stdout)}.1"
    mine = tmp_path / f"{shm_weights.PREFIX}job-0-{shm_weights.owner_id(os.getpid())}"
    # the pid of a live process that did not make it: the kernel reused a dead run's pid
    start = int(shm_weights.owner_id(os.getpid()).split(".")[1])
    reused = tmp_path / f"{shm_weights.PREFIX}job-0-{os.getpid()}.{start + 1}"
    for d in (gone, mine, reused):
        (d / "slot0").mkdir(parents=True)
    assert sorted(remove_orphans(tmp_path)) == sorted([gone, reused])
    assert not gone.exists() and not reused.exists() and mine.exists()


def test_a_process_is_told_from_a_later_one_with_its_pid_by_its_start_time():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        mine, theirs = shm_weights.owner_id(os.getpid()), shm_weights.owner_id(child.pid)
        assert mine.split(".")[0] == str(os.getpid()) and theirs.split(".")[0] == str(child.pid)
        assert int(theirs.split(".")[1]) >= int(mine.split(".")[1])  # started after this process
        assert shm_weights.owner_id(os.getpid()) == mine  # the same process: the same id
    finally:
        child.kill()
        child.wait()
    assert shm_weights.owner_id(child.pid) is None


def test_the_plugin_installs_into_a_vllm_environment_with_its_entry_point(tmp_path):
    env = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env)
    py = str(env / "bin" / "python")
    assert vllm_env.install_plugin(py) is True
    assert vllm_env.install_plugin(py) is False  # already there: nothing written
    listing = (
        "import importlib.metadata as m; "
        "print([(e.name, e.value) for e in m.entry_points(group='vllm.general_plugins')])"
    )
    out = subprocess.run([py, "-P", "-c", listing], capture_output=True, text=True, check=True, cwd=tmp_path)
    assert out.stdout.strip() == "[('kuberl_shm', 'kuberl_vllm_shm:register')]"
    # a changed source replaces the module and its metadata, leaving one version
    changed = tmp_path / "vllm_shm.py"
    changed.write_text(vllm_env.PLUGIN_SOURCE.read_text() + "\n# changed\n")
    assert vllm_env.install_plugin(py, source=changed) is True
    out = subprocess.run([py, "-P", "-c", listing], capture_output=True, text=True, check=True, cwd=tmp_path)
    assert out.stdout.strip() == "[('kuberl_shm', 'kuberl_vllm_shm:register')]"
    site = next((env / "lib").glob("python3*/site-packages"))
    assert len(list(site.glob("kuberl_vllm_shm-*.dist-info"))) == 1
    assert (site / "kuberl_vllm_shm.py").read_text().endswith("# changed\n")


def test_the_server_is_started_with_the_backend_only_when_asked():
    plain = VLLMServerConfig(model="/m").command("python", 8000)
    assert "--weight-transfer-config" not in plain
    cmd = VLLMServerConfig(model="/m", weight_transfer=SHM_BACKEND).command("python", 8000)
    flag = cmd.index("--weight-transfer-config")
    assert json.loads(cmd[flag + 1]) == {"backend": "kuberl_shm"}


def test_the_server_preloads_the_hosts_tcmalloc_unless_told_not_to(tmp_path, monkeypatch):
    from kuberl.rollout import vllm_server

    lib = tmp_path / "lib" / "libtcmalloc_minimal.so.4"
    lib.parent.mkdir()
    lib.write_bytes(b"")
    assert vllm_server.tcmalloc((str(tmp_path / "absent"), str(lib.parent))) == str(lib)
    assert vllm_server.tcmalloc((str(tmp_path / "absent"),)) is None
    monkeypatch.setattr(vllm_server, "tcmalloc", lambda: str(lib))
    for var in ("LD_PRELOAD", "KUBERL_VLLM_TCMALLOC"):
        monkeypatch.delenv(var, raising=False)
    config = VLLMServerConfig(model="/m")
    assert config.env()["LD_PRELOAD"] == str(lib)
    monkeypatch.setenv("LD_PRELOAD", "/opt/other.so")
    assert config.env()["LD_PRELOAD"] == f"{lib}:/opt/other.so"  # first: it replaces malloc
    monkeypatch.setenv("LD_PRELOAD", "/opt/libtcmalloc.so.4")  # the user's own: kept as it is
    assert config.env()["LD_PRELOAD"] == "/opt/libtcmalloc.so.4"
    monkeypatch.delenv("LD_PRELOAD")
    monkeypatch.setenv("KUBERL_VLLM_TCMALLOC", "0")
    assert "LD_PRELOAD" not in config.env()
    monkeypatch.delenv("KUBERL_VLLM_TCMALLOC")
    monkeypatch.setattr(vllm_server, "tcmalloc", lambda: None)  # a host without it
    assert "LD_PRELOAD" not in config.env()


def test_kuberl_run_turns_shared_memory_pushes_off_by_env():
    from kuberl.api.loader import ManifestError
    from kuberl.trainer.local import shared_memory_pushes

    assert shared_memory_pushes({}) is True
    assert shared_memory_pushes({"KUBERL_VLLM_SHM": "0"}) is False
    with pytest.raises(ManifestError, match="KUBERL_VLLM_SHM='maybe'"):
        shared_memory_pushes({"KUBERL_VLLM_SHM": "maybe"})


def test_bench_peers_keeps_every_shared_memory_version_for_its_evaluator(tmp_path, monkeypatch):
    """bench/peers.py scores every version a kuberl run pushed: slots are rewritten two versions
    later, so each is saved as an HF folder as it is published."""
    from safetensors.torch import load_file

    from kuberl.trainer.weight_sync import DiskWeightSync

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    monkeypatch.setattr(SharedMemorySlots, "publish", SharedMemorySlots.publish)  # restored after
    monkeypatch.setattr(DiskWeightSync, "publish", DiskWeightSync.publish)
    from peers_children import keep_published

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    keep_published(tmp_path / "policies")
    slots = SharedMemorySlots(tmp_path / "w")
    for v in (1, 2, 3):
        slots.publish(_tensors(v), v, config_from=model)
    kept = sorted(p.name for p in (tmp_path / "policies").iterdir())
    assert kept == ["v00000001", "v00000002", "v00000003"]
    first = tmp_path / "policies" / "v00000001"
    assert (first / "config.json").read_text() == '{"model_type": "llama"}'
    loaded = load_file(next(first.glob("*.safetensors")))
    assert torch.equal(loaded["model.embed_tokens.weight"], _tensors(1)["model.embed_tokens.weight"])
