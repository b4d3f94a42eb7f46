"""Storage before it is spent: the capture's estimate against the bytes it really writes, the budget that refuses
before anything is written, and the sampled capture (seeded positions, statistics that say so, training refused)."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch

from layerscope.capture import size
from layerscope.capture.run import FORMAT_VERSION, CaptureOptions, capture, capture_key, sample_rows
from layerscope.capture.stored import open_capture
from layerscope.commands import cli
from layerscope.commands.analyze import token_line
from layerscope.draft.training.fit import TrainOptions
from layerscope.errors import CaptureError
from layerscope.prompts.sets import chat_ids, load_prompts
from layerscope.stats.analysis import AnalysisOptions, analyze
from layerscope.steps import workflow
from layerscope.store import make_key

N_SAMPLE = 5


def chunk_bytes(result) -> int:
    return sum((result.path / c["file"]).stat().st_size for c in result.manifest["chunks"])


def test_the_estimate_bounds_the_bytes_a_capture_writes(tiny, store, one_thread):
    prompts = load_prompts("builtin", limit=3, seed=0)
    seen = []
    result = capture(tiny, prompts, store, max_new_tokens=12, batch_size=2,
                     progress=lambda p: p.estimate is not None and seen.append(p.estimate))
    assert len(seen) == 1
    plan = seen[0]
    # tiny-llama: 4 layers of d=64; states 0..4 and the pre-norm final state in float16, 17 bytes of token table
    assert plan.bytes_per_token == 6 * 64 * 2 + 17 == 785
    assert plan.prompt_tokens == sum(len(chat_ids(tiny.tokenizer, p)) for p in prompts.prompts)   # exact
    assert plan.response_tokens == 3 * 12 and plan.tokens == plan.prompt_tokens + plan.response_tokens
    assert plan.free is not None and plan.free > 0
    real, tokens = chunk_bytes(result), result.manifest["tokens"]
    assert tokens <= plan.tokens                                     # responses: an upper bound
    assert tokens * plan.bytes_per_token < real <= plan.total          # the states and table, plus headers
    chunks = len(result.manifest["chunks"])
    assert real - tokens * plan.bytes_per_token <= chunks * size.header_bytes(tiny.num_layers)
    if tokens == plan.tokens:                                        # every answer ran to max_new_tokens
        assert plan.total - real <= chunks * size.header_bytes(tiny.num_layers)


def test_cli_states_the_estimate_and_refuses_over_budget_writing_nothing(tmp_path, capsys, one_thread):
    base = ["capture", "--model", "tiny-llama", "--limit", "2", "--max-new-tokens", "4", "--store", str(tmp_path)]
    assert cli.main(base + ["--max-store-bytes", "1GiB"]) == 0
    err = capsys.readouterr().err
    assert "estimate: 785 bytes per token" in err and "(exact)" in err and "an upper bound" in err
    assert "budget 1.0 GiB" in err and "free on the store's disk" in err
    before = sorted(p.relative_to(tmp_path) for p in (tmp_path / "captures").rglob("*"))
    assert len(before) == 3                      # the first capture: its directory, manifest and one chunk

    code = cli.main(base + ["--limit", "3", "--max-store-bytes", "100k"])
    err = capsys.readouterr().err
    assert code == 2
    refusal = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(refusal) == 1 and "Traceback" not in err
    assert "over the budget of 97.7 KiB (--max-store-bytes)" in refusal[0] and "--sample-positions" in refusal[0]
    after = sorted(p.relative_to(tmp_path) for p in (tmp_path / "captures").rglob("*"))
    assert after == before                                           # no capture, no partial directory

    assert cli.main(base + ["--max-store-bytes", "lots"]) == 2
    assert "'lots' is not a size" in capsys.readouterr().err


def test_a_capture_of_every_position_keeps_its_key(tiny):
    """The new options leave the key of a capture of every position as it was (stores keep serving them)."""
    ps = load_prompts("builtin", limit=2, seed=0)
    old = {k: v for k, v in asdict(CaptureOptions()).items() if k not in ("sample_positions", "max_store_bytes")}
    want = make_key({"model": tiny.fingerprint, "prompts": ps.content_hash, "options": old, "format": FORMAT_VERSION})
    assert capture_key(tiny, ps, CaptureOptions()) == want
    assert capture_key(tiny, ps, CaptureOptions(max_store_bytes=10**9)) == want
    assert capture_key(tiny, ps, CaptureOptions(sample_positions=8)) != want


def test_sample_rows_are_seeded_per_conversation_and_prefer_responses():
    lengths, prompt_lengths = [30, 12, 40], [20, 10, 38]
    rows = sample_rows(lengths, prompt_lengths, 6, seed=0)
    parts = torch.split(rows, [6, 6, 6])
    for part, start, n, p in zip(parts, [0, 30, 42], lengths, prompt_lengths):
        pos = part - start
        assert pos.tolist() == sorted(set(pos.tolist())) and pos.min() >= 1 and pos.max() < n
        responses = n - p
        assert int((pos >= p).sum()) == min(6, responses)            # every response position first
    assert torch.equal(rows, sample_rows(lengths, prompt_lengths, 6, seed=0))
    assert not torch.equal(rows, sample_rows(lengths, prompt_lengths, 6, seed=1))
    # the same conversation draws the same sample whatever its batch: conversation 2 alone, first_conversation=2
    alone = sample_rows(lengths[2:], prompt_lengths[2:], 6, seed=0, first_conversation=2)
    assert torch.equal(alone + 42, parts[2])
    assert torch.equal(sample_rows([3, 1], [1, 1], 6, seed=0), torch.tensor([1, 2]))   # min(s, n - 1), never 0
    assert torch.equal(sample_rows([5], [2], None, seed=0), torch.arange(5))


def test_a_sampled_capture_keeps_true_positions_and_serves_statistics_only(tiny, tiny_capture, session_store, one_thread):
    """The fixture's prompts again (6 builtin, 12 new tokens, batch 4) with --sample-positions: each conversation
    keeps min(N, n - 1) of its positions, with the very states and entropies the full capture has there."""
    prompts = load_prompts("builtin", limit=6, seed=0)
    result = capture(tiny, prompts, session_store, max_new_tokens=12, batch_size=4, sample_positions=N_SAMPLE)
    cap = open_capture(session_store, result.key)
    assert cap.manifest["sample_positions"] == N_SAMPLE == cap.sample_positions
    assert tiny_capture.sample_positions is None
    full, part = tiny_capture.tokens(), cap.tokens()
    lengths = torch.bincount(full["conversation"])
    assert torch.equal(torch.bincount(part["conversation"]), torch.clamp(lengths - 1, max=N_SAMPLE))
    assert int(part["position"].min()) >= 1
    starts = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
    where = starts[part["conversation"]] + part["position"]                # the same tokens in the full capture
    assert torch.equal(full["token_id"][where], part["token_id"])
    assert torch.equal(full["is_response"][where], part["is_response"]) and bool(part["is_response"].all())
    assert torch.allclose(full["entropy"][where], part["entropy"], atol=1e-4)
    assert torch.allclose(tiny_capture.layer(2, where), cap.layer(2), atol=1e-2)

    other = capture(tiny, prompts, session_store, max_new_tokens=12, batch_size=4, sample_positions=N_SAMPLE, seed=1)
    assert not torch.equal(open_capture(session_store, other.key).tokens()["position"], part["position"])

    stats = analyze(cap, None, AnalysisOptions(min_entropy=0.0))
    assert stats.sample_positions == N_SAMPLE and analyze(tiny_capture, None, AnalysisOptions()).sample_positions is None
    assert f"from a sample of at most {N_SAMPLE} positions per conversation" in token_line(stats)

    def no_load(spec, store):
        raise AssertionError("the target was loaded for a capture that is refused")

    for step in (lambda: workflow.train(session_store, cap.key, [1, 2], TrainOptions(steps=1), load=no_load),
                 lambda: workflow.probe_input(session_store, cap.key, load=no_load)):
        with pytest.raises(CaptureError, match=f"Capture {cap.key} keeps a sample of {N_SAMPLE} positions") as e:
            step()
        assert "\n" not in str(e.value) and "without --sample-positions" in e.value.fix
