"""Benchmark: same prompts for every contender, honest τ / acceptance / speed numbers, the JSON shape."""

from __future__ import annotations

import collections
import copy
import dataclasses
import json
import re

import pytest

from layerscope.commands.cli import main
from layerscope.decoding import bench
from layerscope.decoding.specdec import StepEvent, TreeSpec
from layerscope.draft.checkpoint import load_draft, save_draft
from layerscope.errors import LayerScopeError
from layerscope.prompts.sets import load_prompts
from layerscope.target.load import tiny_model
from tests.helpers import untrained_draft

ENTRY_KEYS = {"name", "tau", "acceptance_by_position", "tokens_per_s", "speedup", "lossless", "mismatched", "by_category",
              "per_prompt", "tau_ci", "speedup_ci", "acceptance", "acceptance_ci", "compared_with"}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def draft_dirs(tiny, tmp_path_factory):
    """Two drafts for the tiny target (different layer sets), saved and loadable the engines' way."""
    root = tmp_path_factory.mktemp("bench-drafts")
    meta = {"target_fingerprint": tiny.fingerprint, "target_model": tiny.spec}
    return [save_draft(root / "low", untrained_draft(tiny.model, layers=(1, 2)), meta),
            save_draft(root / "mixed", untrained_draft(tiny.model, layers=(0, 2, 3), seed=2), meta)]


@pytest.fixture(scope="module")
def prompts(tiny):
    encoded = bench.encode(tiny.tokenizer, load_prompts("builtin", limit=3, seed=1))
    assert len(encoded) == 3
    return encoded


def test_bench_library_run(tiny, draft_dirs, prompts):
    drafts = [(p.name, load_draft(p, tiny)) for p in draft_dirs]
    lineup = bench.build_contenders(drafts, ks=(4,), trees=[TreeSpec(6, 2, 3)], lookup_tokens=5)
    names = [c.name for c in lineup]
    assert names == ["autoregressive", "low chain k=4", "low tree budget=6 top_k=2 depth=3",
                     "mixed chain k=4", "mixed tree budget=6 top_k=2 depth=3", "hf-generate", "hf-prompt-lookup"]
    updates = list(bench.run(tiny.model, prompts, lineup, max_new_tokens=10, eos_token_id=tiny.tokenizer.eos_token_id,
                             pad_token_id=tiny.tokenizer.pad_token_id))
    report = updates[-1].report
    assert report is not None and all(u.report is None for u in updates[:-1])
    assert updates[-2].runs_done == updates[-2].runs_total == len(prompts) * len(lineup)
    doc = report.to_json()
    assert set(doc) == {"prompts", "max_new_tokens", "device", "results", "intervals"}
    assert (doc["prompts"], doc["max_new_tokens"], doc["device"]) == (len(prompts), 10, "cpu")
    assert doc["intervals"] == {"level": 0.95, "draws": 2000, "over": "prompts", "prompts": 3,
                                "reference": "low chain k=4"}
    results = {r["name"]: r for r in doc["results"]}
    assert list(results) == names
    for r in doc["results"]:
        peer = r["name"] in ("autoregressive", "hf-generate", "hf-prompt-lookup")
        extra = set() if peer else {"layers", "decoding", "spec_decode"}
        if r["name"] not in ("autoregressive", "low chain k=4"):
            extra.add("paired")
        assert set(r) == ENTRY_KEYS | extra
        assert r["lossless"] is True, r["name"]               # every output equals plain greedy output
        assert r["compared_with"] == ("hf-generate" if r["name"] == "hf-prompt-lookup" else "autoregressive")
        assert r["tokens_per_s"] > 0 and r["speedup"] > 0
        assert set(r["by_category"]) == {p.category for p in prompts}
    assert results["autoregressive"]["tau"] == 1.0 and results["autoregressive"]["speedup"] == 1.0
    assert results["hf-generate"]["tau"] == 1.0               # counted forwards: one per token
    assert results["hf-prompt-lookup"]["tau"] >= 1.0
    assert results["mixed chain k=4"]["layers"] == [0, 2, 3]
    assert len(results["low chain k=4"]["acceptance_by_position"]) == 4
    assert 1 <= len(results["low tree budget=6 top_k=2 depth=3"]["acceptance_by_position"]) <= 3   # the tree's depth
    # τ and acceptance agree with the step events the run streamed
    for name in ("low chain k=4", "mixed tree budget=6 top_k=2 depth=3"):
        events = [u.event for u in updates if u.contender == name and isinstance(u.event, StepEvent)]
        tokens, forwards = sum(len(e.tokens) for e in events), len(events)
        assert results[name]["tau"] == pytest.approx(tokens / forwards)
        first = [e.accepted_mask[0] for e in events if e.accepted_mask]
        assert results[name]["acceptance_by_position"][0] == pytest.approx(sum(first) / len(first))
        assert [u.tau for u in updates if u.contender == name][-1] == pytest.approx(results[name]["tau"])
        own = [e for e in events if e.accepted_mask]                    # vLLM's names count what the run streamed
        m = results[name]["spec_decode"]
        assert (m["num_drafts"], m["num_draft_tokens"], m["num_accepted_tokens"]) == (
            len(own), sum(e.drafted for e in own), sum(e.accepted for e in own))
        assert sum(m["num_accepted_tokens_per_pos"]) == m["num_accepted_tokens"]
        assert m["mean_acceptance_length"] == pytest.approx(1 + m["num_accepted_tokens"] / m["num_drafts"])
    text = bench.format_table(report)
    assert "hf-prompt-lookup" in text and "acc@4" in text and "NO" not in text
    assert "num_accepted_tokens_per_pos" in text and "mean_acceptance_length" in text
    assert "95% bootstrap intervals over the 3 prompts" in text


def test_a_chain_with_prompt_lookup_counts_the_lookup_steps_apart(tiny, draft_dirs, prompts):
    """`draft_lookup`: each chain also with prompt lookup first; lossless; the lookup steps are counted in
    `lookup` and kept out of the draft's acceptance by position, which its own steps alone give."""
    drafts = [(p.name, load_draft(p, tiny)) for p in draft_dirs[:1]]
    lineup = bench.build_contenders(drafts, ks=(2,), peers=False, draft_lookup=3)
    assert [c.name for c in lineup] == ["autoregressive", "low chain k=2", "low chain k=2 + lookup 3"]
    repetitive = [dataclasses.replace(p, input_ids=p.input_ids + p.input_ids[-8:] * 3) for p in prompts]
    updates = list(bench.run(tiny.model, repetitive, lineup, max_new_tokens=16, warmup=False))
    entry = {r["name"]: r for r in updates[-1].report.results}["low chain k=2 + lookup 3"]
    events = [u.event for u in updates if u.contender == "low chain k=2 + lookup 3" and u.event is not None]
    looked = [e for e in events if e.proposer == "lookup"]
    own = [e for e in events if e.proposer == "draft" and e.accepted_mask]
    assert looked and entry["lossless"]
    sizes = collections.Counter(e.drafted for e in looked)
    assert entry["lookup"] == {"steps": len(looked), "draft_steps": len(own), "drafted": sum(e.drafted for e in looked),
                               "accepted": sum(e.accepted for e in looked),
                               "sizes": {str(n): sizes[n] for n in sorted(sizes)}}
    assert entry["acceptance_by_position"][0] == pytest.approx(sum(e.accepted_mask[0] for e in own) / len(own))
    assert entry["spec_decode"]["num_drafts"] == len(own)                # vLLM's names: the draft's own steps
    assert entry["spec_decode"]["num_accepted_tokens"] == sum(e.accepted for e in own)
    assert "low chain k=2 + lookup 3: prompt lookup proposed" in bench.format_table(updates[-1].report)
    with pytest.raises(LayerScopeError, match="--lookup"):
        bench.BenchOptions(draft_lookup=-1).validate()


def test_bench_intervals_over_prompts(tiny, draft_dirs, prompts):
    """Per-prompt totals add up to the entry; every interval holds its point estimate; contenders that
    decode one token per forward have τ exactly [1, 1]; plain decoding's speedup is exactly [1, 1]; the
    paired differences are against the first draft and agree with the point estimates."""
    drafts = [(p.name, load_draft(p, tiny)) for p in draft_dirs]
    lineup = bench.build_contenders(drafts, ks=(3,), lookup_tokens=5)
    report = bench.measure(tiny, prompts, lineup, 12)
    results = {r["name"]: r for r in report.results}
    for name, r in results.items():
        p = r["per_prompt"]
        assert all(len(v) == len(prompts) for v in p.values())
        assert sum(p["tokens"]) / sum(p["forwards"]) == pytest.approx(r["tau"])
        assert sum(p["tokens"]) / sum(p["seconds"]) == pytest.approx(r["tokens_per_s"])
        lo, hi = r["tau_ci"]
        assert lo <= r["tau"] <= hi, name
        lo, hi = r["speedup_ci"]
        assert 0 < lo <= r["speedup"] <= hi, name
    for name in ("autoregressive", "hf-generate"):
        assert results[name]["tau_ci"] == [1.0, 1.0] and results[name]["acceptance_ci"] is None
    assert results["autoregressive"]["speedup_ci"] == [1.0, 1.0]
    low, mixed = results["low"], results["mixed"]
    assert low["acceptance_ci"][0] <= low["acceptance"] <= low["acceptance_ci"][1]
    assert sum(low["per_prompt"]["accepted"]) / sum(low["per_prompt"]["drafted"]) == pytest.approx(low["acceptance"])
    assert "paired" not in low and "paired" not in results["autoregressive"]
    assert mixed["paired"]["vs"] == "low"
    assert mixed["paired"]["tau"]["delta"] == pytest.approx(mixed["tau"] - low["tau"])
    lo, hi = mixed["paired"]["tau"]["ci"]
    assert lo <= mixed["paired"]["tau"]["delta"] <= hi
    assert results["hf-generate"]["paired"]["tau"]["delta"] == pytest.approx(1.0 - low["tau"])
    # one prompt: no interval is claimed
    single = bench.measure(tiny, prompts[:1], lineup[:2], 6)
    assert single.intervals is None and "tau_ci" not in single.results[1]
    assert "bootstrap" not in bench.format_table(single)


def test_hf_peers_decode_plain_greedy_whatever_the_generation_config(prompts):
    """generate fills unset options from model.generation_config; a penalty there would make the peers
    differ from greedy (and be flagged lossy). The bench runs them bare and leaves the config alone."""
    model = tiny_model().model
    model.generation_config.repetition_penalty = 3.0
    model.generation_config.no_repeat_ngram_size = 2
    lineup = bench.build_contenders([], peers=True, lookup_tokens=3)
    updates = list(bench.run(model, prompts[:2], lineup, max_new_tokens=10, eos_token_id=None, pad_token_id=0,
                             warmup=False))
    assert [r["lossless"] for r in updates[-1].report.results] == [True, True, True]
    assert model.generation_config.repetition_penalty == 3.0


def test_bench_cli_json_and_table(tiny, draft_dirs, tmp_path, capsys):
    args = ["bench", "--store", str(tmp_path / "store"), "--model", "tiny-llama", "--draft", str(draft_dirs[0]),
            "--prompts", "builtin", "--limit", "3", "--max-new-tokens", "6", "--k", "3"]
    assert main(args + ["--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) == {"prompts", "max_new_tokens", "device", "results", "cost_curve", "draft_step_seconds",
                        "intervals", "machine", "cost_curve_machine", "dtype", "dtype_why", "row_align"}
    assert doc["dtype"] == "float32"           # tiny-llama: built in float32
    assert [r["name"] for r in doc["results"]] == ["autoregressive", "low", "hf-generate", "hf-prompt-lookup"]
    assert doc["intervals"]["reference"] == "low" and doc["intervals"]["prompts"] == 3
    for r in doc["results"]:          # the same intervals the library computes, printed as JSON
        assert r["tau_ci"][0] <= r["tau"] <= r["tau_ci"][1] and len(r["per_prompt"]["tokens"]) == 3
    assert doc["results"][1]["layers"] == [1, 2] and all(r["lossless"] for r in doc["results"])
    without_model = [a for a in args if a not in ("--model", "tiny-llama")]    # taken from the draft's meta
    saved = tmp_path / "runs" / "bench.json"
    assert main(without_model + ["--no-peers", "--tree", "--save-json", str(saved)]) == 0
    out = capsys.readouterr().out
    kept = json.loads(saved.read_text())                  # the table printed, the JSON kept beside it
    assert [r["name"] for r in kept["results"]][0] == "autoregressive" and kept["prompts"] == 3
    assert "on tiny-llama" in out
    assert "low chain k=3" in out and "low tree" in out and "hf-generate" not in out
    assert re.search(r"low chain k=3 .* \d\.\d{3} \[\d\.\d{3}, \d\.\d{3}\]", out)     # τ with its interval (fmt.interval)


def test_bench_refuses_a_draft_for_another_target(tmp_path, capsys):
    other = tiny_model(num_layers=6, hidden_size=32, seed=1, spec="tiny-llama:layers=6,hidden=32,seed=1")
    path = save_draft(tmp_path / "foreign", untrained_draft(other.model, layers=(1, 4)),
                      {"target_fingerprint": other.fingerprint, "target_model": other.spec})
    code = main(["bench", "--store", str(tmp_path / "store"), "--model", "tiny-llama", "--draft", str(path),
                 "--prompts", "builtin", "--limit", "1", "--max-new-tokens", "4"])
    assert code == 2
    err = capsys.readouterr().err
    assert "does not fit" in err and "tiny-llama" in err


def test_contender_names_tell_drafts_apart(tiny):
    a, b = untrained_draft(tiny.model, layers=(1, 2)), untrained_draft(tiny.model, layers=(0, 3))
    assert bench.unique_names(["x", "y"], [a, b]) == ["x", "y"]
    assert bench.unique_names(["d", "d"], [a, b]) == ["d [1, 2]", "d [0, 3]"]
    assert bench.unique_names(["d", "d", "e"], [a, a, b]) == ["d [1, 2]#1", "d [1, 2]#2", "e"]


def test_stop_tokens_eos_from_the_generation_config_and_pad_falls_back_to_eos(tiny):
    assert bench.stop_tokens(tiny) == (257, 258)
    no_pad = copy.deepcopy(tiny.tokenizer)
    no_pad.pad_token = None
    assert bench.stop_tokens(dataclasses.replace(tiny, tokenizer=no_pad)) == (257, 257)
    config = copy.deepcopy(tiny.model.generation_config)
    config.eos_token_id = [257, 10]
    model = copy.copy(tiny.model)
    model.generation_config = config
    assert bench.stop_tokens(dataclasses.replace(tiny, model=model, tokenizer=no_pad)) == ([257, 10], None)


def test_the_acceptance_histogram_has_vllms_names_and_counts():
    """Planted steps: a prefill, five chain steps of depth 4 accepting 0, 2, 4, 1, 4 tokens, one of depth 2 (the
    end of the budget) accepting 1, one that drafted nothing and one prompt lookup step accepting 3 of 3.
    vLLM counts the six draft steps: 22 draft tokens, 12 accepted, by position 5, 3, 2, 2 (steps that accepted
    at least 1, 2, 3, 4), mean acceptance length 1 + 12 / 6 = 3."""
    def step(depth, accepted, proposer="draft"):
        mask = tuple(i < accepted for i in range(depth))
        return StepEvent(1, depth, accepted, mask, 7, (7,) * (accepted + 1), 0.01, proposer)
    t = bench.Tally()
    for e in [StepEvent(0, 0, 0, (), 7, (7,), 0.01, "none"), step(4, 0), step(4, 2), step(4, 4), step(4, 1),
              step(4, 4), step(2, 1), step(0, 0), step(3, 3, "lookup")]:
        t.add_event(e)
    assert t.spec_decode() == {"num_drafts": 6, "num_draft_tokens": 22, "num_accepted_tokens": 12,
                               "num_accepted_tokens_per_pos": [5, 3, 2, 2], "mean_acceptance_length": 3.0}
    assert t.acceptance_by_position() == [5 / 6, 3 / 6, 2 / 5, 2 / 5]    # the depth-2 step drafted positions 1-2
    assert bench.Tally().spec_decode()["mean_acceptance_length"] is None


def test_lookup_auto_lands_on_its_chain_and_says_why_in_one_line():
    """`--lookup auto` markers (kind "declined") leave the line-up, each choice moving to the first chain of its
    draft and depth that decodes without lookup; the line says what was chosen or why nothing was."""
    a, b = object(), object()
    declined = {"k": 2, "chosen": None, "best": {"label": "lookup 2", "speedup": 0.9, "lookup_share": 0.04,
                                                 "lookup_tau": 1.5},
                "alone": {"label": "no lookup", "speedup": 1.1, "lookup_share": 0.0, "lookup_tau": None}}
    lineup = [bench.Contender("autoregressive", "autoregressive", "greedy"),
              bench.Contender("a chain k=1", "draft", "chain k=1", a, 1),
              bench.Contender("a chain k=2", "draft", "chain k=2", a, 2),
              bench.Contender("b", "draft", "chain k=2", b, 2),
              bench.Contender("a auto chain k=2", "draft", "auto: chain k=2", a, 2, auto={"k": 2}),
              bench.Contender("a chain k=2 declined lookup", "declined", "", a, 2, lookup_auto=declined),
              bench.Contender("b chain k=2 declined lookup", "declined", "", b, 2, lookup_auto=declined | {"k": 3}),
              bench.Contender("a auto tree", "draft", "auto: tree", a, 4, TreeSpec(6, 2, 3), auto={"tree": {}}),
              bench.Contender("a tree declined lookup", "declined", "", a, 4, TreeSpec(6, 2, 3),
                              lookup_auto=declined | {"k": 4, "tree": {"budget": 6, "top_k": 2, "depth": 3}})]
    out = bench.lookup_declined(lineup)
    assert [c.name for c in out] == ["autoregressive", "a chain k=1", "a chain k=2", "b", "a auto chain k=2",
                                     "a auto tree"]
    assert [c.lookup_auto for c in out] == [None, None, declined, declined | {"k": 3}, None, lineup[-1].lookup_auto]
    assert bench.lookup_auto_note({"name": "a auto tree", "lookup_auto": out[-1].lookup_auto}).startswith(
        "a auto tree: --lookup auto chose no lookup for tree budget=6 top_k=2 depth=3: the best span, lookup 2")
    assert bench.lookup_auto_note({"name": "a chain k=2", "lookup_auto": declined}) == (
        "a chain k=2: --lookup auto chose no lookup for chain k=2: the best span, lookup 2, was predicted 0.90x, "
        "not above 1.10x without lookup (lookup proposed 4% of the calibration's steps, 1.50 tokens each)")
    chosen = declined | {"chosen": {"start": 4, "cap": 16}, "best": declined["best"] | {"label": "lookup 4..16",
                                                                                       "speedup": 1.6}}
    assert bench.lookup_auto_note({"name": "a auto chain k=2 + lookup 4..16", "lookup_auto": chosen,
                                   "speedup": 1.45}) == (
        "a auto chain k=2 + lookup 4..16: --lookup auto chose lookup 4..16 (adaptive) for chain k=2: predicted 1.60x "
        "against 1.10x without lookup (lookup proposed 4% of the calibration's steps, 1.50 tokens each); measured 1.45x")
    assert bench.parse_lookup("auto") == (0, True) and bench.parse_lookup("3") == (3, False)
    assert bench.parse_lookup(" 4..16 ") == (bench.LookupSpan(4, 16), False) and bench.parse_lookup(0) == (0, False)


def test_the_verdict_says_so_when_the_run_measured_otherwise_than_the_curve_predicts():
    assert bench.verdict(2.18, 1.33, "chain k=3") == ("tau 2.180 is above the break-even tau 1.330 of chain k=3: "
                                                      "the cost curve predicts it pays on this machine (not measured)")
    assert bench.verdict(2.18, 1.33, "chain k=3", measured=1.2).endswith(": it pays here (1.20x)")
    # the measurement decides: "pays" only above 1x, whatever break-even it was handed
    lost = bench.verdict(2.18, 1.33, "chain k=3", measured=0.70)
    assert lost.startswith("tau 2.180 is above the break-even tau 1.330 of chain k=3, yet it does not pay here (0.70x")
    assert "the run is what happened" in lost and "it pays" not in lost
    won = bench.verdict(1.2, 1.6, "chain k=1", measured=1.05)
    assert "yet it pays here (1.05x)" in won
    entry = {"name": "d auto chain k=5", "chosen": {"k": 5}, "calibrated": {"speedup": 1.62}, "speedup": 0.94,
             "predicted_speedup": 1.5}
    assert bench.auto_note(entry).endswith("measured 0.94x (1.50x predicted from its measured tau): the pick lost "
                                           "to plain decoding in this run")
    assert "lost" not in bench.auto_note({**entry, "speedup": 1.1})
