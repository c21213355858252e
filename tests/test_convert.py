"""`pipeline convert` on the real default model: the MLX directory it writes loads in ours and in mlx-lm."""

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT  # noqa: F401  (tests/ on sys.path)
from pipeline import load_model
from pipeline.engine import GenerateParams


@pytest.fixture(scope="module")
def converted(tmp_path_factory, default_model_path):
    import subprocess

    dst = tmp_path_factory.mktemp("convert") / "smollm2-mlx"
    proc = subprocess.run(["pipeline", "convert", str(default_model_path), str(dst)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return dst


def test_directory_layout(converted):
    names = {p.name for p in converted.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    config = json.loads((converted / "config.json").read_text())
    assert config["model_type"] == "llama" and config["rope_traditional"] is False
    assert config["quantization"]["bits"] == 4 and config["quantization"]["group_size"] == 32
    assert config["quantization"]["model.embed_tokens"] == {"group_size": 32, "bits": 8}
    assert "chat_template" in json.loads((converted / "tokenizer_config.json").read_text())


def test_refuses_to_overwrite(converted, default_model_path):
    import subprocess

    proc = subprocess.run(["pipeline", "convert", str(default_model_path), str(converted)], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr == f"error: {converted} already exists (use --overwrite)\n"


def test_logits_equal_gguf_path(converted, default_model_path, llamacpp_cases):
    gguf = load_model(path=default_model_path, dequantize=False)
    mlx_dir = load_model(str(converted), dequantize=False)
    for case in llamacpp_cases[:3]:
        a, b = gguf.logprobs(case["chat_ids"]), mlx_dir.logprobs(case["chat_ids"])
        np.testing.assert_allclose(b, a, atol=1e-4)


def test_tokenizer_from_directory_matches_llamacpp(converted, llamacpp_cases):
    tok = load_model(str(converted)).tokenizer
    assert tok.eos_token_ids == (2,) and tok.bos_token_id == 1 and tok.add_bos_token is False
    for case in llamacpp_cases:
        assert tok.encode(case["prompt"]) == case["raw_ids"]
        assert tok.encode(case["chat_text"], parse_special=True) == case["chat_ids"]
        assert tok.apply_chat_template([{"role": "user", "content": case["prompt"]}]) == case["chat_text"]


def test_mlx_lm_loads_it_and_greedy_agrees(converted, llamacpp_cases):
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    ref_model, ref_tok = load(str(converted))
    # float32 like ours (on this CPU float16 matmuls are ~30x slower); mlx-lm's own model code throughout
    ref_model.set_dtype(mx.float32)
    ours = load_model(str(converted))
    for case in llamacpp_cases[:2]:
        ids = ref_tok.encode(case["chat_text"], add_special_tokens=False)
        assert ids == case["chat_ids"]
        ref = [int(t) for (t, _), _ in zip(generate_step(mx.array(ids), ref_model, max_tokens=16), range(16))]
        ours_ids = ours.engine.generate(ids, GenerateParams(max_tokens=16, ignore_eos=True)).token_ids
        assert ours_ids == ref


def _convert_cli(*args):
    from click.testing import CliRunner

    from pipeline.cli import main

    return CliRunner().invoke(main, ["convert", *map(str, args)])


@pytest.mark.parametrize("layout", ["holds_src", "other_files", "subdir"])
def test_overwrite_refuses_a_directory_convert_did_not_write(tmp_path, layout):
    """--overwrite replaces only an empty directory or an earlier convert's: the folder holding SRC, or one with
    other files, is refused with one line, exit 2, and nothing in it is deleted (it was rmtree'd)."""
    dst = tmp_path / "dst"
    dst.mkdir()
    src = tmp_path / "model.gguf"
    if layout == "holds_src":
        src = dst / "model.gguf"
    elif layout == "other_files":
        (dst / "notes.txt").write_text("mine")
    else:
        (dst / "sub").mkdir()
    (dst / "config.json").write_text("{}")
    src.write_bytes(b"GGUF not really")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    result = _convert_cli(src, dst, "--overwrite")
    assert result.exit_code == 2, result.output
    lines = result.output.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {dst}: ") and "not replacing it" in lines[0], result.output
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_overwrite_replaces_an_earlier_convert_or_an_empty_directory(tmp_path, default_model_path):
    dst = tmp_path / "dst"
    dst.mkdir()
    result = _convert_cli(default_model_path, dst, "--overwrite")  # empty: fine
    assert result.exit_code == 0, result.output
    names = sorted(p.name for p in dst.iterdir())
    (dst / "config.json").write_text("{}")
    result = _convert_cli(default_model_path, dst, "--overwrite")  # convert's own output: replaced
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in dst.iterdir()) == names and json.loads((dst / "config.json").read_text())


@pytest.mark.parametrize("add_bos", [True, False])
def test_converted_tokenizer_adds_bos_where_the_gguf_asks(tmp_path, add_bos):
    """A GGUF with add_bos_token true was converted to a tokenizer.json without a post-processor, so mlx-lm and
    transformers added no BOS; our own loader (which adds BOS itself) gives the same ids either way."""
    from gguf_file import BOOL, BOS, write_tiny_gguf
    from mlx_lm import load
    from tokenizers import Tokenizer as HFTokenizer

    from pipeline.convert import convert_gguf
    from pipeline.gguf import read_gguf

    src = write_tiny_gguf(tmp_path / "m.gguf", {"tokenizer.ggml.add_bos_token": (BOOL, add_bos)})
    dst = convert_gguf(src, tmp_path / "mlx")
    gguf_tok = read_gguf(src).tokenizer
    text_ids = gguf_tok.encode("hi there")
    expected = [BOS, *text_ids] if add_bos else text_ids
    assert HFTokenizer.from_file(str(dst / "tokenizer.json")).encode("hi there").ids == expected
    assert load(str(dst))[1].encode("hi there") == expected
    ours = load_model(str(dst)).tokenizer
    assert ours.add_bos_token is add_bos and ours.encode("hi there") == text_ids
    assert ours.encode("hi there", add_bos=ours.add_bos_token) == gguf_tok.encode("hi there", add_bos=add_bos)


@pytest.mark.parametrize("adds_bos", [False, True])
def test_converted_tokenizer_keeps_its_post_processor(tmp_path, adds_bos):
    """The BOS template replaced the tokenizer's own post-processor (HF's Llama 3 tokenizer.json has
    Sequence[ByteLevel, TemplateProcessing]: ByteLevel's offsets were lost); now it follows it in a Sequence, or
    is left out when the tokenizer's own one already puts BOS first (no second BOS)."""
    from gguf_file import BOOL, BOS, write_tiny_gguf
    from mlx_lm import load
    from tiny_model import write_tiny_model
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import processors

    from pipeline.gguf import read_gguf
    from pipeline.tokenizer import Tokenizer

    gguf_tok = read_gguf(write_tiny_gguf(tmp_path / "m.gguf", {"tokenizer.ggml.add_bos_token": (BOOL, True)})).tokenizer
    hf = HFTokenizer.from_str(gguf_tok.to_str())
    own = [processors.ByteLevel(trim_offsets=False)]
    if adds_bos:
        own.append(processors.TemplateProcessing(single=f"{gguf_tok.bos_token} $A", pair=f"{gguf_tok.bos_token} $A $B",
                                                 special_tokens=[(gguf_tok.bos_token, BOS)]))
    hf.post_processor = processors.Sequence(own)
    tok = Tokenizer(hf, bos_token_id=BOS, eos_token_ids=gguf_tok.eos_token_ids, add_bos_token=True, chat_template=None)
    dst = write_tiny_model(tmp_path / "mlx", tokenizer=tok)

    written = json.loads((dst / "tokenizer.json").read_text())["post_processor"]
    assert written["type"] == "Sequence" and written["processors"][0]["type"] == "ByteLevel"
    assert written["processors"][0]["trim_offsets"] is False
    assert [p["type"] for p in written["processors"]] == ["ByteLevel", "TemplateProcessing"]
    expected = [BOS, *gguf_tok.encode("hi there")]
    assert HFTokenizer.from_file(str(dst / "tokenizer.json")).encode("hi there").ids == expected
    assert load(str(dst))[1].encode("hi there") == expected


def test_overwrite_of_the_current_directory_is_refused(tmp_path, monkeypatch):
    """`convert M.gguf . --overwrite` made its temporary directory inside ".", deleted the earlier conversion
    there and failed with OSError [Errno 22]; replacing the shell's directory is now refused, one line, exit 2,
    nothing deleted. A relative DST beside it is still replaced."""
    from gguf_file import write_tiny_gguf

    src = write_tiny_gguf(tmp_path / "m.gguf")
    dst = tmp_path / "mlx"
    assert _convert_cli(src, dst).exit_code == 0
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    monkeypatch.chdir(dst)
    result = _convert_cli(src, ".", "--overwrite")
    assert result.exit_code == 2, result.output
    assert result.output == f"error: {dst}: is the current directory or holds it; not replacing it\n"
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    monkeypatch.chdir(tmp_path)
    result = _convert_cli(src, "mlx", "--overwrite")
    assert result.exit_code == 0, result.output
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


@pytest.mark.parametrize("case", ["parent_is_a_file", "under_a_file", "read_only", "special"])
def test_unwritable_destination_is_one_line_exit_2(tmp_path, case):
    """An unwritable DST printed a traceback; now one line naming DST and why, exit 2, nothing left behind.
    We run as root, so a chmod'ed directory does not stop a write: sysfs and procfs, where no directory can be
    made, stand in for a read-only file system."""
    from gguf_file import write_tiny_gguf

    src = write_tiny_gguf(tmp_path / "m.gguf")
    (tmp_path / "afile").write_text("x")
    dst, reason = {
        "parent_is_a_file": (tmp_path / "afile" / "sub", f"{tmp_path / 'afile'} is a file, not a directory"),
        "under_a_file": (tmp_path / "afile" / "a" / "sub", f"{tmp_path / 'afile'} is a file, not a directory"),
        "read_only": (Path("/sys/pipeline-convert-test/mlx"), ""),  # EPERM or EROFS, as mounted
        "special": (Path("/proc/self/pipeline-convert-test"), ""),
    }[case]
    before = sorted(tmp_path.rglob("*"))
    result = _convert_cli(src, dst)
    assert result.exit_code == 2, result.output
    assert result.output.startswith(f"error: DST {dst}: cannot write it: {reason}")
    assert result.output.count("\n") == 1, result.output
    assert sorted(tmp_path.rglob("*")) == before and not dst.exists()


@pytest.mark.parametrize("nested", [False, True])
def test_no_space_left_is_one_line_exit_1_and_leaves_nothing(tmp_path, monkeypatch, nested):
    """MLX's writer failing for want of space ("[write] Unable to write ...") printed a traceback and left the
    parent directories convert had made; now one line, exit 1 (as run's no space left), nothing left behind."""
    import collections
    import shutil

    import mlx.core as mx
    from gguf_file import write_tiny_gguf

    src = write_tiny_gguf(tmp_path / "m.gguf")
    dst = tmp_path / "new" / "deeper" / "mlx" if nested else tmp_path / "mlx"

    def full_disk(path, arrays, metadata=None):
        Path(path).write_bytes(b"\0" * 100)  # what fitted
        raise RuntimeError("[write] Unable to write 4096 bytes to file.")

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(mx, "save_safetensors", full_disk)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 20, 1 << 20, 0))
    before = sorted(tmp_path.rglob("*"))
    result = _convert_cli(src, dst)
    assert result.exit_code == 1, result.output
    assert result.output == f"error: DST {dst}: cannot write it: No space left on device\n"
    assert sorted(tmp_path.rglob("*")) == before
