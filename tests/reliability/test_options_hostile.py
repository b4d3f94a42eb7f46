"""Hostile option values and combinations, through the real CLI on the tiny model and a real capture of it: each is
one `error:` line (exit 2, no traceback) naming the option at fault, before anything is computed, and the store is
left as it was. Also: options that were ignored without a word are refused, a continued draft keeps its vocabulary
without --draft-vocab, `verify` forgets a damage mark once the chunk is whole again, Home says when a job was
interrupted, and train-draft and study share one definition of their training flags."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from layerscope.capture.format import DAMAGE_FILE
from layerscope.capture.stored import list_captures, open_capture
from layerscope.commands import cli, common, probe, study, train_draft
from layerscope.session import storage
from layerscope.session.model import Session, owner_hash
from layerscope.store import Store, atomic_write_json
from layerscope.ui.access import OWNER_KEY
from layerscope.ui.jobs import process_stamp
from tests.reliability.test_reliability import cli_line, tree
from tests.reliability.test_signals import start, terminated, wait_for

APP = str(Path(__file__).resolve().parents[2] / "app.py")
BENCH = ["bench", "--model", "tiny-llama", "--prompts", "builtin", "--limit", "1", "--max-new-tokens", "2"]


def held(store: Store) -> dict:
    """What the store holds that a refused command must not change: its captures' files and its drafts."""
    drafts = store.root / "drafts"
    return {"captures": tree(store.root / "captures"),
            "drafts": sorted(p.name for p in drafts.iterdir()) if drafts.is_dir() else []}


def refused(capsys, store: Store, said: str, *argv) -> str:
    before = held(store)
    code, line = cli_line(capsys, *argv, "--store", store.root)
    assert code == 2 and said in line, line
    assert held(store) == before
    return line


# ---------------------------------------------------------------------------- numbers

def test_a_negative_prompt_lookup_span_is_one_line(store_with_capture, capsys):
    store, _ = store_with_capture
    refused(capsys, store, "--prompt-lookup must be at least 1 (got -3)", *BENCH, "--prompt-lookup", "-3")
    refused(capsys, store, "--prompt-lookup must be at least 1 (got 0)", *BENCH, "--prompt-lookup", "0")


@pytest.mark.parametrize("value", ["0,nan", "inf", "0.5,-inf"])
def test_a_study_refuses_entropy_filters_that_are_not_finite(value, store_with_capture, capsys):
    store, key = store_with_capture
    refused(capsys, store, f"--filters {value!r} holds a value that is not a finite number",
            "study", key, "--model", "tiny-llama", "--prompts", "builtin", "--limit", "1", "--max-new-tokens", "2",
            "--steps", "1", "--strategies", "default", "--filters", value)


def test_a_long_max_new_tokens_is_named_as_the_limit_not_the_prompt_limit(store_with_capture, capsys):
    store, _ = store_with_capture
    line = refused(capsys, store, "--max-new-tokens 1000 leaves that much of tiny-llama's context of 1024 tokens",
                   *BENCH[:-1], "1000", "--no-peers")
    assert "Lower --max-new-tokens" in line and "prompt-token limit" not in line


# ---------------------------------------------------------------------------- options ignored without a word

def test_auto_even_if_slower_without_an_auto_pick_is_refused(store_with_capture, capsys):
    store, _ = store_with_capture
    refused(capsys, store, "--auto-even-if-slower applies to --k auto and --tree auto, and neither is given",
            *BENCH, "--no-peers", "--auto-even-if-slower")
    refused(capsys, store, "--auto-even-if-slower applies to", *BENCH, "--no-peers", "--k", "2", "--tree",
            "--auto-even-if-slower")


def test_kinds_with_training_from_a_capture_is_refused(store_with_capture, tmp_path, capsys):
    store, key = store_with_capture
    refused(capsys, store, "--kinds weights the conversations online training draws", "train-draft", key,
            "--layers", "1,2", "--steps", "1", "--kinds", "code=2", "--out", tmp_path / "draft")
    assert not (tmp_path / "draft").exists()


# ---------------------------------------------------------------------------- messages that said the wrong thing

def test_a_draft_key_prefix_under_four_characters_is_said_to_be_too_short(store_with_capture, capsys):
    store, key = store_with_capture
    assert cli.main(["train-draft", key, "--layers", "1,2", "--steps", "1", "--store", str(store.root)]) == 0
    capsys.readouterr()
    [stored] = list((store.root / "drafts").iterdir())
    line = refused(capsys, store, f"{stored.name[:3]!r} is too short to be a stored draft's key prefix (at least 4 "
                   "characters)", *BENCH, "--no-peers", "--draft", stored.name[:3])
    assert "does not exist" not in line
    assert cli.main([*BENCH, "--no-peers", "--draft", stored.name[:4], "--store", str(store.root)]) == 0   # 4 do


def test_an_interrupted_training_from_a_capture_promises_no_checkpoint(store_with_capture, tmp_path):
    """Training from a capture keeps no checkpoint: a stop says the run starts over (online training resumes)."""
    store, key = store_with_capture
    before = held(store)
    err = tmp_path / "err"
    proc = start(["train-draft", key, "--layers", "1,2", "--steps", "100000", "--store", str(store.root)], err)
    wait_for(lambda: "loss=" in err.read_text(), proc, err)
    line = terminated(proc, err)
    assert "training from a capture keeps no checkpoint, so it starts over" in line, line
    assert "checkpoint) and it resumes" not in line
    assert held(store) == before and not list(store.root.rglob(".layerscope-staging"))


# ---------------------------------------------------------------------------- a continued draft's vocabulary

def test_init_from_keeps_the_continued_drafts_vocabulary_without_draft_vocab(store_with_capture, tmp_path, capsys):
    store, key = store_with_capture
    train = ["train-draft", key, "--layers", "1,2", "--steps", "1", "--store", str(store.root)]
    vocab = lambda d: json.loads((tmp_path / d / "config.json").read_text())["draft_vocab_size"]   # noqa: E731
    assert cli.main([*train, "--draft-vocab", "64", "--out", str(tmp_path / "small")]) == 0
    assert cli.main([*train, "--init-from", str(tmp_path / "small"), "--out", str(tmp_path / "more")]) == 0
    assert vocab("more") == 64
    # the default vocabulary is the whole of the tiny target's (it has fewer than 8192 tokens): giving the default
    # by hand continues it too
    assert cli.main([*train, "--out", str(tmp_path / "whole")]) == 0
    assert cli.main([*train, "--init-from", str(tmp_path / "whole"), "--draft-vocab", "8192",
                     "--out", str(tmp_path / "whole-more")]) == 0
    assert vocab("whole-more") == vocab("whole") < 8192
    capsys.readouterr()


# ---------------------------------------------------------------------------- verify's damage mark

def test_verify_clears_the_damage_mark_once_the_chunk_is_whole_again(store_with_capture, capsys):
    store, key = store_with_capture
    chunk = sorted(store.path("captures", key).glob("chunk-*.safetensors"))[0]
    whole = chunk.read_bytes()
    bad = bytearray(whole)
    bad[len(bad) // 2] ^= 0xFF                                   # one byte of the states changed, the size kept
    chunk.write_bytes(bytes(bad))
    assert cli.main(["verify", "--store", str(store.root)]) == 1 and "DAMAGED" in capsys.readouterr().out
    assert (store.path("captures", key) / DAMAGE_FILE).is_file()
    assert list_captures(store)[0]["state"] == "damaged"
    chunk.write_bytes(whole)                                     # repaired: the chunk restored from a copy
    assert cli.main(["verify", "--store", str(store.root)]) == 0 and f"{key}  ok" in capsys.readouterr().out
    assert not (store.path("captures", key) / DAMAGE_FILE).exists()
    assert list_captures(store)[0]["state"] == "ok" and open_capture(store, key).num_tokens > 0


# ---------------------------------------------------------------------------- Home and an interrupted job

def test_home_says_a_job_was_interrupted(tmp_path, monkeypatch):
    """A server that stopped mid-capture leaves its job's record in the store (jobs/<owner>.capture.json) naming
    processes that no longer run: Home says the capture was interrupted and how to resume."""
    root = tmp_path / "store"
    owner, token = Session().id, "test-browser-home".ljust(40, "x")
    storage.save(Session(id=owner, model="tiny-llama", owner=owner_hash(token)), Store(root))
    gone = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    stamp = process_stamp(gone.pid)
    gone.kill()
    gone.wait()
    atomic_write_json(root / "jobs" / f"{owner}.capture.json",
                      {"id": "capture-1-1", "owner": owner, "kind": "capture", "title": "Capture of tiny-llama",
                       "state": "running", "created": 1.7e9, "started": 1.7e9, "processes": [stamp]})
    monkeypatch.setenv("LAYERSCOPE_STORE", str(root))
    monkeypatch.setenv("LAYERSCOPE_WORKER", "thread")
    at = AppTest.from_file(APP, default_timeout=120)
    at.session_state[OWNER_KEY] = token
    at.query_params["session"] = owner
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    shown = [w.value.replace("\\", "") for w in at.warning if "interrupted" in w.value]
    assert len(shown) == 1 and "Capture of tiny-llama was interrupted: the server stopped while it ran" in shown[0]
    assert "it resumes from the chunks it finished" in shown[0]
    assert (root / "jobs" / f"{owner}.capture.json").is_file()        # kept until dismissed on the Capture page


# ---------------------------------------------------------------------------- one home per rule (issue 53)

TRAINING_FLAGS = ["--steps", "--tokens", "--time", "--ttt-steps", "--batch-size", "--seq-len", "--lr", "--fc-norm",
                  "--responses", "--val-conversations"]


def test_train_draft_and_study_take_their_training_flags_from_one_definition():
    commands = cli.build_parser()._subparsers._group_actions[0].choices

    def flag(command, name):
        [action] = [a for a in commands[command]._actions if name in a.option_strings]
        return (type(action).__name__, action.option_strings, action.default, action.type, action.choices, action.help)

    for name in TRAINING_FLAGS:
        assert flag("train-draft", name) == flag("study", name), name
    assert study.parse_list is common.parse_list and probe.parse_list is common.parse_list
    assert not hasattr(train_draft, "parse_list")
