"""`layerscope recommend SESSION|KEY` says what the app's Layer sets page recommends (study.recommend.as_left), for a
capture key (a new session, default options) and for a saved session (by id and by name, with its evidence)."""

from __future__ import annotations

import json

from layerscope.commands import cli
from layerscope.session import storage
from layerscope.session.model import Session
from layerscope.stats.analysis import AnalysisOptions
from layerscope.steps import workflow
from layerscope.study import recommend


def _run(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_capture_key_gets_the_apps_recommendation(tiny_capture, session_store, capsys, one_thread):
    key = tiny_capture.key
    stats = workflow.analyze(session_store, key, AnalysisOptions()).to_json()
    app = recommend.as_left(Session(capture_key=key), stats)
    code, out, err = _run(capsys, "recommend", "--store", str(session_store.root), key[:10], "--json")
    assert code == 0, err
    got = json.loads(out)
    assert got["text"] == app.text and got["basis"] is None and got["capture_key"] == key
    assert got["recommended"]["layers"] == app.best.layers and got["k"] == app.k
    assert [r["layers"] for r in got["ranked"]] == [r.layers for r in app.ranked]
    code, out, err = _run(capsys, "recommend", "--store", str(session_store.root), key)
    assert code == 0, err
    assert f"\n{app.text}\n" in out and f"Sets of {app.k} layers, ranked by nothing yet" in out


def test_a_saved_session_gets_its_recommendation_by_id_and_name(tiny_capture, session_store, capsys, one_thread):
    key = tiny_capture.key
    stats = workflow.analyze(session_store, key, AnalysisOptions()).to_json()
    s = Session(capture_key=key, capture={"num_layers": tiny_capture.num_layers}, model="tiny-llama")
    s.set_stats({**stats, "requested": {}})
    rows = [((1, 2), 1.36, 0.0, [0.0, 0.0]), ((2, 3), 1.50, 0.14, [0.08, 0.20]), ((1, 3), 1.20, -0.16, [-0.22, -0.10])]
    s.study.append({"rows": [{"strategies": ["manual"], "layers": list(l), "draft": f"/nowhere/{i}", "tau": t,
                              "tau_ci": [t - 0.02, t + 0.02], "delta_vs_default": d, "delta_ci": dci,
                              "mean_entropy": 1.0, "mean_cka": 0.5, "aggregate_entropy": 1.0}
                             for i, (l, t, d, dci) in enumerate(rows)],
                    "prompts": 20, "options": {"train": {"steps": 300}}})
    s.view["sets_k"] = 2
    storage.save(s, session_store, name="cli recommend")
    app = recommend.as_left(storage.load(session_store, s.id), s.stats_dict())
    assert app.basis == "τ" and app.best.layers == [2, 3]
    for target in (s.id, "cli recommend"):
        code, out, err = _run(capsys, "recommend", "--store", str(session_store.root), target)
        assert code == 0, err
        assert out.startswith(f"capture {key} (tiny-llama), session cli recommend ({s.id})")
        assert f"\n{app.text}\n" in out and "ranked by τ (study #1)" in out
        assert "* " + app.best.name.replace(" = ", ", ") in out


def test_an_unknown_session_or_key_is_one_line(session_store, capsys):
    for target in ("fedcba987654", "no such session", "ffffffffffffffffffffff00"):
        code, out, err = _run(capsys, "recommend", "--store", str(session_store.root), target)
        assert code == 2 and out == ""
        assert err.startswith(f"error: No saved session or capture {target!r} in ") and err.count("\n") == 1
