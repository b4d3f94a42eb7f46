"""The command line's progress bar (commands/common.Progress) where stderr is a log file, not a terminal: a line
every LOG_EVERY_S seconds, each readable on its own, instead of a redrawn frame per update."""

from __future__ import annotations

import sys

from layerscope.commands import common


def test_a_log_gets_a_line_every_half_minute_not_a_frame_every_update(capsys, monkeypatch):
    monkeypatch.delenv(common.LOG_EVERY_ENV, raising=False)          # the default (conftest.py sets 0 for the suite)
    now = [0.0]
    with common.Progress("study", unit="step", clock=lambda: now[0]) as bar:
        for i in range(200):                              # 200 updates, one a second
            now[0] += 1.0
            bar.update(i, 200, eta_s=200 - i, tokens=i * 10)
    err = capsys.readouterr().err
    lines = [line.rsplit("\r", 1)[-1] for line in err.split("\n") if "tokens=" in line]
    assert 7 <= len(lines) <= 9                           # at 1 s, then every 30 s (+ where it ended), not 200
    assert "0/200" in lines[0] and "tokens=300" in lines[1] and "about" in lines[1]
    assert "199/200" in lines[-1]


def test_a_note_and_a_later_error_each_stand_on_their_own_line(capsys, monkeypatch):
    """In a log nothing redraws the bar after a note: an error printed next starts its own line (it was glued to a
    'bench: | 0/? [00:00]' frame that tqdm's write had left behind)."""
    monkeypatch.delenv(common.LOG_EVERY_ENV, raising=False)
    with common.Progress("bench", unit="run") as bar:
        bar.note("Estimate before the benchmark starts: under a second.")
    print("error: no prompt fits", file=sys.stderr)
    assert capsys.readouterr().err.splitlines() == ["Estimate before the benchmark starts: under a second.",
                                                    "error: no prompt fits"]
