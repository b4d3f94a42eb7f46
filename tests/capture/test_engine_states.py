"""Hidden states from the engines: speculators' and SpecForge's dumps imported as captures, captures exported as
speculators' training data, checked with the engines' own readers (speculators' ArrowDataset, check_hidden_states,
find_corrupt_hidden_state_indices and save_token_frequency_distribution; SpecForge's OfflineEagle3Dataset).

The dumps are made from a direct capture of the tiny model, laid out as the engines write them (the hs_<i> files as
vLLM's connector writes them, the data folder by speculators' own build_speculator_training_dataset; the .ckpt files
as SpecForge's prepare_hidden_states.py saves them), so an import must give back that capture's statistics.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from layerscope.capture.engine_dumps import layer_map, open_dump
from layerscope.capture.export_states import export_states
from layerscope.capture.import_states import ImportOptions, import_states
from layerscope.capture.stored import open_capture
from layerscope.errors import CaptureError
from layerscope.stats.analysis import AnalysisOptions, analyze

pytest.importorskip("speculators", reason="the speculators test extra (requirements-speculators.txt)")
from datasets import Dataset  # noqa: E402  (a dependency of the test extra)
from speculators.data_generation.offline import check_hidden_states, find_corrupt_hidden_state_indices  # noqa: E402
from speculators.data_generation.preprocessing import build_speculator_training_dataset  # noqa: E402
from speculators.train.data import ArrowDataset  # noqa: E402
from speculators.train.vocab_mapping import save_token_frequency_distribution  # noqa: E402

ALL_TOKENS = AnalysisOptions(min_entropy=None, response_only=False, outlier_factor=None, debiased=False)


def conversations(cap):
    """[(token ids, response mask, global index)] per conversation of a capture."""
    t = cap.tokens()
    out = []
    for c in t["conversation"].unique().tolist():
        idx = (t["conversation"] == c).nonzero().squeeze(1)
        out.append((t["token_id"][idx], t["is_response"][idx], idx))
    return out


def speculators_dump(cap, root: Path, ids: list[int], tokenizer) -> Path:
    """A speculators dump of `cap`: the data folder written by speculators' own code, hs_<i> files as vLLM writes them
    (hidden_states [L, K, d] for vLLM ids `ids`, id N being the pre-norm last state; token_ids [L])."""
    N = cap.num_layers
    convs = conversations(cap)
    rows = Dataset.from_dict({"input_ids": [c[0].tolist() for c in convs], "loss_mask": [c[1].long().tolist() for c in convs]})
    data = build_speculator_training_dataset(rows, tokenizer, max_length=4096, num_proc=1)
    data.save_to_disk(str(root))
    (root / "hidden_states").mkdir()
    for i, (tok, _, idx) in enumerate(convs):
        states = [cap.prenorm_final(idx) if l == N else cap.layer(l, idx) for l in ids]
        save_file({"hidden_states": torch.stack(states, 1).to(torch.bfloat16).contiguous(), "token_ids": tok.long()},
                  str(root / "hidden_states" / f"hs_{i}.safetensors"))
    return root


def specforge_dump(cap, root: Path) -> Path:
    """A SpecForge dump of `cap` for SGLang ids 0..N-2, saved as prepare_hidden_states.py saves it:
    rows_<a>-<b>/data_<i>.ckpt = {input_ids, loss_mask, hidden_state [1, L, d], aux_hidden_state [1, L, K*d]}."""
    N = cap.num_layers
    (root / "rows_0-5000").mkdir(parents=True)
    for i, (tok, mask, idx) in enumerate(conversations(cap)):
        aux = torch.cat([cap.layer(s + 1, idx) for s in range(N - 1)], dim=1).to(torch.bfloat16)
        torch.save({"input_ids": tok.long(), "loss_mask": mask.long(), "hidden_state": cap.layer(N, idx)[None].to(torch.bfloat16),
                    "aux_hidden_state": aux[None]}, root / "rows_0-5000" / f"data_{i}.ckpt")
    return root


def assert_same_statistics(direct, imported, exact_layers):
    a, b = direct.tokens(), imported.tokens()
    for name in ("token_id", "position", "conversation", "is_response"):
        assert torch.equal(a[name], b[name]), name
    assert torch.allclose(a["entropy"], b["entropy"], atol=2e-3)
    for l in range(direct.num_layers + 1):
        x, y = direct.layer(l), imported.layer(l)
        if l in exact_layers:
            assert torch.equal(x.to(torch.bfloat16), y.to(torch.bfloat16)), l
        else:
            assert torch.allclose(x, y, rtol=2e-2, atol=2e-2), l
    s1, s2 = analyze(direct, None, ALL_TOKENS), analyze(imported, None, ALL_TOKENS)
    assert s1.tokens_kept == s2.tokens_kept
    assert s1.entropy == pytest.approx(s2.entropy, rel=1e-2)
    assert torch.allclose(torch.tensor(s1.cka), torch.tensor(s2.cka), atol=1e-2)


def test_export_is_what_speculators_reads(tiny_capture, tmp_path):
    cap = tiny_capture
    out = tmp_path / "for-speculators"
    summary = export_states(cap, out, [1, 3])
    assert summary["conversations"] == 6 and "--target-layer-ids 1 3" in summary["train_command"]
    ds = ArrowDataset(max_len=4096, datapath=str(out), on_missing="raise")
    assert len(ds) == 6
    for i, (tok, mask, idx) in enumerate(conversations(cap)):
        x = ds[i]
        assert torch.equal(x["hidden_states"].float(), torch.cat([cap.layer(1, idx), cap.layer(3, idx)], 1))
        assert torch.equal(x["verifier_last_hidden_states"].float(), cap.prenorm_final(idx))
        assert torch.equal(x["input_ids"], tok) and torch.equal(x["loss_mask"].bool(), mask)
        check_hidden_states(__import__("safetensors.torch").torch.load_file(str(out / "hidden_states" / f"hs_{i}.safetensors")),
                            tok.tolist())
    assert find_corrupt_hidden_state_indices(out / "hidden_states", list(range(6))) == {}
    save_token_frequency_distribution(ArrowDataset(4096, str(out), on_missing="raise").data, tmp_path / "freq.pt")
    assert torch.load(tmp_path / "freq.pt") == torch.load(out / "token_freq.pt", weights_only=True)
    with pytest.raises(CaptureError, match="not empty"):
        export_states(cap, out, [1, 3])
    with pytest.raises(CaptureError, match="distinct layers in 0..3"):
        export_states(cap, tmp_path / "other", [1, 4])


def test_speculators_dump_imports_as_the_direct_capture(tiny, tiny_capture, store, tmp_path):
    cap = tiny_capture
    N = cap.num_layers
    root = speculators_dump(cap, tmp_path / "dump", list(range(1, N + 1)), tiny.tokenizer)   # no id 0: computed
    assert len(ArrowDataset(4096, str(root), on_missing="raise")) == 6                    # speculators reads it
    result = import_states(root, "tiny-llama", store, ImportOptions(format="speculators", layers=",".join(map(str, range(1, N)))))
    imported = open_capture(store, result.key)
    info = result.manifest["imported"]
    assert info["computed_layers"] == [0] and info["prenorm_final_engine_id"] == N and info["skipped"] == []
    assert_same_statistics(cap, imported, exact_layers=range(1, N))
    assert torch.equal(imported.prenorm_final().to(torch.bfloat16), cap.prenorm_final().to(torch.bfloat16))
    again = import_states(root, "tiny-llama", store, ImportOptions(format="speculators", layers=",".join(map(str, range(1, N)))))
    assert again.cached and again.key == result.key


def test_export_then_import_round_trip(tiny_capture, store, tmp_path):
    cap = tiny_capture
    export_states(cap, tmp_path / "all", list(range(cap.num_layers)))
    result = import_states(tmp_path / "all", "tiny-llama", store, ImportOptions(format="speculators", layers="all"))
    imported = open_capture(store, result.key)
    for l in range(cap.num_layers):
        assert torch.equal(imported.layer(l), cap.layer(l))
    assert torch.equal(imported.prenorm_final(), cap.prenorm_final())
    assert_same_statistics(cap, imported, exact_layers=range(cap.num_layers))


def test_bad_samples_are_named_and_never_used(tiny, tiny_capture, store, tmp_path):
    cap = tiny_capture
    N = cap.num_layers
    root = speculators_dump(cap, tmp_path / "dump", list(range(N + 1)), tiny.tokenizer)
    hs = root / "hidden_states"
    (hs / "hs_1.safetensors").unlink()                                         # missing
    raw = (hs / "hs_2.safetensors").read_bytes()
    (hs / "hs_2.safetensors").write_bytes(raw[: len(raw) // 2])                # truncated by an interrupted copy
    from safetensors.torch import load_file
    three = load_file(str(hs / "hs_3.safetensors"))
    three["token_ids"] = three["token_ids"].flip(0)
    save_file(three, str(hs / "hs_3.safetensors"))                             # another sample's tokens
    save_file({"token_ids": three["token_ids"]}, str(hs / "hs_4.safetensors"))  # partial
    (hs / "hs_99.safetensors").write_bytes(raw)                                # no data row
    assert set(find_corrupt_hidden_state_indices(hs, [1, 2, 3])) == {2}        # speculators agrees on the truncated one
    result = import_states(root, "tiny-llama", store, ImportOptions(format="speculators"))
    reasons = {s["sample"]: s["reason"] for s in result.skipped}
    assert reasons["hs_1.safetensors"] == "missing"
    assert reasons["hs_2.safetensors"].startswith("unreadable")
    assert reasons["hs_3.safetensors"].startswith("mismatched: its token_ids")
    assert reasons["hs_4.safetensors"].startswith("partial")
    assert reasons["hs_99.safetensors"].startswith("orphan")
    imported = open_capture(store, result.key)
    assert [p["id"] for p in imported.manifest["prompts"]] == ["hs_0.safetensors", "hs_5.safetensors"]
    kept = [c for i, c in enumerate(conversations(cap)) if i in (0, 5)]
    assert torch.equal(imported.tokens()["token_id"], torch.cat([c[0] for c in kept]))
    assert torch.equal(imported.layer(2), torch.cat([cap.layer(2, c[2]) for c in kept]).to(torch.bfloat16).float())


def test_specforge_dump_imports_as_the_direct_capture(tiny_capture, store, tmp_path):
    pytest.importorskip("specforge", reason="the test extra (requirements-speculators.txt)")
    from specforge.data.preprocessing import OfflineEagle3Dataset, list_local_files

    cap = tiny_capture
    root = specforge_dump(cap, tmp_path / "specforge")
    read = OfflineEagle3Dataset(list_local_files(str(root)), max_len=4096)      # SpecForge reads what we laid out
    assert len(read) == 6 and read[0]["hidden_state"].shape[-1] == (cap.num_layers - 1) * cap.hidden_size
    result = import_states(root, "tiny-llama", store, ImportOptions(format="specforge", layers="all"))
    imported = open_capture(store, result.key)
    info = result.manifest["imported"]
    assert info["layer_map"] == {str(l): l - 1 for l in range(1, cap.num_layers)} and info["computed_layers"] == [0]
    assert not imported.manifest["has_prenorm_final"]
    assert_same_statistics(cap, imported, exact_layers=range(1, cap.num_layers + 1))   # 0: computed


def test_layer_ids_are_never_guessed():
    with pytest.raises(CaptureError, match=r"lacks LayerScope layers \[2\]"):
        layer_map("speculators", [1, 3], 4, 3)                  # 1, 3 and the appended last layer
    with pytest.raises(CaptureError, match="hold 5 layer states, --layers names 3"):
        layer_map("speculators", [1, 2, 3], 4, 5)
    with pytest.raises(CaptureError, match="outside SGLang's ids 0..2"):
        layer_map("specforge", [0, 1, 3], 4, 3)
    with pytest.raises(CaptureError, match="no last layer"):
        layer_map("speculators", [0, 1, 2, 3], 4, 4)
    m = layer_map("speculators", [0, 1, 2, 3], 4, 5)
    assert m.engine_ids == [0, 1, 2, 3, 4] and m.prenorm_slot == 4 and m.computed == []


def test_cli_import_and_export(tiny_capture, session_store, tmp_path):
    env_store = ["--store", str(session_store.root)]
    run = lambda *a: subprocess.run([sys.executable, "-m", "layerscope", *a, *env_store], capture_output=True,  # noqa: E731
                                    text=True, timeout=300)
    out = run("export-states", tiny_capture.key[:8], "--layers", "0,1,2,3", "--out", str(tmp_path / "x"), "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["conversations"] == 6
    got = run("import-states", str(tmp_path / "x"), "--format", "speculators", "--model", "tiny-llama", "--json")
    assert got.returncode == 0, got.stderr
    assert json.loads(got.stdout)["tokens"] == tiny_capture.num_tokens
    bad = run("import-states", str(tmp_path / "x"), "--format", "specforge", "--model", "tiny-llama")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    errors = [line for line in bad.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "No usable sample" in errors[0]


def test_open_dump_refuses_a_folder_that_is_not_a_dump(tmp_path):
    with pytest.raises(CaptureError, match="no readable state.json"):
        open_dump("speculators", tmp_path, 64, hidden_states_dir=tmp_path)


def test_target_ends_load_alone_from_a_model_directory(tiny, tmp_path):
    """A model directory: the one-layer model reads only the embedding, final norm and head, and gives the full
    model's hidden_states[0], final norm and token entropy (tied head included)."""
    from transformers import LlamaForCausalLM

    from layerscope.target.ends import TargetEnds
    from layerscope.target.head import predictive_entropy

    for tied in (False, True):
        config = tiny.model.config.__class__.from_dict(tiny.model.config.to_dict() | {"tie_word_embeddings": tied})
        torch.manual_seed(1)
        full = LlamaForCausalLM(config).eval()
        full.save_pretrained(tmp_path / f"m{tied}")
        ends = TargetEnds.load(str(tmp_path / f"m{tied}"))
        assert len(ends.model.model.layers) == 1 and ends.num_layers == config.num_hidden_layers
        ids = torch.randint(0, config.vocab_size, (37,))
        with torch.no_grad():
            out = full.model(input_ids=ids[None], output_hidden_states=True)
            pre = torch.randn(37, config.hidden_size)
            assert torch.equal(ends.embedding(ids), out.hidden_states[0][0])
            assert torch.allclose(ends.final(pre), full.model.norm(pre))
            assert torch.allclose(ends.entropy(out.hidden_states[-1][0]), predictive_entropy(full.lm_head, out.hidden_states[-1][0]))
