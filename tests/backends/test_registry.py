"""Backend discovery through entry points: fake, broken and duplicate plugins, overrides, threads."""

from __future__ import annotations

import sys
import textwrap
import threading

import pytest
import torch

import tightfit
from tightfit.backends import registry

FAKE_BACKEND = """
import torch
from tightfit.backends import Backend, Capabilities, MemoryInfo

LOADS = []


class FakeBackend(Backend):
    name = "{name}"
    device_type = "{device_type}"
    priority = {priority}

    def __init__(self):
        LOADS.append(1)

    def _is_available(self):
        return {available}

    def _capabilities(self):
        return Capabilities(storage_dtypes=frozenset({{torch.float32}}), compute_dtypes=frozenset({{torch.float32}}))

    def _memory(self, device):
        return MemoryInfo(total=1000, free=400, allocated=600, peak=700, source="fake")

    def _reset_peak_memory(self, device):
        pass

    def _synchronize(self, device):
        pass
"""


def install_plugin(root, monkeypatch, dist, module, *, body, entry_name=None):
    """Install a plugin distribution into ``root`` (a folder put on sys.path)."""
    (root / f"{module}.py").write_text(textwrap.dedent(body))
    info = root / f"{dist.replace('-', '_')}-1.0.dist-info"  # dist-info names use underscores
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[tightfit.backends]\n{entry_name or module} = {module}:FakeBackend\n")
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.delitem(sys.modules, module, raising=False)  # a same-named module from another test
    registry._clear_cache()


def fake_body(name="fakeaccel", device_type="privateuseone", priority=500, available=True):
    return FAKE_BACKEND.format(name=name, device_type=device_type, priority=priority, available=available)


def test_builtin_cpu_comes_through_the_entry_point_group():
    entries = {entry.entry_point: entry for entry in tightfit.backends.all_backends()}
    assert {"cpu", "cuda", "xpu", "mps", "hpu"} <= set(entries)
    assert "tightfit" in entries["cpu"].origin
    assert entries["cpu"].available and entries["cpu"].error is None
    assert tightfit.backends.get("cpu") in tightfit.backends.available()


def test_fake_plugin_is_found_and_wins_by_priority(tmp_path, monkeypatch):
    install_plugin(tmp_path, monkeypatch, "fake-vendor", "fake_vendor", body=fake_body())
    backend = tightfit.backends.get("fakeaccel")
    assert type(backend).__name__ == "FakeBackend"
    assert tightfit.backends.available()[0] is backend
    assert tightfit.backends.default() is backend
    assert backend.memory("privateuseone").peak == 700
    entry = next(e for e in tightfit.backends.all_backends() if e.entry_point == "fake_vendor")
    assert entry.origin.startswith("fake-vendor 1.0")


def test_unavailable_plugin_is_listed_but_not_usable(tmp_path, monkeypatch):
    install_plugin(tmp_path, monkeypatch, "fake-off", "fake_off", body=fake_body(available=False))
    assert all(b.name != "fakeaccel" for b in tightfit.backends.available())
    with pytest.raises(RuntimeError, match="not available"):
        tightfit.backends.get("fakeaccel")


def test_broken_plugin_is_recorded_and_never_breaks_tightfit(tmp_path, monkeypatch):
    install_plugin(
        tmp_path,
        monkeypatch,
        "broken-vendor",
        "broken_vendor",
        body="raise ImportError('driver library libfoo.so missing')\n",
    )
    entry = next(e for e in tightfit.backends.all_backends() if e.entry_point == "broken_vendor")
    assert entry.backend is None
    assert "libfoo.so missing" in entry.error
    assert tightfit.backends.get("cpu").name == "cpu"  # the rest still works


def test_plugin_that_is_not_a_backend_is_recorded(tmp_path, monkeypatch):
    install_plugin(tmp_path, monkeypatch, "odd-vendor", "odd_vendor", body="class FakeBackend:\n    pass\n")
    entry = next(e for e in tightfit.backends.all_backends() if e.entry_point == "odd_vendor")
    assert entry.backend is None and "not a tightfit Backend" in entry.error


def test_plugin_with_bad_declaration_is_recorded(tmp_path, monkeypatch):
    install_plugin(
        tmp_path, monkeypatch, "bad-decl", "bad_decl", body=fake_body().replace('name = "fakeaccel"', "name = 3")
    )
    entry = next(e for e in tightfit.backends.all_backends() if e.entry_point == "bad_decl")
    assert entry.backend is None and "name must be a non-empty str" in entry.error


def test_two_plugins_claiming_one_device_is_a_loud_error(tmp_path, monkeypatch):
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    install_plugin(first, monkeypatch, "vendor-one", "vendor_one", body=fake_body(name="one"))
    install_plugin(second, monkeypatch, "vendor-two", "vendor_two", body=fake_body(name="two"))
    with pytest.raises(tightfit.BackendConflictError, match="'privateuseone'.*vendor-one.*vendor-two"):
        tightfit.backends.available()
    assert len(tightfit.backends.all_backends()) >= 7  # the report still lists everything


def test_env_override_and_use(tmp_path, monkeypatch):
    install_plugin(tmp_path, monkeypatch, "fake-vendor", "fake_vendor", body=fake_body())
    assert tightfit.backends.default().name == "fakeaccel"
    monkeypatch.setenv("TIGHTFIT_BACKEND", "cpu")
    assert tightfit.backends.default().name == "cpu"
    with tightfit.backends.use("fakeaccel") as chosen:
        assert chosen.name == "fakeaccel" and tightfit.backends.default() is chosen
    assert tightfit.backends.default().name == "cpu"
    monkeypatch.setenv("TIGHTFIT_BACKEND", "nonesuch")
    with pytest.raises(ValueError, match="TIGHTFIT_BACKEND='nonesuch'.*known backends"):
        tightfit.backends.default()


def test_use_is_scoped_to_the_thread(tmp_path, monkeypatch):
    install_plugin(tmp_path, monkeypatch, "fake-vendor", "fake_vendor", body=fake_body())
    seen = []
    with tightfit.backends.use("cpu"):
        worker = threading.Thread(target=lambda: seen.append(tightfit.backends.default().name))
        worker.start()
        worker.join()
        assert tightfit.backends.default().name == "cpu"
    assert seen == ["fakeaccel"]


def test_detection_runs_once_under_concurrent_first_use(tmp_path, monkeypatch):
    install_plugin(tmp_path, monkeypatch, "fake-vendor", "fake_vendor", body=fake_body())
    barrier = threading.Barrier(16)
    results, errors = [], []

    def first_use():
        barrier.wait()
        try:
            results.append(tuple(b.name for b in tightfit.backends.available()))
        except Exception as error:  # collected and asserted below
            errors.append(error)

    threads = [threading.Thread(target=first_use) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    import fake_vendor

    assert not errors
    assert len(set(results)) == 1 and results[0][0] == "fakeaccel"
    assert len(fake_vendor.LOADS) == 1


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (3, TypeError, "device_or_name must be str, torch.device or Tensor"),
        (None, TypeError, "device_or_name must be"),
        ("nonesuch", ValueError, "backend 'nonesuch' is not known"),
        ("cuda:x", ValueError, "is not a valid device"),
    ],
)
def test_get_rejects_bad_input(value, error, match):
    with pytest.raises(error, match=match):
        tightfit.backends.get(value)


def test_get_accepts_devices_tensors_and_names():
    cpu = tightfit.backends.get("cpu")
    assert tightfit.backends.get(torch.device("cpu")) is cpu
    assert tightfit.backends.get(torch.zeros(1)) is cpu
    assert tightfit.backends.get(" cpu ") is cpu


def test_use_validates_eagerly():
    with pytest.raises(ValueError, match="not known"):
        with tightfit.backends.use("nonesuch"):
            pass


def test_plugin_that_uses_tightfit_while_loading_is_recorded(tmp_path, monkeypatch):
    body = "import tightfit\ntightfit.backends.available()\n" + fake_body()
    install_plugin(tmp_path, monkeypatch, "eager-vendor", "eager_vendor", body=body)
    entry = next(e for e in tightfit.backends.all_backends() if e.entry_point == "eager_vendor")
    assert entry.backend is None and "while it was being loaded" in entry.error
    assert tightfit.backends.get("cpu").name == "cpu"


def test_backend_whose_capabilities_fail_is_reported_not_fatal(tmp_path, monkeypatch):
    body = fake_body().replace(
        "def _capabilities(self):\n        return",
        "def _capabilities(self):\n        raise AttributeError('no such register')\n        return",
    )
    install_plugin(tmp_path, monkeypatch, "flaky-vendor", "flaky_vendor", body=body)
    backend = tightfit.backends.get("fakeaccel")
    with pytest.raises(RuntimeError, match="reading capabilities of backend fakeaccel failed: no such register"):
        backend.capabilities()
    from tightfit.app.backends_command import _backend_row

    entry = next(e for e in tightfit.backends.all_backends() if e.entry_point == "flaky_vendor")
    assert "no such register" in _backend_row(entry)["error"]
    from tightfit.ops.conformance import run_checks

    rows = run_checks(ops=["cast"], backends=[backend])
    assert any(r.status == "FAIL" and "no such register" in r.detail for r in rows)
