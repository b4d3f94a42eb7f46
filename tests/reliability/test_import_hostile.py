"""Hostile dumps for `layerscope import-states`: each is refused in one line (exit 2, no traceback) or imported with
what it skipped named, within bounded memory, without blocking on a FIFO, and never leaves a half-written or
damaged capture in the store. The dumps are built here as the engines lay them out (speculators: a
`datasets.save_to_disk` folder and hs_<i>.safetensors; SpecForge: rows_<a>-<b>/data_<i>.ckpt[.gz]), for the tiny
random target (4 layers, d=64, 260 ids, context 1024)."""

from __future__ import annotations

import gzip
import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pytest
import torch
from safetensors.torch import save_file

from layerscope.capture.stored import list_captures, open_capture
from layerscope.commands import cli
from layerscope.store import Store
from tests.reliability.test_reliability import cli_line

N, D, V = 4, 64, 260          # the tiny target: layers, hidden size, vocabulary
REPO = Path(__file__).resolve().parents[2]


def ckpt_sample(L=7, seed=0) -> dict:
    """One SpecForge sample as prepare_hidden_states.py saves it (SGLang ids 0..N-2 in aux_hidden_state)."""
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, V, (L,), generator=g), "loss_mask": torch.ones(L, dtype=torch.long),
            "hidden_state": torch.randn(1, L, D, generator=g).bfloat16(),
            "aux_hidden_state": torch.randn(1, L, (N - 1) * D, generator=g).bfloat16()}


def specforge_dump(root: Path, n=3, gz=False) -> Path:
    rows = root / "rows_0-5000"
    rows.mkdir(parents=True)
    for i in range(n):
        if gz:
            buf = io.BytesIO()
            torch.save(ckpt_sample(seed=i), buf)
            (rows / f"data_{i}.ckpt.gz").write_bytes(gzip.compress(buf.getvalue(), compresslevel=1))
        else:
            torch.save(ckpt_sample(seed=i), rows / f"data_{i}.ckpt")
    return root


def write_arrow(root: Path, columns: dict, schema=None) -> None:
    """A `datasets.save_to_disk` folder: state.json and one arrow stream file."""
    root.mkdir(parents=True, exist_ok=True)
    table = pa.table(columns, schema=schema)
    with pa.OSFile(str(root / "data-00000-of-00001.arrow"), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(table)
    (root / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))


def speculators_dump(root: Path, n=3, L=7, rows=None) -> Path:
    """A speculators dump of every vLLM id 0..N (id N appended): hidden_states [L, N+1, d], token_ids [L]."""
    g = torch.Generator().manual_seed(0)
    rows = rows or [torch.randint(0, V, (L,), generator=g) for _ in range(n)]
    write_arrow(root, {"input_ids": [r.tolist() for r in rows], "loss_mask": [[1] * len(r) for r in rows]})
    (root / "hidden_states").mkdir()
    for i, r in enumerate(rows):
        save_file({"hidden_states": torch.randn(len(r), N + 1, D, generator=g).bfloat16(), "token_ids": r.long()},
                  str(root / "hidden_states" / f"hs_{i}.safetensors"))
    return root


def import_line(capsys, dump: Path, fmt: str, store: Path, *extra) -> tuple[int, str]:
    return cli_line(capsys, "import-states", dump, "--format", fmt, "--model", "tiny-llama", "--store", store, *extra)


def import_json(capsys, dump: Path, fmt: str, store: Path, *extra) -> dict:
    code = cli.main([str(a) for a in ("import-states", dump, "--format", fmt, "--model", "tiny-llama", "--store",
                                      store, "--json", *extra)])
    out = capsys.readouterr()
    assert code == 0 and "Traceback" not in out.err, out.err
    return json.loads(out.out)


def captures_dir(store: Path) -> list[str]:
    """Every name under the store's captures/ (finished, partial and temporary alike)."""
    d = store / "captures"
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


def run_limited(script: str, gib: int, timeout: int = 60) -> dict:
    """`script` in a fresh interpreter under RLIMIT_AS = `gib` GiB; the JSON object its last line prints."""
    head = f"import resource\nresource.setrlimit(resource.RLIMIT_AS, ({gib} << 30, {gib} << 30))\n"
    done = subprocess.run([sys.executable, "-c", head + textwrap.dedent(script)], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------- compressed samples

def test_a_compressed_sample_beyond_any_sample_of_the_target_is_refused(tmp_path, capsys):
    """A valid sample padded with 64 MiB of zeros (about 64 KiB compressed): a sample of the tiny target holds at
    most 1024 tokens of 4 float32 states, so inflating stops at that bound."""
    dump = specforge_dump(tmp_path / "dump", n=2)
    bomb = ckpt_sample(seed=9) | {"padding": torch.zeros(16 * 2**20)}
    buf = io.BytesIO()
    torch.save(bomb, buf)
    (dump / "rows_0-5000" / "data_2.ckpt.gz").write_bytes(gzip.compress(buf.getvalue(), compresslevel=1))
    code, line = import_line(capsys, dump, "specforge", tmp_path / "store")
    assert code == 2 and "rows_0-5000/data_2.ckpt.gz inflates to more than 2.0 MiB" in line, line
    assert captures_dir(tmp_path / "store") == []


def test_compressed_samples_are_read_in_bounded_memory(tmp_path):
    """Under a 3 GiB address-space limit: a valid .ckpt.gz dump imports (no read buffer sized by the bound), and a
    4 MiB file inflating to 2 GiB is refused at the target's bound without holding it."""
    specforge_dump(tmp_path / "valid", gz=True)
    member = gzip.compress(b"\0" * 64 * 2**20, compresslevel=9)
    specforge_dump(tmp_path / "bomb", n=1)
    (tmp_path / "bomb" / "rows_0-5000" / "data_1.ckpt.gz").write_bytes(member * 32)
    bound = 1024 * (N * D * 4 + 16) + 2**20          # engine_dumps.max_sample_bytes of the tiny target
    got = run_limited(f"""
        import json
        from layerscope.capture.engine_dumps import open_dump
        from layerscope.errors import CaptureError
        dump = open_dump("specforge", {str(tmp_path / "valid")!r}, {D})
        out = {{"samples": len(dump.samples), "skipped": dump.skipped,
               "tokens": [len(s) for s in dump.samples], "state": list(dump.samples[0].state(1, {D}).shape)}}
        try:
            open_dump("specforge", {str(tmp_path / "bomb")!r}, {D}, max_inflated={bound}, scratch={str(tmp_path)!r})
        except CaptureError as e:
            out["bomb"] = str(e)
        print(json.dumps(out))
        """, gib=3)
    assert got["samples"] == 3 and got["skipped"] == [] and got["state"] == [7, D], got
    assert "data_1.ckpt.gz inflates to more than 2.0 MiB" in got["bomb"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bomb", "valid"]      # no inflated file left behind


def test_a_tensor_view_declaring_more_than_its_file_is_never_materialized(tmp_path):
    """A stride-0 view saved by torch.save: 1.5 KB on disk declaring a billion tokens. It is skipped as
    mismatched, not cloned (8 GB) under a 3 GiB limit."""
    rows = tmp_path / "dump" / "rows_0-5000"
    rows.mkdir(parents=True)
    L = 10**9
    torch.save({"input_ids": torch.zeros(1, dtype=torch.long).expand(L), "loss_mask": torch.ones(1).long().expand(L),
                "hidden_state": torch.zeros(1, 1, D).expand(1, L, D),
                "aux_hidden_state": torch.zeros(1, 1, (N - 1) * D).expand(1, L, (N - 1) * D)}, rows / "data_0.ckpt")
    got = run_limited(f"""
        import json
        from layerscope.capture.engine_dumps import open_dump
        from layerscope.errors import CaptureError
        try:
            open_dump("specforge", {str(tmp_path / "dump")!r}, {D})
        except CaptureError as e:
            print(json.dumps({{"error": str(e)}}))
        """, gib=3)
    assert "data_0.ckpt: mismatched: input_ids declares 1000000000 values that its file does not hold" in got["error"]


# ---------------------------------------------------------------------------- token ids and values

@pytest.mark.parametrize("fmt", ["speculators", "specforge"])
def test_a_token_id_outside_the_vocabulary_is_refused_naming_sample_and_id(fmt, tmp_path, capsys):
    if fmt == "speculators":
        rows = [torch.randint(0, V, (7,), generator=torch.Generator().manual_seed(i)) for i in range(3)]
        rows[1][4] = V + 5
        dump, name = speculators_dump(tmp_path / "dump", rows=rows), "hs_1.safetensors"
    else:
        dump, name = specforge_dump(tmp_path / "dump"), "rows_0-5000/data_1.ckpt"
        sample = ckpt_sample(seed=1)
        sample["input_ids"][4] = V + 5
        torch.save(sample, dump / name)
    code, line = import_line(capsys, dump, fmt, tmp_path / "store")
    assert code == 2 and f"Sample {name} holds token id {V + 5} at position 4" in line, line
    assert "vocabulary (ids 0..259)" in line
    assert captures_dir(tmp_path / "store") == []


@pytest.mark.parametrize("value, tensor", [(float("nan"), "aux_hidden_state"), (float("inf"), "hidden_state")])
def test_a_non_finite_sample_is_refused_and_a_rerun_finishes(value, tensor, tmp_path, capsys):
    dump = specforge_dump(tmp_path / "dump")
    store = tmp_path / "store"
    sample = ckpt_sample(seed=2)
    sample[tensor][0, 3, 5] = value
    torch.save(sample, dump / "rows_0-5000" / "data_2.ckpt")
    code, line = import_line(capsys, dump, "specforge", store, "--batch-size", "1")     # chunks 0 and 1 are written
    assert code == 2 and f"Sample rows_0-5000/data_2.ckpt holds a non-finite value ({value})" in line, line
    assert captures_dir(store) == []                                                     # no .partial left
    torch.save(ckpt_sample(seed=2), dump / "rows_0-5000" / "data_2.ckpt")               # the sample regenerated
    result = import_json(capsys, dump, "specforge", store, "--batch-size", "1")
    assert result["conversations"] == 3 and captures_dir(store) == [result["key"]]
    assert open_capture(Store(store), result["key"]).num_tokens == 21


# ---------------------------------------------------------------------------- layer ids

@pytest.mark.parametrize("layers", ["1,0,2,3", "0 2 1 3 4"])
def test_a_scrambled_layer_order_is_refused(layers, tmp_path, capsys):
    """The engines write the states in ascending layer order, whatever order they were given (engine_dumps'
    docstring), so ids given otherwise would label the layers wrongly."""
    dump = speculators_dump(tmp_path / "dump")
    code, line = import_line(capsys, dump, "speculators", tmp_path / "store", "--layers", layers)
    assert code == 2 and "is not in ascending order" in line and "--layers 0,1,2,3" in line, line
    assert captures_dir(tmp_path / "store") == []


# ---------------------------------------------------------------------------- special files and links

def test_specforge_samples_that_are_links_or_fifos_are_named(tmp_path, capsys):
    dump = specforge_dump(tmp_path / "dump", n=2)
    rows = dump / "rows_0-5000"
    (rows / "data_2.ckpt").symlink_to(rows / "data_0.ckpt")
    os.mkfifo(rows / "data_3.ckpt")
    (dump / "rows_5000-10000").symlink_to(rows)
    result = import_json(capsys, dump, "specforge", tmp_path / "store")
    reasons = {s["sample"]: s["reason"] for s in result["imported"]["skipped"]}
    assert result["conversations"] == 2 and result["imported"]["skipped_count"] == 3
    assert reasons["rows_0-5000/data_2.ckpt"].startswith("a link")
    assert reasons["rows_0-5000/data_3.ckpt"] == "a FIFO, not a regular file"
    assert reasons["rows_5000-10000"].startswith("a link")


def test_fifos_in_a_speculators_dump_never_block(tmp_path):
    """state.json, the arrow file and a sample as FIFOs with no writer: each is one line or a named skip at once
    (a blocked open inside pyarrow would not even end on SIGTERM)."""
    for name in ("state", "arrow", "sample"):
        speculators_dump(tmp_path / name)
    for name, path in (("state", "state.json"), ("arrow", "data-00000-of-00001.arrow"),
                       ("sample", "hidden_states/hs_1.safetensors")):
        (tmp_path / name / path).unlink()
        os.mkfifo(tmp_path / name / path)
    got = run_limited(f"""
        import json
        from layerscope.capture.engine_dumps import open_dump
        from layerscope.errors import CaptureError
        out = {{}}
        for name in ("state", "arrow", "sample"):
            try:
                out[name] = open_dump("speculators", {str(tmp_path)!r} + "/" + name, {D}).skipped
            except CaptureError as e:
                out[name] = str(e)
        print(json.dumps(out))
        """, gib=8, timeout=30)
    assert "has no readable state.json (a FIFO, not a regular file)" in got["state"]
    assert "data-00000-of-00001.arrow is a FIFO, not a regular file" in got["arrow"]
    assert got["sample"] == [{"sample": "hs_1.safetensors", "reason": "a FIFO, not a regular file"}]


# ---------------------------------------------------------------------------- malformed arrow columns, nesting

def _nested(depth: int) -> pa.DataType:
    t = pa.int64()
    for _ in range(depth):
        t = pa.list_(t)
    return t


ARROW = {   # name: (the columns, given the sample's 7 token ids; their schema; what the one line says)
    "strings": (lambda ids: {"input_ids": [list(map(str, ids))], "loss_mask": [[1] * 7]}, None,
                "column input_ids is list<item: string>"),
    "floats": (lambda ids: {"input_ids": [ids], "loss_mask": [[0.5] * 6 + [float("nan")]]}, None,
               "column loss_mask is list<item: double>"),
    "a number": (lambda ids: {"input_ids": [ids[0]], "loss_mask": [[1] * 7]}, None,
                 "column input_ids is int64, not a list"),
    "nulls": (lambda ids: {"input_ids": [ids[:3] + [None] + ids[4:]], "loss_mask": [[1] * 7]}, None,
              "missing (null) input_ids"),
    "nested 40 deep": (lambda ids: {"input_ids": [None], "loss_mask": [[1] * 7]},
                       pa.schema([("input_ids", _nested(40)), ("loss_mask", pa.list_(pa.int64()))]),
                       "column input_ids is list<item: list<item: list"),
}


@pytest.mark.parametrize("name", list(ARROW))
def test_malformed_arrow_columns_are_one_line(name, tmp_path, capsys):
    columns, schema, said = ARROW[name]
    dump = speculators_dump(tmp_path / "dump", n=1)
    ids = torch.randint(0, V, (7,), generator=torch.Generator().manual_seed(0)).tolist()     # the sample's own
    write_arrow(dump, columns(ids), schema)
    code, line = import_line(capsys, dump, "speculators", tmp_path / "store")
    assert code == 2 and said in line, line


def test_deeply_nested_state_json_is_one_line(tmp_path, capsys):
    dump = speculators_dump(tmp_path / "dump")
    (dump / "state.json").write_text("[" * 100_000 + "]" * 100_000)
    code, line = import_line(capsys, dump, "speculators", tmp_path / "store")
    assert code == 2 and "state.json is nested 100000 levels deep" in line, line


def test_deeply_nested_specforge_folders_are_one_line(tmp_path, capsys):
    dump = specforge_dump(tmp_path / "dump")
    deep = [str(dump)]
    for _ in range(1100):                    # iteratively: os.makedirs and shutil.rmtree recurse per level
        deep.append(deep[-1] + "/a")
        os.mkdir(deep[-1])
    try:
        code, line = import_line(capsys, dump, "specforge", tmp_path / "store")
        assert code == 2 and "holds folders nested more than 8 deep" in line, line
    finally:
        for d in reversed(deep[1:]):
            os.rmdir(d)


# ---------------------------------------------------------------------------- what the store holds after

def test_an_import_never_reports_a_capture_the_store_calls_damaged(tmp_path, capsys):
    """A sample whose only key is a 65 MiB string: its skip reason quoted the key whole, so the manifest outgrew
    what the store reads (64 MiB) and the capture the import reported was listed as damaged."""
    dump = specforge_dump(tmp_path / "dump", n=2)
    torch.save({"k" * (65 * 2**20): torch.zeros(1)}, dump / "rows_0-5000" / "data_2.ckpt")
    result = import_json(capsys, dump, "specforge", tmp_path / "store")
    store = Store(tmp_path / "store")
    assert [c["state"] for c in list_captures(store)] == ["ok"]
    cap = open_capture(store, result["key"])
    (skipped,) = cap.manifest["imported"]["skipped"]
    assert skipped["sample"] == "rows_0-5000/data_2.ckpt" and skipped["reason"].startswith("partial: holds ['kkk")
    assert len(skipped["reason"]) <= 160 and cap.num_tokens == 14


def test_an_empty_sample_is_skipped_not_written_as_an_empty_chunk(tmp_path, capsys):
    """A sample of no tokens made a chunk of none, which the store's manifest check refuses: the import stopped at
    its very end, and every rerun stopped there again."""
    dump = specforge_dump(tmp_path / "dump")
    torch.save(ckpt_sample(L=0), dump / "rows_0-5000" / "data_1.ckpt")
    result = import_json(capsys, dump, "specforge", tmp_path / "store", "--batch-size", "1")
    assert result["imported"]["skipped"] == [{"sample": "rows_0-5000/data_1.ckpt", "reason": "empty: no tokens"}]
    assert captures_dir(tmp_path / "store") == [result["key"]]
    assert open_capture(Store(tmp_path / "store"), result["key"]).num_tokens == 14
