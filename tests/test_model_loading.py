"""Loading MLX / HF model directories: tiny llama directories built here, their error messages, special
tokens, and ``pipeline inspect``."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import mlx.core as mx
import pyarrow as pa
import pyarrow.parquet as pq
import mlx.nn as nn
import numpy as np
import pytest

from pipeline.modeldir import ModelDirError, read_model_dir
from mlx.utils import tree_flatten, tree_unflatten
from tokenizers import AddedToken, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from pipeline import load_model
from pipeline.describe import describe_model, format_description
from tiny_model import without_machine_warnings
from pipeline.engine import GenerateParams
from pipeline.errors import RowError
from pipeline.inputs import InputRow
from pipeline.jobspec import InputSpec
from pipeline.loader import WeightsError, compute_dtype
from pipeline.models import llama
from pipeline.models.base import ConfigError
from pipeline.prompts import build_prompt
from pipeline.tokenizer import TokenizerError

SPECIAL = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|eot|>"]  # ids 0..5
BOS, EOS, IM_END, EOT = 1, 2, 4, 5
WORDS = ["user", "assistant", "system", "hello", "world"]
VOCAB = SPECIAL + WORDS + [f"w{i}" for i in range(128 - len(SPECIAL) - len(WORDS))]
CONFIG = {
    "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": len(VOCAB), "rms_norm_eps": 1e-5,
    "max_position_embeddings": 256, "tie_word_embeddings": True, "bos_token_id": BOS, "eos_token_id": EOS,
}
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant{% endif %}")


@pytest.fixture(scope="module")
def weights() -> dict[str, mx.array]:
    model = llama.Model(llama.ModelArgs.from_dict(CONFIG))
    return dict(tree_flatten(model.parameters()))


def write_tokenizer(path: Path) -> None:
    hf = HFTokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    hf.save(str(path))


def make_dir(path: Path, weights: dict, *, config: dict | None = None, tokenizer_config: dict | None = None,
             generation_config: dict | None = None, shards: int = 1) -> Path:
    """A model directory as mlx_lm.convert writes it (weights split into ``shards`` files with an index)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(CONFIG if config is None else config))
    write_tokenizer(path / "tokenizer.json")
    tok_cfg = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False, "chat_template": TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg if tokenizer_config is None else tokenizer_config))
    if generation_config is not None:
        (path / "generation_config.json").write_text(json.dumps(generation_config))
    if shards == 1:
        mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
        return path
    names = sorted(weights)
    weight_map = {}
    for i in range(shards):
        part = names[i::shards]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        mx.save_safetensors(str(path / fname), {k: weights[k] for k in part}, metadata={"format": "mlx"})
        weight_map.update({k: fname for k in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def load(path: Path):
    return load_model(str(path), dequantize=False)


def one_line_error(exc_info, *needles):
    msg = str(exc_info.value)
    assert "\n" not in msg, msg
    for n in needles:
        assert str(n) in msg, msg
    return msg


# --- loading ---------------------------------------------------------------------------------------


def test_directory_loads_and_generates(tmp_path, weights):
    lm = load(make_dir(tmp_path / "m", weights))
    assert lm.config["model_type"] == "llama" and lm.engine.context_length == 256
    gen = lm.engine.generate([BOS, 8, 9], GenerateParams(max_tokens=4, ignore_eos=True))
    assert len(gen.token_ids) == 4 and all(0 <= t < len(VOCAB) for t in gen.token_ids)
    assert isinstance(lm.generate("hello world", max_tokens=3), str)


def test_generate_params_take_one_stop_or_a_list():
    """As vLLM's SamplingParams: one stop string (not its characters) or id, or a list of them, or None."""
    assert GenerateParams(stop="problem", stop_token_ids=451).stop == ("problem",)
    assert GenerateParams(stop_token_ids=451).stop_token_ids == (451,)
    assert GenerateParams(stop=["a", "bc"], stop_token_ids=[1, 2]) == GenerateParams(stop=("a", "bc"), stop_token_ids=(1, 2))
    assert GenerateParams(stop=None, stop_token_ids=None) == GenerateParams()


def test_python_api_checks_generation_settings(tmp_path, weights):
    """``LoadedModel.generate`` rejects what a job's generation section rejects, in one line naming the key,
    before any MLX call (which raised TypeError / ValueError of its own, or generated garbage)."""
    lm = load(make_dir(tmp_path / "m", weights))
    assert isinstance(lm.generate("hello world", max_tokens=3, stop="xyz", stop_token_ids=EOT), str)
    for key, value in [("repetition_penalty", 0), ("presence_penalty", float("nan")), ("min_tokens", 65),
                       ("temperature", -1), ("temperature", float("inf")), ("top_p", 0), ("seed", -5),
                       ("seed", 2**64), ("logprobs", 60000), ("max_tokens", 0), ("stop", "")]:
        with pytest.raises(ValueError) as e:
            lm.generate("hello world", **{key: value})
        assert one_line_error(e, key).startswith(key), (key, value)
    with pytest.raises(ValueError) as e:
        lm.generate("hello world", top_p=0, min_p=2)
    one_line_error(e, "top_p must be in (0, 1], got 0", "; min_p must be in [0, 1], got 2")


def test_sharded_weights_load_identically(tmp_path, weights):
    one = load(make_dir(tmp_path / "one", weights))
    two_dir = make_dir(tmp_path / "two", weights, shards=2)
    assert len(list(two_dir.glob("model-*.safetensors"))) == 2
    two = load(two_dir)
    for (ka, a), (kb, b) in zip(tree_flatten(one.model.parameters()), tree_flatten(two.model.parameters())):
        assert ka == kb and mx.array_equal(a, b).item()
    ids = [BOS, 8, 9, 10]
    np.testing.assert_array_equal(one.logprobs(ids), two.logprobs(ids))


@pytest.mark.parametrize("stored", [mx.bfloat16, mx.float16])
def test_half_precision_weights_load(tmp_path, weights, stored):
    half = {k: v.astype(stored) for k, v in weights.items()}
    lm = load(make_dir(tmp_path / "half", half))
    assert {v.dtype for _, v in tree_flatten(lm.model.parameters())} == {compute_dtype()}
    ref = load(make_dir(tmp_path / "ref", {k: v.astype(compute_dtype()) for k, v in half.items()}))
    ids = [BOS, 8, 9, 10]
    np.testing.assert_allclose(lm.logprobs(ids), ref.logprobs(ids), atol=1e-6)


# --- errors: one line naming the file and the key or tensor -----------------------------------------


def test_config_missing_required_key(tmp_path, weights):
    d = make_dir(tmp_path / "m", weights, config={k: v for k, v in CONFIG.items() if k != "num_attention_heads"})
    with pytest.raises(ConfigError) as e:
        load(d)
    one_line_error(e, d / "config.json", "num_attention_heads")


@pytest.mark.parametrize("key, value", [("hidden_size", "64"), ("num_hidden_layers", None), ("rms_norm_eps", True)])
def test_config_value_of_wrong_type(tmp_path, weights, key, value):
    d = make_dir(tmp_path / "m", weights, config={**CONFIG, key: value})
    with pytest.raises(ConfigError) as e:
        load(d)
    one_line_error(e, d / "config.json", key)


def test_config_that_is_not_an_object(tmp_path, weights):
    d = make_dir(tmp_path / "m", weights)
    (d / "config.json").write_text("[1]")
    with pytest.raises(ModelDirError) as e:
        load(d)
    one_line_error(e, d / "config.json", "JSON object")


def test_config_missing_model_type(tmp_path, weights):
    d = make_dir(tmp_path / "m", weights, config={k: v for k, v in CONFIG.items() if k != "model_type"})
    with pytest.raises(ConfigError) as e:
        load(d)
    one_line_error(e, d / "config.json", "model_type", "llama", "qwen2")


def test_unknown_model_type(tmp_path, weights):
    d = make_dir(tmp_path / "m", weights, config={**CONFIG, "model_type": "gpt9"})
    with pytest.raises(ConfigError) as e:
        load(d)
    one_line_error(e, d / "config.json", "'gpt9'", "llama", "mistral", "qwen2", "qwen3")


def test_missing_weight(tmp_path, weights):
    name = "model.layers.1.mlp.up_proj.weight"
    d = make_dir(tmp_path / "m", {k: v for k, v in weights.items() if k != name})
    with pytest.raises(WeightsError) as e:
        load(d)
    one_line_error(e, d / "model.safetensors", "missing", name)


def test_missing_weight_in_sharded_dir(tmp_path, weights):
    name = "model.layers.1.mlp.up_proj.weight"
    d = make_dir(tmp_path / "m", {k: v for k, v in weights.items() if k != name}, shards=2)
    with pytest.raises(WeightsError) as e:
        load(d)
    one_line_error(e, d, "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", name)


def test_unexpected_weight(tmp_path, weights):
    name = "model.layers.7.mlp.up_proj.weight"
    d = make_dir(tmp_path / "m", {**weights, name: mx.zeros((128, 64))})
    with pytest.raises(WeightsError) as e:
        load(d)
    one_line_error(e, d / "model.safetensors", "unexpected", name)


def test_weight_with_wrong_shape(tmp_path, weights):
    name = "model.layers.0.self_attn.k_proj.weight"  # (2 kv heads * 16, 64) = (32, 64)
    d = make_dir(tmp_path / "m", {**weights, name: mx.zeros((64, 64))})
    with pytest.raises(WeightsError) as e:
        load(d)
    one_line_error(e, d / "model.safetensors", name, "(64, 64)", "(32, 64)")


def test_a_value_error_outside_the_weights_is_not_blamed_on_them(tmp_path, weights, monkeypatch):
    """A ValueError from our own model code (here the family's ``sanitize``) is a bug: it propagates as it is,
    with its traceback, instead of a one-line "weights do not fit" naming the weight file."""
    from pipeline.models import llama

    def broken(self, w):
        raise ValueError("a bug in sanitize")

    monkeypatch.setattr(llama.Model, "sanitize", broken)
    d = make_dir(tmp_path / "m", weights)
    with pytest.raises(ValueError, match="a bug in sanitize") as e:
        load(d)
    assert not isinstance(e.value, WeightsError)


def test_missing_tokenizer_json(tmp_path, weights):
    d = make_dir(tmp_path / "m", weights)
    (d / "tokenizer.json").unlink()
    with pytest.raises(TokenizerError) as e:
        load(d)
    one_line_error(e, d / "tokenizer.json")


def test_cli_error_is_one_line(tmp_path, weights):
    d = make_dir(tmp_path / "m", {k: v for k, v in weights.items() if k != "model.norm.weight"})
    proc = subprocess.run(["pipeline", "inspect", str(d)], capture_output=True, text=True)
    assert proc.returncode == 1
    lines = without_machine_warnings(proc.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: ") and "model.norm.weight" in lines[0], proc.stderr


# --- special tokens and chat template ---------------------------------------------------------------


def test_eos_ids_are_the_union_of_every_declaration(tmp_path, weights):
    d = make_dir(tmp_path / "m", weights, config={**CONFIG, "eos_token_id": [EOS, EOT]},
                 generation_config={"eos_token_id": [EOT, 7]},
                 tokenizer_config={"bos_token": "<s>", "eos_token": "<|im_end|>", "chat_template": TEMPLATE})
    lm = load(d)
    assert set(lm.tokenizer.eos_token_ids) == {EOS, EOT, 7, IM_END}
    assert lm.config["eos_token_id"] == sorted({EOS, EOT, 7, IM_END})


def test_eos_ids_union_with_single_int_declarations(tmp_path, weights):
    d = make_dir(tmp_path / "m", weights, config={**CONFIG, "eos_token_id": EOT}, generation_config={"eos_token_id": 7},
                 tokenizer_config={"bos_token": "<s>", "eos_token": "</s>", "chat_template": TEMPLATE})
    md = read_model_dir(d)
    # </s> from tokenizer_config, EOT from config.json, 7 from generation_config, <|im_end|> from the template.
    assert md.tokenizer.eos_token_ids == tuple(sorted({EOS, EOT, 7, IM_END}))
    assert md.config["eos_token_id"] == sorted({EOS, EOT, 7, IM_END})


def test_chat_template_from_jinja_file(tmp_path, weights):
    d = make_dir(tmp_path / "m", weights, tokenizer_config={"bos_token": "<s>", "eos_token": "</s>"})
    assert load(d).tokenizer.chat_template is None
    (d / "chat_template.jinja").write_text(TEMPLATE)
    tok = load(d).tokenizer
    assert tok.chat_template == TEMPLATE
    text = tok.apply_chat_template([{"role": "user", "content": "hello"}])
    assert text == "<|im_start|>user hello<|im_end|><|im_start|>assistant"


def test_bos_not_doubled_when_template_emits_it(tmp_path, weights):
    d = make_dir(tmp_path / "m", weights, tokenizer_config={
        "bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True, "chat_template": "{{ bos_token }}" + TEMPLATE})
    tok = load(d).tokenizer
    assert tok.bos_token_id == BOS and tok.add_bos_token is True
    row = InputRow(index=0, id=0, prompt="hello world", messages=None)
    chat = build_prompt(row, InputSpec(path="x"), tok).token_ids
    assert chat[:3] == [BOS, 3, 6] and chat.count(BOS) == 1  # <s> <|im_start|> user
    raw = build_prompt(row, InputSpec(path="x", apply_chat_template=False), tok).token_ids
    assert raw == [BOS, 9, 10]



def test_a_chat_template_that_fails_on_a_conversation_warns_and_keeps_the_declared_eos(tmp_path, weights, caplog):
    # the template's own TypeError (str + int) on the probe conversation: the end-of-turn token is not found
    bad = TEMPLATE.replace("{{ m['content'] }}", "{{ m['content'] + 1 }}")
    d = make_dir(tmp_path / "m", weights, tokenizer_config={"bos_token": "<s>", "eos_token": "</s>", "chat_template": bad})
    with caplog.at_level("WARNING", logger="pipeline"):
        tok = load(d).tokenizer
    assert tok.eos_token_ids == (EOS,)  # <|im_end|> not added: the template could not show it
    warnings = [r.getMessage() for r in caplog.records if "chat template failed" in r.getMessage()]
    assert len(warnings) == 1 and "TypeError" in warnings[0], caplog.text


def test_a_chat_template_that_does_not_compile_stops_the_job_before_any_row(tmp_path, weights):
    d = make_dir(tmp_path / "m", weights, tokenizer_config={
        "bos_token": "<s>", "eos_token": "</s>", "chat_template": "{% for m in messages %}{{ m.content }{% endfor %}"})
    pq.write_table(pa.table({"id": [1, 2], "prompt": ["hello", "hello world"]}), tmp_path / "in.parquet")
    job = {"model": str(d), "input": {"path": str(tmp_path / "in.parquet"), "id_column": "id"},
           "generation": {"max_tokens": 2}, "output": {"dir": str(tmp_path / "out")}}
    (tmp_path / "job.yaml").write_text(json.dumps(job))
    proc = subprocess.run(["pipeline", "run", str(tmp_path / "job.yaml"), "--no-progress"], capture_output=True,
                          text=True)
    assert proc.returncode == 1, proc.stderr  # the model's fault: not a failed row each (exit 3)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: model {str(d)!r}: the model's chat template does not compile: unexpected '}}'; fix "
                      "it in the model's files or set input.apply_chat_template: false"], proc.stderr
    assert not list((tmp_path / "out").glob("*.parquet"))
    # without the template the same model runs
    (tmp_path / "job.yaml").write_text(json.dumps({**job, "input": {**job["input"], "apply_chat_template": False}}))
    proc = subprocess.run(["pipeline", "run", str(tmp_path / "job.yaml"), "--no-progress"], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr
    assert pq.read_table(next((tmp_path / "out").glob("*.parquet"))).num_rows == 2

# --- pipeline inspect -------------------------------------------------------------------------------


def test_describe_float_directory(tmp_path, weights):
    d = make_dir(tmp_path / "m", {k: v.astype(mx.bfloat16) for k, v in weights.items()})
    info = describe_model(str(d))
    n_params = sum(v.size for v in weights.values())
    assert info["format"] == "mlx-dir" and info["path"] == str(d) and info["model_type"] == "llama"
    assert info["parameters"] == n_params
    assert info["weight_tensors"] == {"bfloat16": len(weights)}
    assert info["weight_bytes_on_disk"] == (d / "model.safetensors").stat().st_size
    assert info["weight_bytes_in_memory"] == n_params * compute_dtype().size
    assert (info["hidden_size"], info["num_hidden_layers"], info["num_attention_heads"],
            info["num_key_value_heads"], info["head_dim"], info["context_length"]) == (64, 2, 4, 2, 16, 256)
    assert info["cache_layout"] == "2 x KVCache"
    # </s> declared; <|im_end|> is the template's end-of-turn token.
    assert info["eos_token_ids"] == [EOS, IM_END] and info["eos_tokens"] == ["</s>", "<|im_end|>"]
    assert (info["bos_token_id"], info["bos_token"], info["add_bos_token"]) == (BOS, "<s>", False)
    assert info["chat_template"] is True
    text = format_description(info)
    assert f"bfloat16 x {len(weights)} tensors" in text and "2 x KVCache" in text


def test_describe_quantized_directory_counts_unquantized_size(tmp_path, weights):
    model = llama.Model(llama.ModelArgs.from_dict(CONFIG))
    model.update(tree_unflatten(list(weights.items())))
    nn.quantize(model, group_size=32, bits=4)
    qweights = dict(tree_flatten(model.parameters()))
    d = make_dir(tmp_path / "q", qweights, config={**CONFIG, "quantization": {"group_size": 32, "bits": 4}})
    info = describe_model(str(d))
    assert info["parameters"] == sum(v.size for v in weights.values())
    # 7 projections x 2 layers + the embedding quantized; 2 norms x 2 layers + the final norm not
    assert info["weight_tensors"] == {"4-bit (group 32)": 15, "float32": 5}


def test_inspect_default_model(default_model_path):
    proc = subprocess.run(["pipeline", "inspect", "smollm2-135m-instruct", "--json"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["model_type"] == "llama" and info["format"] == "gguf"
    assert info["num_hidden_layers"] == 30 and info["context_length"] == 8192
    assert info["eos_token_ids"] == [2] and info["eos_tokens"] == ["<|im_end|>"]
    assert 130e6 < info["parameters"] < 140e6
    assert info["weight_tensors"] == {"4-bit (group 32)": 210, "8-bit (group 32)": 1, "float32": 61}
    assert info["cache_layout"] == "30 x KVCache"
    assert info["chat_template"] is True


def test_inspect_missing_path(tmp_path):
    proc = subprocess.run(["pipeline", "inspect", str(tmp_path / "nope")], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stdout == ""  # as run and validate do for the job's model
    assert without_machine_warnings(proc.stderr) == [
        f"error: model '{tmp_path / 'nope'}' is not a built-in alias (smollm2-135m-instruct), an existing .gguf "
        "file or model directory, or a Hugging Face repo id"]


def test_inspect_directory_without_config_says_so(tmp_path):
    """Through the CLI's own check (``check_model_spec``), exit 2 as for any bad model spec."""
    from click.testing import CliRunner

    from pipeline.cli import main

    result = CliRunner().invoke(main, ["inspect", str(tmp_path)])
    assert result.exit_code == 2
    assert result.output == f"error: model directory '{tmp_path}' has no config.json\n"


def test_chat_template_jinja_file_wins_over_the_config_key(tmp_path, weights):
    """transformers (so mlx-lm and vLLM) reads chat_template.jinja over tokenizer_config.json's chat_template;
    pipeline took the config's."""
    d = make_dir(tmp_path / "m", weights)  # tokenizer_config.json has TEMPLATE
    jinja = "JINJA{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (d / "chat_template.jinja").write_text(jinja)
    tok = read_model_dir(d).tokenizer
    assert tok.chat_template == jinja
    messages = [{"role": "user", "content": "hello"}]
    assert tok.apply_chat_template(messages) == "JINJAhello"
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(d))
    assert hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == "JINJAhello"


@pytest.mark.parametrize("case", ["jinja_not_utf8", "config_int", "config_list_of_ints"])
def test_unreadable_chat_template_is_one_line_naming_the_file(tmp_path, weights, case):
    tok_cfg = {"bos_token": "<s>", "eos_token": "</s>"}
    if case == "config_int":
        tok_cfg["chat_template"] = 5
    elif case == "config_list_of_ints":
        tok_cfg["chat_template"] = [1]
    d = make_dir(tmp_path / "m", weights, tokenizer_config=tok_cfg)
    if case == "jinja_not_utf8":
        (d / "chat_template.jinja").write_bytes(b"{{ 'caf\xe9' }}")
        where = d / "chat_template.jinja"
    else:
        where = f"{d / 'tokenizer_config.json'}: chat_template must be a string"
    with pytest.raises(TokenizerError) as e:
        read_model_dir(d)
    one_line_error(e, where)


def test_gguf_chat_template_that_is_not_a_string(tmp_path):
    from gguf_file import UINT32, write_tiny_gguf

    from pipeline.gguf import read_gguf

    path = write_tiny_gguf(tmp_path / "m.gguf", {"tokenizer.chat_template": (UINT32, 5)})
    with pytest.raises(TokenizerError) as e:
        read_gguf(path)
    one_line_error(e, f"{path}: GGUF metadata tokenizer.chat_template must be a string, got 5")


def _index_weight_map_list(d: Path) -> None:
    index = d / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": sorted(set(json.loads(index.read_text())["weight_map"].values()))}))


# (case, make_dir keyword arguments, a change to the written dir, error class, file, key)
MALFORMED_DIRS = [
    ("eos_list_with_a_string", {"config": {**CONFIG, "eos_token_id": [EOS, "x"]}}, None, ModelDirError,
     "config.json", "eos_token_id"),
    ("generation_eos_string", {"generation_config": {"eos_token_id": "abc"}}, None, ModelDirError,
     "generation_config.json", "eos_token_id"),
    ("bos_float", {"config": {**CONFIG, "bos_token_id": 1.0}}, None, ModelDirError, "config.json", "bos_token_id"),
    ("no_attention_heads", {"config": {**CONFIG, "num_attention_heads": 0}}, None, ConfigError, "config.json",
     "num_attention_heads"),
    ("context_0", {"config": {**CONFIG, "max_position_embeddings": 0}}, None, ConfigError, "config.json",
     "max_position_embeddings"),
    ("context_negative", {"config": {**CONFIG, "max_position_embeddings": -5}}, None, ConfigError, "config.json",
     "max_position_embeddings"),
    ("quantization_list", {"config": {**CONFIG, "quantization": [1]}}, None, ConfigError, "config.json",
     "quantization"),
    ("index_weight_map_list", {"shards": 2}, _index_weight_map_list, ModelDirError, "model.safetensors.index.json",
     "weight_map"),
    ("tokenizer_config_list", {}, lambda d: (d / "tokenizer_config.json").write_text("[1]"), TokenizerError,
     "tokenizer_config.json", "JSON object"),
    ("bos_token_int", {"tokenizer_config": {"bos_token": 5, "eos_token": "</s>"}}, None, TokenizerError,
     "tokenizer_config.json", "bos_token"),
    ("eos_token_content_int", {"tokenizer_config": {"bos_token": "<s>", "eos_token": {"content": 2}}}, None,
     TokenizerError, "tokenizer_config.json", "eos_token"),
]


@pytest.mark.parametrize("case,kwargs,change,error,file,key", MALFORMED_DIRS, ids=[c[0] for c in MALFORMED_DIRS])
def test_malformed_model_dir_file_is_one_line_naming_file_and_key(tmp_path, weights, case, kwargs, change, error,
                                                                  file, key):
    """Each was a traceback (ValueError, ZeroDivisionError, AttributeError, a RowError from the warm-up)."""
    d = make_dir(tmp_path / "m", weights, **kwargs)
    if change:
        change(d)
    with pytest.raises(error) as e:
        load(d)
    one_line_error(e, d / file, key)


@pytest.mark.parametrize("key,value", [
    ("llama.attention.head_count", 0), ("llama.attention.head_count", "nine"), ("llama.context_length", "abc"),
    ("llama.context_length", 0), ("llama.block_count", -1),
])
def test_malformed_gguf_number_is_one_line_naming_the_key(tmp_path, key, value):
    from gguf_file import INT32, STRING, write_tiny_gguf

    from pipeline.gguf import GGUFError

    path = write_tiny_gguf(tmp_path / "m.gguf", {key: (STRING if isinstance(value, str) else INT32, value)})
    with pytest.raises(GGUFError) as e:
        load(path)
    one_line_error(e, f"{path}: GGUF metadata {key} must be a positive integer, got {value!r}")


@pytest.mark.parametrize("file,key,value", [
    ("config.json", "bos_token_id", len(VOCAB)), ("config.json", "eos_token_id", [EOS, 60000]),
    ("generation_config.json", "bos_token_id", 60000),
    ("generation_config.json", "eos_token_id", 60000),
])
def test_special_token_id_outside_the_vocabulary(tmp_path, weights, file, key, value):
    """A model dir with bos_token_id 60000 ran, its warm-up reading past the embedding."""
    kwargs = {"config": {**CONFIG, key: value}} if file == "config.json" else {
        "config": {k: v for k, v in CONFIG.items() if k != key}, "generation_config": {key: value}}  # used
    d = make_dir(tmp_path / "m", weights, **kwargs)
    with pytest.raises(ConfigError) as e:
        load(d)
    bad = value[-1] if isinstance(value, list) else value
    one_line_error(e, f"{d / file}: {key}: {bad} is outside the vocabulary of {len(VOCAB)} tokens")


def test_an_unused_bos_id_in_generation_config_is_not_checked(tmp_path, weights):
    """config.json's bos_token_id wins, so a stale one in generation_config.json is never used: the model loads."""
    d = make_dir(tmp_path / "m", weights, config={**CONFIG, "bos_token_id": 1},
                 generation_config={"bos_token_id": 60000})
    assert load(d) is not None


def test_a_pad_id_outside_the_vocabulary_is_not_checked(tmp_path, weights):
    """Nothing here uses the pad id, and old Llama conversions carry ``pad_token_id: -1``: the model loads."""
    d = make_dir(tmp_path / "m", weights, config={**CONFIG, "pad_token_id": -1})
    assert load(d) is not None


@pytest.mark.parametrize("key", ["tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                                 "tokenizer.ggml.eot_token_id"])
def test_gguf_special_token_id_outside_the_vocabulary(tmp_path, key):
    """A GGUF with bos_token_id 999999 segfaulted in the warm-up (the BOS id fed as a token)."""
    from gguf_file import TOKENS, UINT32, write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "m.gguf", {key: (UINT32, 999999)})
    with pytest.raises(ConfigError) as e:
        load(path)  # before any warm-up
    one_line_error(e, f"{path}: GGUF metadata {key}: 999999 is outside the vocabulary of {len(TOKENS)} tokens")


def test_gguf_special_token_id_that_is_not_an_integer(tmp_path):
    from gguf_file import STRING, write_tiny_gguf

    from pipeline.gguf import GGUFError

    path = write_tiny_gguf(tmp_path / "m.gguf", {"tokenizer.ggml.eos_token_id": (STRING, "2")})
    with pytest.raises(GGUFError) as e:
        load(path)
    one_line_error(e, f"{path}: GGUF metadata tokenizer.ggml.eos_token_id must be a token id, got '2'")


@pytest.mark.parametrize("type_id,type_name", [(99, "unknown"), (34, "TQ1_0"), (6, "Q5_0")])
def test_gguf_tensor_of_a_type_mlx_cannot_load_is_named(tmp_path, type_id, type_name):
    """MLX's reader ends the tensor list at a type id it does not know (99, 34: "weights do not fit ... missing
    N tensor(s)" followed) and fails on others without naming the tensor (6: "gguf_tensor_to_f16 failed")."""
    from gguf_file import tiny_llama_tensors, write_tiny_gguf

    from pipeline.gguf import GGUFError

    tensors = [(name, data, type_id if name == "blk.0.attn_norm.weight" else t)
               for name, data, t in tiny_llama_tensors()]
    path = write_tiny_gguf(tmp_path / "m.gguf", tensors=tensors)
    with pytest.raises(GGUFError) as e:
        load(path)
    one_line_error(e, f"{path}: tensor 'blk.0.attn_norm.weight' has GGML type {type_id} ({type_name}), which MLX "
                      "cannot load")


@pytest.mark.parametrize("kv,scaled", [
    ({"llama.rope.scaling.factor": 4.0}, True), ({"llama.rope.scale_linear": 4.0}, True),
    ({"llama.rope.scaling.factor": 1.0}, False), ({"llama.rope.scale_linear": 1.0}, False),
    ({"llama.rope.scaling.factor": 1.0, "llama.rope.scale_linear": 4.0}, False),
])
def test_gguf_rope_scaling_factor_without_a_type_is_linear(tmp_path, kv, scaled):
    """llama.cpp (llm_load_hparams) takes a GGUF's RoPE scaling type as linear when it has none, with the factor
    from rope.scaling.factor, else the old rope.scale_linear; such a file ran unscaled. It is refused as an
    explicit linear type is; a factor of 1 is no scaling."""
    from gguf_file import FLOAT32, write_tiny_gguf

    from pipeline.gguf import GGUFError, read_gguf

    path = write_tiny_gguf(tmp_path / "m.gguf", {k: (FLOAT32, v) for k, v in kv.items()})
    if not scaled:
        assert "rope_scaling" not in read_gguf(path).config
        return
    with pytest.raises(GGUFError) as e:
        read_gguf(path)
    one_line_error(e, f"{path}: RoPE scaling 'linear' is not supported for GGUF models")


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "gemma3_text"])
def test_kv_heads_not_dividing_heads_is_one_line_at_load(model_type):
    """4 heads over 3 KV heads: inspect said fine and run died in the warm-up with an MLX traceback."""
    from pipeline.models import build_model

    config = {**CONFIG, "model_type": model_type, "num_key_value_heads": 3, "head_dim": 16,
              "tie_word_embeddings": True, "rope_theta": 10000.0, "rms_norm_eps": 1e-6}
    with pytest.raises(ConfigError) as e:
        build_model(config, {}, mx.float32)
    one_line_error(e, "model config key 'num_key_value_heads' (3) must divide num_attention_heads (4)")


@pytest.mark.parametrize("rows", [100, 160])
def test_tokenizer_larger_than_the_embedding_is_refused(tmp_path, weights, rows):
    """A 128-token tokenizer over a 100-row embedding loaded and generated garbage; now a one-line ConfigError
    naming both sizes. More rows than tokens (a padded embedding) is normal and loads."""
    small = dict(weights)
    emb = weights["model.embed_tokens.weight"]
    small["model.embed_tokens.weight"] = mx.concatenate([emb, emb])[:rows]
    d = make_dir(tmp_path / "m", small, config={**CONFIG, "vocab_size": rows})
    if rows > len(VOCAB):
        assert load(d).model.args.vocab_size == rows
        return
    with pytest.raises(ConfigError) as e:
        load(d)
    one_line_error(e, f"{d / 'tokenizer.json'}: the tokenizer's vocabulary has ids up to {len(VOCAB) - 1}, past the "
                      f"vocab_size {rows} of {d / 'config.json'}")


def test_an_added_token_past_the_embedding_loads_and_fails_only_the_rows_holding_it(tmp_path, weights):
    """Gemma 3 1B's tokenizer adds <image_soft_token> at id 262144 of a 262144-row embedding: such a model
    loads (it was refused for counting 262145 tokens), and only a prompt holding that token fails its row."""
    d = make_dir(tmp_path / "m", weights)
    hf = HFTokenizer.from_file(str(d / "tokenizer.json"))
    hf.add_special_tokens([AddedToken("<extra>", special=True, normalized=False)])
    hf.save(str(d / "tokenizer.json"))
    lm = load(d)
    assert lm.tokenizer.vocab_size == len(VOCAB) + 1 and lm.model.args.vocab_size == len(VOCAB)
    spec = InputSpec(path="", apply_chat_template=False, parse_special_tokens=True)
    ok = build_prompt(InputRow(index=0, id=0, prompt="hello world", messages=None), spec, lm.tokenizer)
    assert ok.token_ids == [VOCAB.index("hello"), VOCAB.index("world")]
    with pytest.raises(RowError) as e:
        build_prompt(InputRow(index=1, id=1, prompt="hello <extra>", messages=None), spec, lm.tokenizer)
    one_line_error(e, f"the prompt holds token {len(VOCAB)} ('<extra>'), past the model's vocabulary of {len(VOCAB)} "
                      "tokens")
