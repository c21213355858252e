"""Resume policy through the real CLI on a tiny random-weight model: flush_seconds, --retry-failed,
rows added or removed later, leftovers of a crash, a damaged committed shard, --force, a second
Ctrl-C, input.truncate and ``pipeline status``."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from conftest import ROOT
from test_job_end_to_end import read_output, run_cli
from tiny_model import write_tiny_model

PROMPTS = ["Say one word.", "Count to three.", "Name a color.", "What is 2+2?", "Spell cat.", "Hello!"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def write_input(path: Path, prompts: list, ids: list | None = None) -> Path:
    ids = ids or [f"r{i}" for i in range(len(prompts))]
    pq.write_table(pa.table({"id": ids, "prompt": pa.array(prompts, pa.string())}), path)
    return path


def write_job(tmp: Path, model: Path, data: Path, name="out", input_extra=None, output_extra=None, **generation):
    job = {
        "model": str(model),
        "input": {"path": str(data), "id_column": "id", "prompt_column": "prompt", **(input_extra or {})},
        "generation": {"max_tokens": 6, "temperature": 0.7, "seed": 3, **generation},
        "output": {"dir": str(tmp / name), "shard_size": 3, **(output_extra or {})},
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job), encoding="utf-8")
    return path


def manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


def keys(out: Path) -> list[tuple]:
    t = read_output(out)
    return sorted(zip(t.column("id").to_pylist(), t.column("sample_index").to_pylist()))


@pytest.mark.parametrize("flush_seconds, shard_rows", [(3600, [3, 3]), (1e-6, [1] * 6)])
def test_shards_flush_at_shard_size_or_flush_seconds(tiny, tmp_path, flush_seconds, shard_rows):
    data = write_input(tmp_path / "in.parquet", PROMPTS)
    run_cli("run", str(write_job(tmp_path, tiny, data, output_extra={"flush_seconds": flush_seconds})), "--no-progress")
    assert [s["rows"] for s in manifest(tmp_path / "out")["shards"]] == shard_rows


def test_retry_failed_replaces_only_failed_rows(tiny, tmp_path):
    bad = PROMPTS[:2] + [""] + PROMPTS[3:]
    data = write_input(tmp_path / "in.parquet", bad)
    job = write_job(tmp_path, tiny, data)
    out = tmp_path / "out"
    proc = run_cli("run", str(job), "--no-progress", expect=3)
    assert "1 row(s) failed" in proc.stderr
    before = {r["id"]: r for r in read_output(out).to_pylist()}
    assert before["r2"]["error"] == "input column 'prompt' is empty"
    write_input(data, PROMPTS)  # the user fixes the data
    proc = run_cli("run", str(job), "--no-progress", expect=3)
    assert "nothing to do" in proc.stdout and "input files changed" in proc.stdout
    first_shard = out / manifest(out)["shards"][0]["file"]
    proc = run_cli("run", str(job), "--no-progress", "--retry-failed")
    assert "done: 1 row written (0 failed, 5 from earlier runs)" in proc.stdout
    after = {r["id"]: r for r in read_output(out).to_pylist()}
    assert keys(out) == [(f"r{i}", 0) for i in range(6)]
    assert after["r2"]["error"] is None and after["r2"]["completion"]
    assert all(after[i] == before[i] for i in before if i != "r2")
    assert not first_shard.exists()  # the shard that held the failed row was rewritten without it
    assert manifest(out)["rows"] == 6 and manifest(out)["complete"] is True
    # the rewritten shard's rows keep the run that made them; the retried row names the retry run
    assert [s["run"] for s in manifest(out)["shards"]] == [1, 1, 3]


def test_rows_added_later_are_generated_and_removed_rows_reported(tiny, tmp_path):
    data = write_input(tmp_path / "in.parquet", PROMPTS[:4])
    job = write_job(tmp_path, tiny, data)
    out = tmp_path / "out"
    run_cli("run", str(job), "--no-progress")
    first = {r["id"]: r["completion"] for r in read_output(out).to_pylist()}
    write_input(data, PROMPTS[1:], ids=[f"r{i}" for i in range(1, 6)])  # r0 removed, r4 and r5 added
    proc = run_cli("run", str(job), "--no-progress")
    assert "done: 2 rows written (0 failed, 3 from earlier runs)" in proc.stdout
    assert "1 committed row(s) are no longer in the input (kept in the output): ids r0" in proc.stdout
    rows = {r["id"]: r["completion"] for r in read_output(out).to_pylist()}
    assert sorted(rows) == [f"r{i}" for i in range(6)]
    assert all(rows[i] == first[i] for i in first)


def test_positional_ids_refuse_an_input_whose_committed_rows_moved(tiny, tmp_path):
    """Without input.id_column a row's id is its position. A row inserted at the top of the input used to be
    taken as "rows added": the old last row was generated again under a new id, the new row never, and
    export --join-input paired completions with the wrong prompts. Rows appended at the end are fine."""
    data = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": ["alpha", "beta"]}), data)
    job = write_job(tmp_path, tiny, data, input_extra={"id_column": None})
    run_cli("run", str(job), "--no-progress")
    pq.write_table(pa.table({"prompt": ["alpha", "beta", "gamma"]}), data)  # appended: positions kept
    out = run_cli("run", str(job), "--no-progress").stdout
    assert "done: 1 row written (0 failed, 2 from earlier runs)" in out
    before = manifest(tmp_path / "out")
    pq.write_table(pa.table({"prompt": ["NEW", "alpha", "beta", "gamma"]}), data)  # inserted at the top
    proc = run_cli("run", str(job), "--no-progress", expect=2)
    assert proc.stderr.splitlines() == [
        "error: input.id_column is not set, so rows are keyed by their position, and the input changed since the "
        "last run: row 0 is now 'NEW', its committed output was made from 'alpha'; set input.id_column, or use "
        "a new output.dir (or --output-dir DIR)"]
    assert manifest(tmp_path / "out") == before  # nothing generated or recorded


def test_positional_ids_refuse_a_local_dataset_whose_committed_rows_moved(tiny, tmp_path):
    """As above for a local input.dataset directory: its files' sizes and mtimes are recorded, as input.path's
    are (only its name, config, split and revision were), so a changed file is noticed and checked."""
    from pipeline.inputs import InputError
    from pipeline.jobspec import job_from_dict
    from pipeline.run import run_job

    data = tmp_path / "ds"
    data.mkdir()
    f = data / "train.jsonl"
    f.write_text('{"prompt": "alpha"}\n{"prompt": "beta"}\n', encoding="utf-8")
    job = job_from_dict({"model": str(tiny), "input": {"dataset": {"name": str(data)}},
                         "generation": {"max_tokens": 4}, "output": {"dir": str(tmp_path / "out")}})
    run_job(job, progress=False, echo=lambda _m: None)
    assert manifest(tmp_path / "out")["inputs"] == [{"path": str(f), "size": f.stat().st_size,
                                                      "mtime_ns": f.stat().st_mtime_ns}]
    before = manifest(tmp_path / "out")
    f.write_text('{"prompt": "NEW"}\n{"prompt": "alpha"}\n{"prompt": "beta"}\n', encoding="utf-8")
    with pytest.raises(InputError) as ei:
        run_job(job, progress=False, echo=lambda _m: None)
    assert str(ei.value) == (
        "input.id_column is not set, so rows are keyed by their position, and the input changed since the last "
        "run: row 0 is now 'NEW', its committed output was made from 'alpha'; set input.id_column, or use a new "
        "output.dir (or --output-dir DIR)")
    assert manifest(tmp_path / "out") == before


def test_leftovers_of_a_crash_are_removed_and_reported(tiny, tmp_path):
    data = write_input(tmp_path / "in.parquet", PROMPTS)
    job = write_job(tmp_path, tiny, data)
    out = tmp_path / "out"
    run_cli("run", str(job), "--no-progress", "--limit", "3")
    (out / "part-00007.parquet").write_bytes(b"PAR1 truncated")  # renamed but never committed
    (out / ".part-00001.parquet.x1y2.tmp").write_bytes(b"half a shard")
    proc = run_cli("run", str(job), "--no-progress")
    assert "removed 1 uncommitted shard file(s) left by an interrupted run (part-00007.parquet)" in proc.stdout
    assert "removed 1 leftover temporary file(s)" in proc.stdout
    assert not (out / "part-00007.parquet").exists() and not list(out.glob(".*.tmp"))
    assert keys(out) == [(f"r{i}", 0) for i in range(6)]
    assert sorted(p.name for p in out.glob("part-*.parquet")) == [s["file"] for s in manifest(out)["shards"]]


def test_damaged_committed_shard_is_refused(tiny, tmp_path):
    data = write_input(tmp_path / "in.parquet", PROMPTS)
    job = write_job(tmp_path, tiny, data)
    out = tmp_path / "out"
    run_cli("run", str(job), "--no-progress", "--limit", "3")
    shard = out / manifest(out)["shards"][0]["file"]
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size - 10)
    proc = run_cli("run", str(job), "--no-progress", check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"error: {shard}: committed shard has {size - 10} bytes, the manifest says {size}; "
                                   "it was changed after commit; pipeline run JOB --redo-corrupt generates its 3 "
                                   "rows again")


def test_force_continues_and_is_recorded(tiny, tmp_path):
    data = write_input(tmp_path / "in.parquet", PROMPTS)
    out = tmp_path / "out"
    run_cli("run", str(write_job(tmp_path, tiny, data)), "--no-progress", "--limit", "3")
    changed = write_job(tmp_path, tiny, data, temperature=0.9)
    proc = run_cli("run", str(changed), "--no-progress", check=False)
    assert proc.returncode == 2 and "changed: generation.temperature" in proc.stderr
    run_cli("run", str(changed), "--no-progress", "--force")
    m = manifest(out)
    assert m["forced"][0]["changed"] == ["generation.temperature"]
    assert m["fingerprint"]["generation"]["temperature"] == 0.9 and m["rows"] == 6
    assert "settings: mixed — 3 rows temperature=0.7 (run 1), 3 rows temperature=0.9 (run 2, --force)" in \
        run_cli("status", str(out)).stdout


def test_force_on_a_finished_dir_keeps_the_settings_of_its_rows(tiny, tmp_path):
    """A --force with changed settings and nothing to generate records nothing about settings; the rows a
    later --force run adds are attributed to the new settings, the old rows keep theirs."""
    data = write_input(tmp_path / "in.parquet", PROMPTS[:4])
    out = tmp_path / "out"
    run_cli("run", str(write_job(tmp_path, tiny, data, max_tokens=2)), "--no-progress")
    before = manifest(out)
    changed = write_job(tmp_path, tiny, data, max_tokens=4)
    proc = run_cli("run", str(changed), "--no-progress", expect=2)
    assert proc.stderr == (f"error: {out} holds results of a different job (changed: generation.max_tokens); use a "
                           "new output.dir (or --output-dir DIR), or --force to add rows made with the new settings "
                           "to this one\n")
    proc = run_cli("run", str(changed), "--no-progress", "--force")
    assert proc.stdout.startswith("--force: no row to generate, so the committed rows keep their recorded settings "
                                  "(changed: generation.max_tokens)\nnothing to do: all 4 rows")
    m = manifest(out)
    assert m["fingerprint"] == before["fingerprint"] and "forced" not in m
    assert m["shards"] == before["shards"] and len(m["runs"]) == 2
    st = json.loads(run_cli("status", str(out), "--json").stdout)
    assert st["settings_mixed"] is False and "max_tokens=2" in st["fingerprint"]
    assert "settings:" not in run_cli("status", str(out)).stdout
    run_cli("run", str(changed), "--no-progress", expect=2)  # still refused: no row has the new settings

    write_input(data, PROMPTS)  # two rows more
    proc = run_cli("run", str(changed), "--no-progress", "--force")
    assert "done: 2 rows written (0 failed, 4 from earlier runs)" in proc.stdout
    m = manifest(out)
    assert [s["run"] for s in m["shards"]] == [1, 1, 3]
    assert [r["fingerprint"]["generation"]["max_tokens"] for r in m["runs"]] == [2, 4, 4]
    assert m["fingerprint"]["generation"]["max_tokens"] == 4
    assert m["forced"] == [{"changed": ["generation.max_tokens"], "previous": before["fingerprint"], "run": 3}]
    tokens = {r["id"]: r["completion_tokens"] for r in read_output(out).to_pylist()}
    assert max(tokens[f"r{i}"] for i in range(4)) <= 2 < max(tokens["r4"], tokens["r5"])  # tiny model: no early EOS
    st = json.loads(run_cli("status", str(out), "--json").stdout)
    assert st["settings_mixed"] is True and "max_tokens=mixed" in st["fingerprint"]
    assert [(g["rows"], g["runs"], g["forced"], g["settings"]) for g in st["settings"]] == [
        (4, [1], False, "max_tokens=2"), (2, [3], True, "max_tokens=4")]
    text = run_cli("status", str(out)).stdout
    assert "settings: mixed — 4 rows max_tokens=2 (run 1), 2 rows max_tokens=4 (run 3, --force)\n" in text
    run_cli("run", str(changed), "--no-progress")  # the new settings are the output's now: no --force needed
    run_cli("run", str(write_job(tmp_path, tiny, data, max_tokens=2)), "--no-progress", expect=2)


def test_validate_says_how_much_of_the_output_is_done(tiny, tmp_path):
    data = write_input(tmp_path / "in.parquet", PROMPTS[:2] + [""] + PROMPTS[3:])
    job = write_job(tmp_path, tiny, data, max_tokens=2)
    ok = f"ok: {job}: 6 input rows (6 output rows, n=1), model {tiny}, output {tmp_path / 'out'}"
    assert run_cli("validate", str(job)).stdout == ok + "\n"
    run_cli("run", str(job), "--no-progress", "--limit", "2")
    assert run_cli("validate", str(job)).stdout == ok + " has 2/6 rows (4 to do)\n"
    run_cli("run", str(job), "--no-progress", expect=3)
    assert run_cli("validate", str(job)).stdout == ok + " is complete (6/6 rows, 1 failed; nothing to do)\n"


def test_second_ctrl_c_aborts_at_once_without_corrupting(tiny, tmp_path):
    data = write_input(tmp_path / "in.parquet", PROMPTS * 5, ids=[f"r{i:02d}" for i in range(30)])
    # long rows (ignore_eos, 400 tokens) so the second Ctrl-C lands while the row in flight still runs
    job = write_job(tmp_path, tiny, data, max_tokens=400, ignore_eos=True, output_extra={"shard_size": 1})
    out = tmp_path / "out"
    proc = subprocess.Popen(["pipeline", "run", str(job), "--no-progress"], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not ((out / "manifest.json").exists() and manifest(out)["shards"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGINT)
    time.sleep(0.1)
    os.kill(proc.pid, signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130
    assert "press Ctrl-C again to stop at once" in stderr
    assert stdout.startswith("aborted (SIGINT): ") and "run the same command again to resume" in stdout
    m = manifest(out)
    assert 1 <= m["rows"] < 30 and m["runs"][-1]["aborted"] is True
    assert len(keys(out)) == m["rows"]  # every listed shard reads back
    run_cli("run", str(job), "--no-progress")
    assert keys(out) == [(f"r{i:02d}", 0) for i in range(30)]


@pytest.mark.parametrize("policy", ["error", "left", "right"])
def test_prompt_longer_than_context_follows_input_truncate(tiny, tmp_path, policy):
    """A cut prompt keeps 511 tokens (one position left to generate); the first cut row is logged, once."""
    long = " ".join(f"w{i}" for i in range(600))  # > 512 positions of the tiny model
    data = write_input(tmp_path / "in.parquet", [long, "short prompt", long + " again"])
    job = write_job(tmp_path, tiny, data, input_extra={"truncate": policy, "apply_chat_template": False},
                    max_tokens=3)
    proc = run_cli("run", str(job), "--no-progress", expect=3 if policy == "error" else 0)
    rows = {r["id"]: r for r in read_output(tmp_path / "out").to_pylist()}
    assert rows["r1"]["error"] is None
    notes = [line for line in proc.stderr.splitlines() if "input.truncate" in line]
    if policy == "error":
        assert rows["r0"]["error"].startswith("prompt has ") and \
            rows["r0"]["error"].endswith("tokens; the model's context is 512 (input.truncate: left or right cuts it to fit)")
        assert notes == []
    else:
        assert rows["r0"]["error"] is None and rows["r0"]["prompt_tokens"] == 511
        assert rows["r0"]["completion_tokens"] == 1  # the one position left
        assert len(notes) == 1, proc.stderr
        n_prompt = int(notes[0].split(" of its ")[1].split()[0])
        side = "start" if policy == "left" else "end"
        assert notes[0].endswith(f"row 'r0': input.truncate: {policy} cut {n_prompt - 511} of its {n_prompt} prompt "
                                 f"tokens (from the {side}) to fit the model's context of 512; later cut rows are "
                                 "not logged (prompt_tokens gives each row's kept length)")


def test_status_reports_progress(tiny, tmp_path):
    data = write_input(tmp_path / "in.parquet", PROMPTS)
    job = write_job(tmp_path, tiny, data, n=2)
    out = tmp_path / "out"
    run_cli("run", str(job), "--no-progress", "--limit", "2")
    st = json.loads(run_cli("status", str(out), "--json").stdout)
    table = read_output(out)
    assert (st["rows_done"], st["rows_pending"], st["rows_failed"]) == (4, 8, 0)
    assert st["completion_tokens"] == sum(table.column("completion_tokens").to_pylist())
    assert st["eta_s"] > 0 and st["throughput_tps"] > 0 and st["runs"] == 1 and st["complete"] is False
    assert "temperature=0.7" in st["fingerprint"] and "n=2" in st["fingerprint"]
    text = run_cli("status", str(out)).stdout
    assert "rows: 4 done (0 failed), 8 pending" in text
    run_cli("run", str(job), "--no-progress")
    st = json.loads(run_cli("status", str(out), "--json").stdout)
    assert (st["rows_done"], st["rows_pending"], st["complete"], st["runs"]) == (12, 0, True, 2)
    assert st["rows_not_in_input"] == 0
    write_input(data, PROMPTS[:5])  # r5 leaves the input: its 2 rows stay committed
    st = json.loads(run_cli("status", str(out), "--json").stdout)
    assert (st["rows_done"], st["rows_pending"], st["rows_not_in_input"], st["complete"]) == (12, 0, 2, True)
    assert "rows: 12 done (0 failed; 2 no longer in the job's selection of the input), 0 pending" in run_cli(
        "status", str(out)).stdout
    proc = run_cli("status", str(tmp_path / "nothing"), check=False)
    assert proc.returncode == 2 and "no manifest.json" in proc.stderr


def test_a_unit_shard_is_adopted_only_with_the_settings_that_planned_it(tmp_path):
    """A --force run with other settings planned a Ray unit and died after writing its shard, before any
    commit: the output's fingerprint is still the old one, but the shard was made with the new settings,
    so a resume with the old settings removes it and a resume with the new ones adopts it."""
    from pipeline.shards import ShardStore, write_shard

    def rows(*ids):
        return pa.table({"id": list(ids), "sample_index": [0] * len(ids),
                         "error": pa.array([None] * len(ids), pa.string())})

    old, new = {"generation": {"max_tokens": 2}}, {"generation": {"max_tokens": 4}}
    for resume, adopted in ((old, []), (new, ["unit-00000.parquet"])):
        out = tmp_path / f"out-{len(adopted)}"
        store = ShardStore(out, old)
        store.add_run({})
        store.commit(rows("a"))
        store = ShardStore(out, new, force=True)
        store.add_run({})
        (unit,) = store.plan_units([[("b", 0)]], 1)
        write_shard(out, unit, rows("b"))
        assert manifest(out)["fingerprint"] == old
        store = ShardStore(out, resume, force=True)
        assert store.report.adopted == adopted
        assert [(s["file"], s["run"]) for s in store.manifest["shards"]] == [("part-00000.parquet", 1)] + \
            [(unit, 2)] * len(adopted)
        assert store.manifest["fingerprint"] == resume


def test_the_first_signal_says_how_to_stop_at_once_in_its_own_terms():
    """SIGINT is Ctrl-C at a terminal; a SIGTERM comes from a supervisor (kill, a scheduler), which has no
    Ctrl-C to press."""
    from pipeline.run.control import _Signals

    for signum, again in ((signal.SIGINT, "press Ctrl-C again"), (signal.SIGTERM, "send SIGINT or SIGTERM again")):
        said = []
        _Signals(said.append, "rows")._handle(signum, None)
        assert said == [f"{signal.Signals(signum).name}: finishing the rows in flight, then committing; {again} to "
                        "stop at once"]
