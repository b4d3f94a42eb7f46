"""Capture: shapes, the layer-index convention, entropies, caching, atomicity, resume, bad input."""

import copy
import json
import subprocess
import sys
from dataclasses import asdict

import pytest
import torch
from transformers import AutoModelForCausalLM, Cohere2Config, Gemma2Config

import layerscope.store as store_mod
from layerscope.capture.run import FORMAT_VERSION, CaptureCancelled, CaptureOptions, capture
from layerscope.capture.stored import list_captures, open_capture
from layerscope.errors import CaptureError
from layerscope.prompts.sets import chat_ids, load_prompts
from layerscope.store import make_key
from layerscope.target.head import head_transform, predictive_entropy


def plain_forward(loaded, ids):
    with torch.no_grad():
        return loaded.model(torch.tensor([ids]), output_hidden_states=True)


def test_capture_shapes_and_token_table(tiny_capture, tiny):
    cap = tiny_capture
    table = cap.tokens()
    n = cap.num_tokens
    assert cap.num_layers == tiny.num_layers and cap.hidden_size == tiny.hidden_size
    assert all(v.shape == (n,) for v in table.values())
    assert table["conversation"].unique().tolist() == list(range(6))
    assert cap.layer(0).shape == (n, 64) and cap.layers([1, 4]).shape == (2, n, 64)
    assert cap.manifest["final_state"] == "post-norm"
    # each conversation: positions count up from 0, responses come after the prompt
    for c in range(6):
        sel = table["conversation"] == c
        assert torch.equal(table["position"][sel], torch.arange(int(sel.sum())))
        resp = table["is_response"][sel]
        assert resp.any() and not resp[0]
        first = int(resp.nonzero()[0])
        assert resp[first:].all()


def test_layer_index_matches_hidden_states_of_a_plain_forward(tiny_capture, tiny):
    cap = tiny_capture
    table = cap.tokens()
    sel = (table["conversation"] == 2).nonzero().squeeze(1)
    ids = table["token_id"][sel].tolist()
    out = plain_forward(tiny, ids)
    for l in range(tiny.num_layers + 1):
        assert torch.allclose(cap.layer(l, sel), out.hidden_states[l][0], atol=2e-2, rtol=1e-2), l
    # state N is after the final norm; the pre-norm output of the last layer is stored beside it
    normed = tiny.model.model.norm(cap.prenorm_final(sel))
    assert torch.allclose(normed, cap.layer(tiny.num_layers, sel), atol=3e-2, rtol=1e-2)


def test_prompt_tokens_are_the_chat_template(tiny_capture, tiny):
    prompts = load_prompts("builtin", limit=6, seed=0)
    table = tiny_capture.tokens()
    sel = (table["conversation"] == 0) & ~table["is_response"]
    assert table["token_id"][sel].tolist() == chat_ids(tiny.tokenizer, prompts.prompts[0])


def test_entropies_match_a_direct_softmax(tiny_capture, tiny):
    table = tiny_capture.tokens()
    sel = (table["conversation"] == 1).nonzero().squeeze(1)
    logits = plain_forward(tiny, table["token_id"][sel].tolist()).logits[0].double()
    p = torch.softmax(logits, -1)
    direct = -(p * p.log()).sum(-1)
    assert torch.allclose(table["entropy"][sel].double(), direct, atol=1e-4)


def test_responses_are_the_targets_greedy_continuation(tiny_capture, tiny):
    table = tiny_capture.tokens()
    sel = table["conversation"] == 3
    ids, resp = table["token_id"][sel], table["is_response"][sel]
    prompt = ids[~resp].tolist()
    with torch.no_grad():
        out = tiny.model.generate(torch.tensor([prompt]), max_new_tokens=int(resp.sum()), do_sample=False,
                                  pad_token_id=tiny.tokenizer.pad_token_id)
    assert out[0, len(prompt):].tolist() == ids[resp].tolist()


def test_subset_reads_equal_full_reads(tiny_capture):
    idx = torch.tensor([7, 0, tiny_capture.num_tokens - 1, 3])
    full = tiny_capture.layer(2)
    assert torch.equal(tiny_capture.layer(2, idx), full[idx])


def test_second_identical_capture_comes_from_the_store(tiny, session_store, tiny_capture):
    prompts = load_prompts("builtin", limit=6, seed=0)
    result = capture(tiny, prompts, session_store, max_new_tokens=12, batch_size=4)
    assert result.cached and result.key == tiny_capture.key


def test_a_bfloat16_target_captures_under_its_own_key(tiny, store):
    """The same prompts captured in bfloat16 (what precision.choose picks on a CPU with AMX) and in float32 are two
    captures: neither is served for the other, each manifest names its dtype, and float32 keeps the key it had
    before the dtype entered the key."""
    prompts = load_prompts("builtin", limit=2, seed=0)
    f32 = capture(tiny, prompts, store, max_new_tokens=4, batch_size=2)
    bf16 = copy.copy(tiny)
    bf16.model, bf16.dtype = copy.deepcopy(tiny.model).to(torch.bfloat16), torch.bfloat16
    b = capture(bf16, prompts, store, max_new_tokens=4, batch_size=2)
    assert not b.cached and b.key != f32.key
    assert open_capture(store, f32.key).manifest["dtype"] == "float32"
    assert open_capture(store, b.key).manifest["dtype"] == "bfloat16"
    opts = {k: v for k, v in asdict(CaptureOptions(max_new_tokens=4, batch_size=2)).items()
            if k not in ("max_store_bytes", "sample_positions")}
    assert f32.key == make_key({"model": tiny.fingerprint, "prompts": prompts.content_hash, "options": opts,
                                "format": FORMAT_VERSION})
    assert capture(tiny, prompts, store, max_new_tokens=4, batch_size=2).cached


def test_cancelled_capture_leaves_no_entry_and_resumes(tiny, store):
    prompts = load_prompts("builtin", limit=4, seed=0)
    calls = []
    with pytest.raises(CaptureCancelled):      # cancelled once the first batch is recorded
        capture(tiny, prompts, store, max_new_tokens=4, batch_size=2, should_stop=lambda: "record" in calls,
                progress=lambda p: calls.append(p.phase))
    assert list_captures(store) == []
    phases = []
    result = capture(tiny, prompts, store, max_new_tokens=4, batch_size=2, progress=lambda p: phases.append(p))
    assert not result.cached
    assert [p.conversations_done for p in phases if p.phase == "record"] == [2]   # only the missing chunk ran
    assert open_capture(store, result.key).tokens()["conversation"].unique().tolist() == [0, 1, 2, 3]


def test_generation_reports_every_token_and_cancels_mid_batch(tiny, store):
    prompts = load_prompts("builtin", limit=2, seed=0)
    seen = []
    with pytest.raises(CaptureCancelled, match="0 of 2 conversations are saved"):
        capture(tiny, prompts, store, max_new_tokens=16, batch_size=2, progress=seen.append,
                should_stop=lambda: any(p.generated >= 3 for p in seen))
    assert seen[0].phase == "estimate" and seen[0].estimate is not None    # stated before the first batch
    assert [p.generated for p in seen[1:]] == [0, 1, 2, 3]       # stopped after the 3rd new token
    assert list_captures(store) == []
    assert list((store.root / "captures").glob("*/chunk-*")) == []   # the cut-short batch was not saved


def test_interrupted_chunk_write_leaves_no_capture(tiny, store, monkeypatch):
    def crash(tensors, path, metadata=None):
        open(path, "wb").write(b"partial")
        raise RuntimeError("killed mid-write")

    monkeypatch.setattr(store_mod, "save_file", crash)
    with pytest.raises(RuntimeError):
        capture(tiny, load_prompts("builtin", limit=2), store, max_new_tokens=3)
    assert list_captures(store) == []
    assert not any(p.suffix == ".safetensors" for p in store.root.rglob("*"))


def test_max_tokens_stops_early(tiny, store):
    result = capture(tiny, load_prompts("builtin", limit=8), store, max_new_tokens=4, batch_size=2, max_tokens=10)
    assert result.manifest["conversations"] == 2


@pytest.mark.parametrize("options, match", [
    ({"limit": 0}, "limit must be at least 1"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"batch_size": 0}, "batch_size"),
])
def test_bad_options_are_refused(tiny, store, options, match):
    with pytest.raises(CaptureError, match=match):
        capture(tiny, load_prompts("builtin", limit=2), store, **options)
    assert list_captures(store) == []


def test_prompt_longer_than_context_is_refused(tiny, store, tmp_path):
    f = tmp_path / "long.txt"
    f.write_text("short prompt\n" + "word " * 1200 + "\n")
    with pytest.raises(CaptureError, match="exceeds the model's context"):
        capture(tiny, load_prompts(str(f)), store, max_new_tokens=8)
    assert not any(store.root.glob("captures/*"))
    kept = capture(tiny, load_prompts(str(f)), store, max_new_tokens=4, skip_long=True)
    assert kept.manifest["conversations"] == 1


def run_cli(*args, store):
    return subprocess.run([sys.executable, "-m", "layerscope.commands.cli", *args, "--store", str(store)],
                          capture_output=True, text=True, timeout=300)


def test_cli_capture_json_then_cached_and_listed(tmp_path):
    args = ["capture", "--model", "tiny-llama", "--prompts", "builtin", "--limit", "3", "--max-new-tokens", "4", "--json"]
    first = run_cli(*args, store=tmp_path)
    assert first.returncode == 0, first.stderr
    out = json.loads(first.stdout)
    assert set(out) == {"key", "model", "num_layers", "hidden_size", "prompts", "tokens", "sample_positions", "cached",
                        "seconds", "path"}
    assert out["sample_positions"] is None
    assert out["num_layers"] == 4 and out["prompts"] == 3 and not out["cached"]
    second = json.loads(run_cli(*args, store=tmp_path).stdout)
    assert second["cached"] and second["key"] == out["key"]
    listed = json.loads(run_cli("captures", "--json", store=tmp_path).stdout)
    assert [r["key"] for r in listed] == [out["key"]]


@pytest.mark.parametrize("args, match", [
    (["--model", "nonsense-model"], "Unknown model spec"),
    (["--model", "/missing/file.gguf"], "does not exist"),
    (["--model", "tiny-llama", "--limit", "0"], "limit"),
    (["--model", "tiny-llama", "--prompts", "/missing/prompts.jsonl"], "prompts.jsonl"),
])
def test_cli_bad_input_exits_2_and_leaves_store_untouched(tmp_path, args, match):
    result = run_cli("capture", *args, store=tmp_path)
    assert result.returncode == 2
    assert match in result.stderr and "Traceback" not in result.stderr
    assert not any((tmp_path / "captures").glob("*")) if (tmp_path / "captures").exists() else True


@pytest.mark.smollm2
def test_smollm2_capture_follows_the_index_convention(smollm2, session_store):
    prompts = load_prompts("builtin", limit=2, seed=0)
    result = capture(smollm2, prompts, session_store, max_new_tokens=8, batch_size=2)
    cap = open_capture(session_store, result.key)
    assert cap.num_layers == 30 and cap.hidden_size == 576
    table = cap.tokens()
    sel = (table["conversation"] == 1).nonzero().squeeze(1)
    out = plain_forward(smollm2, table["token_id"][sel].tolist())
    for l in (0, 2, 15, 27, 30):
        ref = out.hidden_states[l][0]
        err = (cap.layer(l, sel) - ref).abs().max() / ref.abs().max()
        assert err < 1e-2, (l, err)


@pytest.mark.parametrize("config_class, fields", [
    (Gemma2Config, {"final_logit_softcapping": 2.0}),     # a small cap, so the transform changes the distribution
    (Cohere2Config, {"logit_scale": 0.0625}),
])
def test_token_entropy_is_that_of_the_models_own_logits(config_class, fields):
    """A capture's token entropy is the entropy of the distribution the model itself gives, soft cap and logit
    scale included (head.head_transform), not that of the raw lm_head output."""
    torch.manual_seed(0)
    config = config_class(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16, initializer_range=0.5, **fields)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(0, 96, (1, 12))
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
        final = out.hidden_states[-1][0]
        logp = torch.log_softmax(out.logits[0].float(), dim=-1)
        want = -(logp.exp() * logp).sum(-1)
        got = predictive_entropy(model.lm_head, final, *head_transform(model.config))
        raw = predictive_entropy(model.lm_head, final)
    assert torch.allclose(got, want, atol=1e-4)
    assert (raw - want).abs().max() > 0.05              # the transform matters for these families
