"""Online draft training on tiny-llama: same loss as capture training on the same data, k sets in one pass
equal to k separate runs, resume equal to an uninterrupted run, kill -9 leaves a usable checkpoint."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from layerscope.capture.run import CaptureOptions
from layerscope.commands.cli import main
from layerscope.draft.checkpoint import read_meta
from layerscope.draft.model import DraftConfig, DraftHead, build_draft_vocab
from layerscope.draft.training.checkpoints import complete_checkpoints
from layerscope.draft.training.data import make_batch, target_argmax, windows_of
from layerscope.draft.training.fit import TrainingCancelled
from layerscope.draft.training.loss import Teacher, evaluate, ttt_loss
from layerscope.draft.training.online import OnlineOptions, epoch_batches, split_for, target_features, train_online
from layerscope.draft.training.responses import Conversations, first_reply, load_conversations
from layerscope.draft.training.train import load_splits
from layerscope.errors import DraftError
from layerscope.prompts.kinds import KINDS, kind_of
from layerscope.prompts.sets import load_prompts
from layerscope.prompts.sharegpt import is_heldout
from layerscope.steps import forecast, workflow
from layerscope.store import Store
from layerscope.study.outcomes import OutcomeError, OutcomeFolder
from layerscope.study.run import StudyOptions, format_study, run_study
from layerscope.target import shape
from layerscope.ui import tasks
from layerscope.ui.jobs import JobManager
from tests.helpers import SMALL_ONLINE as SMALL


def weights(path) -> dict:
    return load_file(str(Path(path) / "model.safetensors"))


def same_weights(a, b) -> bool:
    wa, wb = weights(a), weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_online_options_need_one_budget_and_a_known_response_mode():
    for kw in ({}, {"steps": 3, "tokens": 100}, {"time_s": float("nan")}, {"steps": 3, "responses": "mine"}):
        with pytest.raises(DraftError):
            OnlineOptions(**kw).validate()


def test_epoch_batches_are_seeded_and_cover_every_conversation():
    lengths = [5 + (i * 7) % 13 for i in range(50)]
    b = epoch_batches(lengths, 4, seed=1, epoch=0)
    assert b == epoch_batches(lengths, 4, seed=1, epoch=0) and b != epoch_batches(lengths, 4, seed=1, epoch=1)
    assert sorted(i for batch in b for i in batch) == list(range(50))


def test_online_features_give_the_capture_loss_on_the_same_data(tiny, tiny_capture, one_thread):
    """The same conversations, recorded by a capture or run through the target inside the loop, give the same
    draft inputs and the same TTT loss (both store the states as float16)."""
    cap, layers, J = tiny_capture, [1, 3], 3
    tok = cap.tokens()
    first = tok["conversation"] < 4                               # the capture's first batch: conversations 0..3
    train, _ = load_splits(cap, ~first, layers)                   # "held out" = everything else
    convs = Conversations([], [], [], "x")
    for c in range(4):
        rows = tok["conversation"] == c
        ids, resp = tok["token_id"][rows].tolist(), tok["is_response"][rows]
        convs.prompt.append(ids[: int((~resp).sum())])
        convs.response.append(ids[int((~resp).sum()):])
    rows, feats = target_features(tiny, convs, [0, 1, 2, 3], layers)
    online = split_for(rows, feats, layers, tiny.num_layers)
    assert torch.equal(online.token_id, train.token_id) and torch.equal(online.counted, train.counted)
    assert torch.allclose(online.aux.float(), train.aux.float(), atol=2e-3)
    assert torch.allclose(online.final.float(), train.final.float(), atol=2e-3)

    embed, lm_head = tiny.model.get_input_embeddings().weight, tiny.model.get_output_embeddings().weight
    d2t, t2d = build_draft_vocab(train.token_id, 64, embed.shape[0])
    teacher = Teacher.of(tiny.model.config, lm_head, d2t, "cpu")
    torch.manual_seed(0)
    head = DraftHead(DraftConfig.from_target(tiny.model.config, layers, len(d2t)), embed, d2t, t2d)
    losses = []
    for sp in (train, online):
        nxt = torch.zeros_like(sp.token_id)
        nxt[:-1] = sp.token_id[1:]
        ok = sp.counted & t2d[nxt]
        losses.append(ttt_loss(head, make_batch(sp, windows_of(sp, 64, ok, J), J, ok, "cpu"), teacher)[0].item())
    assert losses[0] > 0 and abs(losses[0] - losses[1]) < 1e-3 * losses[0], losses


def test_validation_counts_every_position_and_reports_coverage(tiny, tiny_capture, one_thread):
    cap, layers, J = tiny_capture, [2], 2
    train, _ = load_splits(cap, torch.zeros(cap.num_tokens, dtype=torch.bool), layers)
    lm_head = tiny.model.get_output_embeddings().weight
    train.target_next = target_argmax(train.final, lm_head)
    embed = tiny.model.get_input_embeddings().weight
    for V in (4, 256):
        d2t, t2d = build_draft_vocab(train.token_id, V, embed.shape[0])
        head = DraftHead(DraftConfig.from_target(tiny.model.config, layers, len(d2t)), embed, d2t, t2d)
        teacher = Teacher.of(tiny.model.config, lm_head, d2t, "cpu")
        acc, _, n, cov = evaluate(head, train, windows_of(train, 64, train.counted, J), J, teacher, 4, "cpu")
        assert n == int(train.counted.sum())                      # every counted position, in the vocabulary or not
        covered = float(t2d[train.target_next[train.counted]].float().mean())
        assert cov == pytest.approx(covered) and acc[0] <= cov + 1e-9
        assert (cov < 1) == (V == 4)


def test_k_sets_in_one_pass_equal_k_separate_runs_and_are_served_again(tiny, tmp_path, one_thread):
    store = Store(tmp_path / "s")
    both = train_online(tiny, [[1, 2], [0, 3]], store, steps=5, **SMALL)
    alone = [train_online(tiny, [s], store, steps=5, **SMALL).drafts[0] for s in ([1, 2], [0, 3])]
    assert [d.layers for d in both.drafts] == [[1, 2], [0, 3]]
    for d, a in zip(both.drafts, alone):
        assert same_weights(d.path, a.path) and d.val_accuracy == a.val_accuracy and d.tokens_seen == a.tokens_seen
        assert len(d.curve) == 2 and d.curve[-1][0] == d.tokens_seen and len(d.curve[-1][1]) == 3
        meta = json.loads((Path(d.path) / "layerscope.json").read_text())
        assert meta["layers"] == d.layers and meta["curve"] == d.curve and meta["online"]["responses"] == "regenerate"
    assert not both.resumed and not both.cached
    again = train_online(tiny, [[1, 2], [0, 3]], store, steps=5, **SMALL)
    assert again.cached and [d.path for d in again.drafts] == [d.path for d in both.drafts]
    responses = list((store.root / "responses").iterdir())
    assert len(responses) == 1                                    # every run reused the one set of responses


def test_resume_ends_with_the_same_drafts_as_an_uninterrupted_run(tiny, tmp_path, one_thread):
    sets = [[1, 3], [0, 2]]
    whole = train_online(tiny, sets, Store(tmp_path / "a"), steps=8, **SMALL)
    store = Store(tmp_path / "b")
    calls = []

    def stop_after_4():
        return sum(1 for p in calls if p.phase == "train") >= 4

    with pytest.raises(TrainingCancelled):              # a checkpoint after every step, the last at step 4
        train_online(tiny, sets, store, steps=8, progress=calls.append, should_stop=stop_after_4,
                     checkpoint_every_s=1e-9, **SMALL)
    run_dir = next((store.root / "runs").iterdir())
    assert [p.name for p in complete_checkpoints(run_dir)] == ["ckpt-000000004"]
    ckpt = complete_checkpoints(run_dir)[0]                          # readable by a store's other users
    assert [oct(p.stat().st_mode & 0o777) for p in (ckpt, *sorted(ckpt.iterdir()))] == ["0o755", "0o644", "0o644"]
    assert not (store.root / "drafts").exists() or not any((store.root / "drafts").iterdir())
    # debris of a checkpoint that was being written when the process died is never used
    (run_dir / ".layerscope-staging" / "ckpt-000000009.1.dead").mkdir(parents=True)
    (run_dir / "ckpt-000000007").mkdir()                             # no state.json: incomplete
    resumed = train_online(tiny, sets, store, steps=8, **SMALL)
    assert resumed.resumed
    for a, b in zip(resumed.drafts, whole.drafts):
        assert same_weights(a.path, b.path) and a.curve == b.curve
    # each draft says how its training went: started twice, resumed once at step 4; the uninterrupted one once
    went, straight = (json.loads((Path(d.path) / "layerscope.json").read_text())["history"]
                      for d in (resumed.drafts[0], whole.drafts[0]))
    assert (went["starts"], went["resumed"], [r["step"] for r in went["resumed_at"]]) == (2, 1, [4])
    assert (straight["starts"], straight["resumed"], straight["resumed_at"]) == (1, 0, [])
    assert went["wall_s"] >= 0 and went["first_start"] <= went["finished"]
    # a damaged checkpoint is one clear error naming it, never a traceback or a silent restart
    other, seen = Store(tmp_path / "c"), []
    with pytest.raises(TrainingCancelled):
        train_online(tiny, [[1, 3]], other, steps=8, progress=seen.append,
                     should_stop=lambda: any(p.phase == "train" for p in seen), **SMALL)
    ckpt = complete_checkpoints(next((other.root / "runs").iterdir()))[-1]
    (ckpt / "tensors.safetensors").write_bytes(b"garbage")
    with pytest.raises(DraftError, match="cannot be read"):
        train_online(tiny, [[1, 3]], other, steps=8, **SMALL)


CHILD = """
import sys, torch
torch.set_num_threads(1)
from layerscope.target.load import load_model
from layerscope.store import Store
from layerscope.draft.training.online import train_online
opts = dict(prompts="builtin", limit=12, max_new_tokens=10, batch_size=3, seq_len=64, gen_batch_size=4,
            val_conversations=2, eval_points=2, draft_vocab=64)
train_online(load_model("tiny-llama"), [[1, 3]], Store(sys.argv[1]), steps=400, checkpoint_every_s=1e-6, **opts)
"""


def test_kill_9_during_checkpointing_leaves_a_usable_checkpoint(tiny, tmp_path, one_thread):
    store_dir = tmp_path / "k"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for delay in (0.0, 0.13):
        proc = subprocess.Popen([sys.executable, "-c", CHILD, str(store_dir)], env=env)
        deadline = time.time() + 120
        while time.time() < deadline and not (store_dir / "runs").is_dir():
            time.sleep(0.05)
        run_dirs = list((store_dir / "runs").iterdir()) if (store_dir / "runs").is_dir() else []
        while time.time() < deadline and not (run_dirs and complete_checkpoints(run_dirs[0])):
            time.sleep(0.05)
            run_dirs = list((store_dir / "runs").iterdir())
        time.sleep(delay)                      # checkpoints are written after every step: the kill lands in one often
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        ckpts = complete_checkpoints(run_dirs[0])
        assert ckpts, "no complete checkpoint survived the kill"
        state = json.loads((ckpts[-1] / "state.json").read_text())
        assert state["step"] >= 1 and load_file(str(ckpts[-1] / "tensors.safetensors"))
    # the run picks up from the newest complete checkpoint: its first step is the one after it
    calls = []
    with pytest.raises(TrainingCancelled):
        train_online(tiny, [[1, 3]], Store(store_dir), steps=400, checkpoint_every_s=1e9, progress=calls.append,
                     should_stop=lambda: any(p.phase == "train" for p in calls), **SMALL)
    assert next(p for p in calls if p.phase == "train").step == state["step"] + 1


def test_own_responses_are_the_conversations_first_assistant_turns(tiny, tmp_path):
    with pytest.raises(DraftError, match="assistant turns"):
        load_conversations(tiny, OnlineOptions(prompts="builtin", limit=3, responses="own", steps=1), Store(tmp_path))
    assert first_reply({"conversations": [{"from": "gpt", "value": "hi"}, {"from": "human", "value": "q"},
                                          {"from": "gpt", "value": " "}, {"from": "gpt", "value": "answer"}]}) == "answer"
    assert first_reply({"conversations": [{"from": "human", "value": "q"}]}) is None
    store = Store(tmp_path / "s")
    convs = load_conversations(tiny, OnlineOptions(prompts="sharegpt", limit=4, responses="own", max_new_tokens=20,
                                                   steps=1), store)
    assert 1 <= len(convs) <= 4 and all(c.startswith("sharegpt/") for c in convs.ids)
    eos = tiny.tokenizer.eos_token_id
    for p, r in zip(convs.prompt, convs.response):
        assert p and 2 <= len(r) <= 21 and r[-1] == eos
    assert not (store.root / "responses").exists()                  # own answers: nothing is generated or stored


def test_cli_trains_several_sets_online_and_returns_them_again(tiny, tmp_path, capsys, one_thread):
    args = ["train-draft", "--model", "tiny-llama", "--prompts", "builtin", "--limit", "12", "--max-new-tokens", "10",
            "--layers", "1,2", "--layers", "0,3", "--steps", "3", "--batch-size", "3", "--seq-len", "64",
            "--draft-vocab", "64", "--val-conversations", "2", "--json", "--store", str(tmp_path / "s")]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) >= {"drafts", "seconds", "tokens_per_s", "resumed"} and not out["resumed"]
    assert [d["layers"] for d in out["drafts"]] == [[1, 2], [0, 3]]
    for d in out["drafts"]:
        assert set(d) >= {"layers", "path", "tokens_seen", "val_accuracy", "curve"} and len(d["val_accuracy"]) == 3
        a1, a2, a3 = d["val_accuracy"]                  # SpecForge's Σ∏ of the reported agreement, no bonus token
        assert d["simulated_acc_len"] == pytest.approx(a1 + a1 * a2 + a1 * a2 * a3, abs=1e-5)
        assert read_meta(d["path"])["simulated_acc_len"] == d["simulated_acc_len"]
    assert main(args) == 0
    again = json.loads(capsys.readouterr().out)
    assert [d["path"] for d in again["drafts"]] == [d["path"] for d in out["drafts"]] and again["cached"]
    assert [d["simulated_acc_len"] for d in again["drafts"]] == [d["simulated_acc_len"] for d in out["drafts"]]
    assert main(["train-draft", "--model", "tiny-llama", "--layers", "1,9", "--steps", "3",
                 "--store", str(tmp_path / "s")]) == 2
    assert "out of range" in capsys.readouterr().err


def test_study_trains_its_sets_online_in_one_pass(tiny, tiny_capture, session_store, one_thread):
    online = OnlineOptions(**SMALL, steps=3)
    options = StudyOptions(strategies=("default", "entropy-topk"), extra_sets=((0, 3),), k=2, online=online,
                           prompts="builtin", limit=2, max_new_tokens=6, depth=2, kernels=("linear",), filters=(0.0,))
    report = run_study(tiny_capture, tiny, session_store, options)
    metas = [json.loads((Path(r.draft) / "layerscope.json").read_text()) for r in report.rows]
    assert len(metas) >= 2 and len({m["run_key"] for m in metas}) == 1          # one pass trained every set
    assert [m["layers"] for m in metas] == [r.layers for r in report.rows]
    assert all(m["online"]["responses"] == "regenerate" and r.tau is not None for m, r in zip(metas, report.rows))
    assert all(r.seeds[0]["curve"] == m["curve"] and m["curve"] for m, r in zip(metas, report.rows))   # learning curves
    header = format_study(report).splitlines()[0]
    assert "online training (" in header and "steps=3" in header and "training steps per draft" not in header


def test_a_study_records_its_paces_so_the_next_estimate_is_measured(tiny, tiny_capture, tmp_path, one_thread):
    """An online study's passes and benchmark record this machine's pace (forecast.online_measured, bench), as
    train-draft and bench do: the next study's estimate says it is measured here, not the rule of thumb."""
    store = Store(tmp_path / "s")
    options = StudyOptions(strategies=("default",), k=2, online=OnlineOptions(**SMALL, steps=2), prompts="builtin",
                           limit=2, max_new_tokens=6, depth=2, kernels=("linear",), filters=(0.0,), probe=None)
    key = workflow.capture("tiny-llama", "builtin", CaptureOptions(limit=4, max_new_tokens=6, batch_size=4), store,
                           load=lambda spec, st: tiny).result.key
    t = shape.target(store, "tiny-llama")
    for kind in ("online", "answers", "bench"):
        assert forecast.pace(store, kind, "tiny-llama", t)[1].startswith("by a conservative rule")
    workflow.study(store, key, options, load=lambda spec, st: tiny)
    for kind in ("online", "answers", "bench"):
        x, source = forecast.pace(store, kind, "tiny-llama", t)
        assert source.startswith("at the pace the last") and x > 0, (kind, source)
    assert "measured here" in " ".join(p.source for p in forecast.study(store, "tiny-llama", options).parts)
    store.close()


def test_study_in_passes_keeps_outcomes_that_outlive_the_store(tiny, tiny_capture, tmp_path, one_thread):
    """--sets-per-pass 2 trains 3 sets in two passes per seed, each benchmarked when done; --outcomes keeps one
    file per (set, seed), from which a study on a new, empty store (the machine lost) gives the same report
    without training or benchmarking; a damaged file is one clear error; another budget trains anew."""
    folder = tmp_path / "outcomes"
    options = StudyOptions(strategies=("default", "entropy-topk"), extra_sets=((0, 3),), k=2,
                           online=OnlineOptions(**SMALL, steps=2), prompts="builtin", limit=2, max_new_tokens=6,
                           depth=2, kernels=("linear",), filters=(0.0,), seeds=(0, 1), sets_per_pass=2,
                           outcomes=str(folder), probe=None)
    first = Store(tmp_path / "first")
    seen, plans = [], []
    report = run_study(tiny_capture, tiny, first, options, progress=seen.append, planned=lambda *p: plans.append(p))
    rows = report.rows
    assert len(rows) == 3 and len(OutcomeFolder(folder)) == 6
    listed = OutcomeFolder(folder).listing()
    assert sorted((d["layers"], d["seed"]) for _, d in listed) == sorted((r.layers, s) for r in rows for s in (0, 1))
    metas = [json.loads((Path(d) / "layerscope.json").read_text()) for r in rows for d in r.drafts]
    runs = {m["run_key"] for m in metas}
    assert len(runs) == 4                                    # 2 seeds x (2 sets + 1 set)
    passes = [p.message for p in seen if p.phase == "train" and p.message.startswith("online training")
              and p.detail is None]
    assert f"0 of 6 drafts (set, seed) already in {folder}" in [p.message for p in seen]
    assert [m[-10:] for m in passes] == ["(pass 1/4)", "(pass 2/4)", "(pass 3/4)", "(pass 4/4)"]
    # each pass is benchmarked before the next trains: a bench phase between the first two passes' training
    phases = [p.phase for p in seen]
    first_bench = phases.index("bench")
    assert first_bench < max(i for i, p in enumerate(seen) if p.phase == "train")

    fresh = Store(tmp_path / "fresh")                      # the store is gone; the folder is what was kept
    again = []
    report2 = run_study(tiny_capture, tiny, fresh, options, progress=again.append, planned=lambda *p: plans.append(p))
    assert plans == [(6, 4, 0), (0, 0, 6)]          # (drafts to train, passes, read back): what the estimate counts
    assert not [p for p in again if p.phase == "bench" or (p.phase == "train" and p.detail is not None)]
    assert f"6 of 6 drafts (set, seed) already in {folder}" in [p.message for p in again]
    assert not (fresh.root / "drafts").exists() or not any((fresh.root / "drafts").iterdir())
    for a, b in zip(rows, report2.rows):
        assert (a.layers, a.tau, a.tau_ci, a.delta_ci, a.val_accuracy, a.seeds) == \
            (b.layers, b.tau, b.tau_ci, b.delta_ci, b.val_accuracy, b.seeds)
    assert report2.verdict == report.verdict and format_study(report2) == format_study(report)

    victim = sorted(folder.glob("*.json"))[0]
    victim.write_text(victim.read_text()[:50])
    with pytest.raises(OutcomeError, match=victim.name):
        run_study(tiny_capture, tiny, fresh, options)
    victim.unlink()                                         # removed: that (set, seed) alone is trained again
    redo = []
    run_study(tiny_capture, tiny, fresh, options, progress=redo.append)
    redone = [p.message for p in redo if p.phase == "train" and p.message.startswith("online") and p.detail is None]
    assert len(redone) == 1 and redone[0].startswith("online training of 1 draft,")
    assert len(OutcomeFolder(folder)) == 6
    # seed 0's first and third sets, trained in different passes, are lost: one pass of 2 trains both again
    lost = [path for path, d in OutcomeFolder(folder).listing()
            if d["seed"] == 0 and d["layers"] in (rows[0].layers, rows[2].layers)]
    assert len(lost) == 2
    for path in lost:
        Path(path).unlink()
    redo = []
    run_study(tiny_capture, tiny, fresh, options, progress=redo.append)
    redone = [p.message for p in redo if p.phase == "train" and p.message.startswith("online") and p.detail is None]
    assert redone == ["online training of 2 drafts, seed 0"] and len(OutcomeFolder(folder)) == 6

    more = StudyOptions(**{**options.__dict__, "online": OnlineOptions(**SMALL, steps=3)})   # another budget
    trained = []
    run_study(tiny_capture, tiny, fresh, more, progress=trained.append)
    assert len([p for p in trained if p.phase == "train" and p.message.startswith("online") and p.detail is None]) == 4
    assert len(OutcomeFolder(folder)) == 12
    first.close(), fresh.close()


def test_ctrl_c_saves_a_checkpoint_and_stops_cleanly(tmp_path):
    store_dir = tmp_path / "c"
    cmd = [sys.executable, "-c", "import sys; from layerscope.commands.cli import main; sys.exit(main(sys.argv[1:]))",
           "train-draft", "--model", "tiny-llama", "--prompts", "builtin", "--limit", "12", "--max-new-tokens", "10",
           "--layers", "1,3", "--steps", "100000", "--batch-size", "3", "--seq-len", "64", "--draft-vocab", "64",
           "--val-conversations", "2", "--checkpoint-every", "10h", "--threads", "1", "--store", str(store_dir)]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not (store_dir / "runs").is_dir():
        time.sleep(0.1)
    time.sleep(3)                                   # some training steps
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err[-2000:]
    assert "run the same command again to continue" in err
    run_dir = next((store_dir / "runs").iterdir())
    ckpts = complete_checkpoints(run_dir)
    stopped = re.search(r"Training stopped at step (\d+)", err)
    assert stopped, err[-2000:]
    step = int(stopped.group(1))                    # the step the run reports: its checkpoint is that step's
    assert len(ckpts) == 1 and ckpts[0].name == f"ckpt-{step:09d}"
    assert json.loads((ckpts[0] / "state.json").read_text())["step"] == step


def test_app_job_trains_every_set_online_with_live_progress(tmp_path, one_thread):
    store = Store(tmp_path / "s")
    manager = JobManager(max_running=1)
    job = manager.submit("session", "train", tasks.online_train_job(
        store=store, model="tiny-llama", sets=[("default", [1, 2], "default"), ("mine", [0, 3], None)],
        options={**SMALL, "steps": 4}))
    assert job.wait(timeout=300)
    assert job.view().finished_ok, (job.error, job.fix)
    drafts = job.result["drafts"]
    assert [d["name"] for d in drafts] == ["default", "mine"] and [d["layers"] for d in drafts] == [[1, 2], [0, 3]]
    assert all(len(d["curve"]) == 2 and d["tokens_seen"] > 0 for d in drafts)
    assert job.metrics["tokens"] == drafts[0]["tokens_seen"] and set(job.metrics["val"]) == {"default", "mine"}
    assert {p["set"] for p in job.series["curve"]} == {"default", "mine"}


@pytest.mark.skipif(shutil.which("torchrun", path=os.path.dirname(sys.executable)) is None, reason="torchrun missing")
def test_two_process_ddp_training_equals_one_process(tiny, tmp_path, one_thread):
    """torchrun with 2 gloo ranks: each rank runs the target on half of every batch, the gradients are summed
    with losses normalised by the global position counts, so the drafts match one process (float tolerance)."""
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    cmd = [torchrun, "--standalone", "--nproc-per-node", "2", "-m", "layerscope", "train-draft", "--model", "tiny-llama",
           "--prompts", "builtin", "--limit", "12", "--max-new-tokens", "10", "--layers", "1,3", "--layers", "0,2",
           "--steps", "4", "--batch-size", "4", "--seq-len", "64", "--draft-vocab", "64", "--val-conversations", "2",
           "--eval-points", "2", "--store", str(tmp_path / "two"), "--json"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
    assert run.returncode == 0, run.stderr[-3000:]
    two = json.loads(run.stdout)                                   # one JSON document: only rank 0 prints
    one = train_online(tiny, [[1, 3], [0, 2]], Store(tmp_path / "one"), steps=4,
                       **{**SMALL, "batch_size": 4, "eval_points": 2})
    for a, b in zip(one.drafts, two["drafts"]):
        assert a.layers == b["layers"] and a.tokens_seen == b["tokens_seen"]
        wa, wb = weights(a.path), weights(b["path"])
        for k in wa:
            assert torch.allclose(wa[k].float(), wb[k].float(), atol=1e-4, rtol=1e-3), k


def test_a_data_seed_keeps_the_conversations_while_the_seed_moves_the_draft(tiny, tmp_path, one_thread):
    """data_seed draws the conversations (and held-out split); seed alone then moves init and order: the
    study's seeds share one regenerated pool. data_seed == seed is the run it was before (same key)."""
    store = Store(tmp_path / "store")
    a = load_conversations(tiny, OnlineOptions(**SMALL, seed=0), store)
    b = load_conversations(tiny, OnlineOptions(**SMALL, seed=1, data_seed=0), store)
    c = load_conversations(tiny, OnlineOptions(**SMALL, seed=1), store)
    assert a.ids == b.ids and a.key == b.key and a.response == b.response
    assert c.ids != a.ids
    assert OnlineOptions(seed=0).run_fields() == OnlineOptions(seed=0, data_seed=0).run_fields()
    assert OnlineOptions(seed=1).run_fields() != OnlineOptions(seed=1, data_seed=0).run_fields()
    with pytest.raises(DraftError, match="data_seed"):
        OnlineOptions(steps=1, data_seed="0").validate()
    ra = train_online(tiny, [[1, 3]], store, options=OnlineOptions(**SMALL, steps=2, seed=0))
    rb = train_online(tiny, [[1, 3]], store, options=OnlineOptions(**SMALL, steps=2, seed=1, data_seed=0))
    assert not same_weights(ra.drafts[0].path, rb.drafts[0].path)
    assert ra.drafts[0].val_coverage == rb.drafts[0].val_coverage        # the same held-out conversations


def test_kinds_weight_the_drawn_conversations_and_agreement_is_reported_by_kind(tiny, tmp_path, capsys, one_thread):
    """--kinds weights ShareGPT's draw by kind of first request (prompts/kinds.py): a kind of weight 0 is left out,
    a weight of 4 draws a kind's records 4 times as often; seeded, and with every weight equal it is the plain draw
    (and key). The held-out conversations are a seeded choice among the drawn ones, so they follow the weighting;
    ShareGPT's held-out 5% is never drawn. Each draft reports its held-out agreement by kind, counts adding up."""
    store = Store(tmp_path / "store")
    base = dict(prompts="sharegpt", limit=60, responses="own", max_new_tokens=16, batch_size=4, seq_len=64,
                val_conversations=6, eval_points=1, draft_vocab=64, steps=2)
    plain = load_conversations(tiny, OnlineOptions(**base), store)
    picked = OnlineOptions(**base, kinds="code=4,chat=0")
    drawn = load_conversations(tiny, picked, store)
    assert "chat" in plain.kinds and "chat" not in drawn.kinds
    assert drawn.kinds.count("code") / len(drawn) > plain.kinds.count("code") / len(plain) + 0.2
    prompts = {p.id: p.text for p in load_prompts("sharegpt", limit=60, seed=picked.sample_seed,
                                                   cache=store.root / "prompts", kind_weights=picked.kind_weights)}
    assert drawn.kinds == [kind_of(prompts[i]) for i in drawn.ids]
    again = load_conversations(tiny, picked, store)
    assert again.ids == drawn.ids and again.key == drawn.key != plain.key
    assert not any(is_heldout(i.removeprefix("sharegpt/")) for i in plain.ids + drawn.ids)
    even = OnlineOptions(**base, kinds="*=2")
    assert load_conversations(tiny, even, store).ids == plain.ids
    assert even.run_fields() == OnlineOptions(**base).run_fields() and "kinds" not in even.run_fields()
    assert picked.run_fields()["kinds"] == "code=4,translation=1,summarization=1,math=1,chat=0"

    # answers to agree on; without fc_norm a 4-step tiny draft already agrees somewhere (with it, not yet)
    mixed = OnlineOptions(**{**base, "responses": "regenerate", "steps": 4, "fc_norm": False}, kinds="code=4")
    result = train_online(tiny, [[1, 2]], store, options=mixed)
    meta = read_meta(result.drafts[0].path)
    val_ids = meta["online"]["val_ids"]
    convs = load_conversations(tiny, mixed, store)
    kind_of_id = dict(zip(convs.ids, convs.kinds))
    assert set(val_ids) < set(convs.ids)                  # held out from the weighted draw, like the training ones
    train_kinds = [kind_of_id[i] for i in convs.ids if i not in val_ids]
    assert list(result.kind_mix) == list(KINDS) and result.kind_mix == {k: train_kinds.count(k) for k in KINDS}
    assert sum(result.kind_mix.values()) == result.conversations == len(convs) - len(val_ids)
    assert meta["online"]["kind_mix"] == result.kind_mix and meta["online"]["kinds"] == result.kinds
    by_kind = result.drafts[0].val_by_kind
    assert by_kind == meta["val_by_kind"] and len(by_kind) >= 2
    assert {k: v["conversations"] for k, v in by_kind.items()} == {k: [kind_of_id[i] for i in val_ids].count(k)
                                                                   for k in set(kind_of_id[i] for i in val_ids)}
    assert sum(v["positions"] for v in by_kind.values()) == meta["val_positions"] > 0
    mean = sum(v["val_accuracy"][0] * v["positions"] for v in by_kind.values()) / meta["val_positions"]
    assert mean == pytest.approx(result.drafts[0].val_accuracy[0], abs=1e-4) and mean > 0
    assert result.drafts[0].val_by_kind_start is None and meta["val_by_kind_start"] is None
    # a continued run evaluates its starting draft by kind before it trains, on the held-out split it shares with it:
    # the starting draft's own final numbers (issue 39.3's before and after)
    more = train_online(tiny, [[1, 2]], store, options=replace(mixed, steps=1, lr=1e-30,
                                                               init_from=(result.drafts[0].path,))).drafts[0]
    assert read_meta(more.path)["online"]["val_ids"] == val_ids
    assert more.val_by_kind_start == by_kind == read_meta(more.path)["val_by_kind_start"]

    args = ["train-draft", "--model", "tiny-llama", "--prompts", "sharegpt", "--limit", "60", "--max-new-tokens", "16",
            "--batch-size", "4", "--seq-len", "64", "--val-conversations", "6", "--eval-points", "1",
            "--draft-vocab", "64", "--steps", "4", "--layers", "1,2", "--kinds", "code=4", "--no-fc-norm",
            "--store", str(tmp_path / "store")]
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["cached"] and out["kind_mix"] == result.kind_mix and out["kinds"] == mixed.run_fields()["kinds"]
    assert out["drafts"][0]["val_by_kind"] == by_kind
    assert main(args) == 0
    text = capsys.readouterr().out
    assert f"training conversations by kind: code {result.kind_mix['code']}," in text
    assert "held-out agreement by kind: " in text and all(f"{k} " in text for k in by_kind)


def test_a_weighted_draw_answers_only_what_the_unweighted_draw_has_not(tiny, tmp_path, one_thread):
    """A draw weighted by kind keeps parts of its own but takes the unweighted draw's stored answers by prompt
    (id and hash): a weighted order merges the unweighted one with the heavier kinds, so the weighted 24 hold the
    unweighted first 12, and only the rest is answered, in full batches. Answers are kept as they were stored, the
    parts are read back whole, and a second load answers nothing."""
    store = Store(tmp_path / "store")
    base = dict(prompts="sharegpt", responses="regenerate", max_new_tokens=6, gen_batch_size=4, batch_size=3,
                seq_len=64, val_conversations=2, eval_points=1, draft_vocab=64, steps=1)
    plain = load_conversations(tiny, OnlineOptions(**base, limit=12), store)
    weighted = OnlineOptions(**base, limit=24, kinds="translation=10,summarization=5,math=5")
    seen = []
    drawn = load_conversations(tiny, weighted, store, progress=seen.append)
    answers = dict(zip(plain.ids, plain.response))
    shared = [i for i in drawn.ids if i in answers]
    assert set(plain.ids) <= set(drawn.ids) and len(drawn.ids) > len(plain.ids)      # the merge holds the first 12
    assert all(r == answers[i] for i, r in zip(drawn.ids, drawn.response) if i in answers)
    last = seen[-1]
    assert last.reused == len(shared) and last.prompts == len(drawn.ids) - len(shared)
    assert last.done == last.total == -(-last.prompts // 4)                           # full batches of 4
    again = []
    assert load_conversations(tiny, weighted, store, progress=again.append).response == drawn.response
    assert again == []                                                               # every part is stored
    # each draw's folder says whose answers it holds (long_run.sh keep keeps a model's own)
    abouts = [json.loads(f.read_text()) for f in (store.root / "responses").glob("*/about.json")]
    assert sorted("kinds" in a for a in abouts) == [False, True]
    assert {(a["model"], a["target"]) for a in abouts} == {(tiny.spec, tiny.fingerprint)}
    # the same weighted draw in a store that never saw the unweighted one answers everything itself
    alone = []
    fresh = load_conversations(tiny, weighted, Store(tmp_path / "fresh"), progress=alone.append)
    assert fresh.ids == drawn.ids and alone[-1].reused == 0 and alone[-1].prompts == len(drawn.ids)
