"""The Speculative decoding page's honest numbers and exports, through streamlit.testing.v1.AppTest.

A session is built directly (the tiny model's facts, a capture key this store does not hold, real
drafts saved for the tiny target), so no capture has to run; the benchmark runs as the page runs it.
"""

from __future__ import annotations

import html
import io
import json
import re
import zipfile
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from layerscope import quietness
from layerscope.decoding import sanity
from layerscope.draft.checkpoint import read_meta, save_draft
from layerscope.session import share, storage
from layerscope.session.model import Session, owner_hash
from layerscope.store import Store
from layerscope.ui import speculate
from layerscope.ui.access import OWNER_KEY
from layerscope.ui.report import session_report
from layerscope.ui.tasks import draft_entry
from layerscope.ui.widgets import text_key
from tests.helpers import untrained_draft
from tests.ui.test_app import APP, number_shown, set_number, settle

PAGE = "app_pages/speculate.py"

pytestmark = pytest.mark.usefixtures("one_thread")


def saved_draft(store, tiny, key: str, layers) -> dict:
    """A real draft for the tiny target in the store (layers.json records the target), as the session keeps it."""
    meta = {"target_fingerprint": tiny.fingerprint, "target_model": tiny.spec, "layers": list(layers),
            "strategy": "manual"}
    path = save_draft(store.path("drafts", key), untrained_draft(tiny.model, layers=layers), meta, target=tiny)
    return draft_entry(path, read_meta(path), name=key)


TOKEN = "test-browser-exports".ljust(40, "x")      # this module's browser (its owner cookie, as new_app seeds it)


def session_with(store, tiny, drafts: list[dict]) -> str:
    s = Session(model=tiny.spec, prompt_set="builtin", capture_key="f" * 24,
                         capture={"num_layers": tiny.num_layers, "fingerprint": tiny.fingerprint, "model": tiny.spec,
                                  "tokens": 100},
                         drafts=drafts, owner=owner_hash(TOKEN))
    storage.save(s, store)
    return s.id


def open_page(sid: str) -> AppTest:
    at = AppTest.from_file(APP, default_timeout=120)
    at.session_state[OWNER_KEY] = TOKEN
    at.query_params["session"] = sid
    at.run()
    at.switch_page(PAGE).run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def error_lines(at: AppTest) -> list[str]:
    return [re.sub(r"\\(.)", r"\1", e.value) for e in at.error]


def test_the_benchmark_starts_from_enough_prompts(app_store, tiny):
    at = open_page(session_with(app_store, tiny, [saved_draft(app_store, tiny, "three", (1, 2, 3))]))
    n = number_shown(at, "ls_w_spec_bench_n")
    assert n >= sanity.ENOUGH_PROMPTS and not sanity.bench_warnings([], n)   # no "only N prompts" from the default
    assert str(sanity.ENOUGH_PROMPTS) in at.text_input(key=text_key("ls_w_spec_bench_n")).help


def test_benchmark_view_shows_intervals_and_old_runs_still_display(app_store, tiny):
    sid = session_with(app_store, tiny, [saved_draft(app_store, tiny, "three", (1, 2, 3))])
    at = open_page(sid)
    at.radio(key="ls_w_spec_bench_src").set_value("builtin")
    set_number(at, "ls_w_spec_bench_n", 3)
    set_number(at, "ls_w_spec_bench_new", 8)
    at.toggle(key="ls_w_spec_bench_auto").set_value(False).run()      # a fixed K (the default is auto)
    set_number(at, "ls_w_spec_bench_k", 3)
    at.run()
    at.button(key="ls_spec_bench").click().run()
    settle(at)
    assert not at.exception, [e.value for e in at.exception]
    res = at.session_state["ls_session"].bench_results[-1]
    assert res["intervals"]["prompts"] == 3 and res["intervals"]["reference"] == "three"
    draft = res["results"][1]
    assert draft["tau_ci"][0] <= draft["tau"] <= draft["tau_ci"][1]
    assert storage.load(app_store, sid).bench_results[-1]["results"][1]["tau_ci"] == draft["tau_ci"]   # saved
    shown = next(d.value for d in at.dataframe if "contender" in d.value.columns)
    assert shown["τ"].tolist()[1] == f"{draft['tau']:.3f} [{draft['tau_ci'][0]:.3f}, {draft['tau_ci'][1]:.3f}]"
    assert shown["τ"].tolist()[0] == "1.000 [1.000, 1.000]"        # plain decoding: one token per forward
    assert re.fullmatch(r"\d+\.\d\d× \[\d+\.\d\d, \d+\.\d\d\]", shown["speedup"].tolist()[1])
    assert any("95% bootstrap intervals over the 3 prompts" in c.value for c in at.caption)

    # a run saved before benchmarks kept per-prompt totals: the numbers alone, and a note saying why
    s = storage.load(app_store, sid)
    old = json.loads(json.dumps(res))
    old.pop("intervals")
    for r in old["results"]:
        for k in ("per_prompt", "tau_ci", "speedup_ci", "acceptance", "acceptance_ci", "paired"):
            r.pop(k, None)
    s.bench_results.append(old)
    storage.save(s, app_store)
    at = open_page(sid)
    at.selectbox(key="ls_spec_bench_run").set_value(1).run()
    assert not at.exception, [e.value for e in at.exception]
    shown = next(d.value for d in at.dataframe if "contender" in d.value.columns)
    assert shown["τ"].tolist()[1] == f"{draft['tau']:.3f}"
    assert any(c.value.startswith("No intervals") for c in at.caption)


def test_engine_export_downloads_the_folder_the_engine_reads(app_store, tiny):
    sid = session_with(app_store, tiny, [saved_draft(app_store, tiny, "three", (1, 2, 3))])
    at = open_page(sid)
    for engine, config, check in [
            ("vllm", "config.json", lambda c: c["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]),
            ("specforge", "draft_config.json", lambda c: c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2])]:
        at.selectbox(key="ls_w_spec_export_engine").set_value(engine).run()
        assert not at.get("download_button") or "ls_spec_export_download" not in [b.key for b in at.get("download_button")]
        at.button(key="ls_spec_export_build").click().run()
        assert not at.exception and not at.error, [e.value for e in at.exception] + error_lines(at)
        assert "ls_spec_export_download" in [b.key for b in at.get("download_button")]
        built = at.session_state["ls_spec_export"]
        assert built["name"] == f"three-{engine}.zip"
        z = zipfile.ZipFile(io.BytesIO(built["data"]))
        assert z.testzip() is None
        names = set(z.namelist())
        assert {f"three-{engine}/{f}" for f in (config, "model.safetensors", "COMMANDS.md")} <= names
        assert check(json.loads(z.read(f"three-{engine}/{config}")))
        assert f"./three-{engine}" in z.read(f"three-{engine}/COMMANDS.md").decode()
    assert "three-specforge/specforge.yaml" in names                   # the last one exported: SpecForge's run config
    at.selectbox(key="ls_w_spec_export_engine").set_value("speculators").run()
    assert any("speculators convert ignores the ids" in t.value for t in at.text)      # the engine's note


def test_engine_export_refusal_is_one_clear_line(app_store, tiny):
    sid = session_with(app_store, tiny, [saved_draft(app_store, tiny, "pair", (1, 2))])
    at = open_page(sid)
    at.selectbox(key="ls_w_spec_export_engine").set_value("vllm").run()
    assert not at.exception
    lines = error_lines(at)
    assert len(lines) == 1 and "vllm cannot take this draft: vllm reads exactly 3 layers" in lines[0]
    assert "\n" not in lines[0]
    assert not [b for b in at.button if b.key == "ls_spec_export_build"]
    at.selectbox(key="ls_w_spec_export_engine").set_value("sglang").run()       # SGLang takes two layers
    assert not at.error and [b for b in at.button if b.key == "ls_spec_export_build"]


def test_sessions_page_exports_with_drafts_and_imports_them_into_this_store(app_store, tiny, tmp_path):
    here = saved_draft(app_store, tiny, "three", (1, 2, 3))
    gone = dict(here, name="gone", path=str(tmp_path / "not-here"))
    sid = session_with(app_store, tiny, [here, gone])
    at = AppTest.from_file(APP, default_timeout=120)
    at.session_state[OWNER_KEY] = TOKEN
    at.query_params["session"] = sid
    at.run()
    at.switch_page("app_pages/sessions.py").run()
    assert not at.exception, [e.value for e in at.exception]
    at.checkbox(key="ls_w_sess_with_drafts").check().run()
    captions = [re.sub(r"\\(.)", r"\1", c.value) for c in at.caption]
    assert any(c.startswith("1 of 2 draft(s) go into the archive") and str(tmp_path / "not-here") in c for c in captions)

    # an archive made on another server, whose draft this store does not hold, brings it along
    elsewhere = Store(tmp_path / "elsewhere")
    try:
        theirs = saved_draft(elsewhere, tiny, "remote", (1, 2))
        s = Session(model=tiny.spec, capture_key="e" * 24, capture={"num_layers": tiny.num_layers},
                             drafts=[theirs])
        data = share.export_bytes(s, drafts=True)
    finally:
        elsewhere.close()
    at.file_uploader(key="ls_sess_upload").set_value(("remote.zip", data, "application/zip")).run()
    assert not at.exception and not at.error, [e.value for e in at.exception] + error_lines(at)
    assert any("and 1 draft(s), now in this store" in x.value for x in at.success)
    imported = storage.load(app_store, at.session_state["ls_sess_imported_id"])
    assert imported.drafts[0]["path"] == str(app_store.path("drafts", "remote"))
    assert (app_store.path("drafts", "remote") / "model.safetensors").read_bytes() == \
        (tmp_path / "elsewhere" / "drafts" / "remote" / "model.safetensors").read_bytes()


def test_sessions_page_names_a_draft_that_does_not_load_and_offers_no_archive(app_store, tiny):
    broken = saved_draft(app_store, tiny, "broken", (1, 3))
    weights = Path(broken["path"]) / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:64])          # a damaged weights file
    sid = session_with(app_store, tiny, [broken])
    at = AppTest.from_file(APP, default_timeout=120)
    at.session_state[OWNER_KEY] = TOKEN
    at.query_params["session"] = sid
    at.run()
    at.switch_page("app_pages/sessions.py").run()
    assert not at.error, error_lines(at)
    at.checkbox(key="ls_w_sess_with_drafts").check().run()
    assert not at.exception, [e.value for e in at.exception]
    lines = error_lines(at)
    assert len(lines) == 1 and "broken" in lines[0] and "does not load" in lines[0], lines
    button = next(b for b in at.get("download_button") if b.proto.label == "Download session file (.zip)")
    assert button.proto.disabled


def test_session_report_shows_intervals_and_the_study_verdict():
    bench_entry = {"prompts": 40, "prompt_set": "sharegpt-heldout", "max_new_tokens": 16, "device": "cpu",
                   "intervals": {"level": 0.95, "prompts": 40, "draws": 2000, "reference": "d"},
                   "results": [{"name": "autoregressive", "tau": 1.0, "tau_ci": [1.0, 1.0], "speedup": 1.0,
                                "speedup_ci": [1.0, 1.0], "tokens_per_s": 7.5, "lossless": True},
                               {"name": "d", "layers": [2, 15, 27], "tau": 1.1334, "tau_ci": [1.0912, 1.1601],
                                "speedup": 0.553, "speedup_ci": [0.52, 0.58], "tokens_per_s": 4.1, "lossless": True}]}
    row = {"strategies": ["entropy-topk"], "layers": [18, 26, 27], "mean_entropy": 3.1, "mean_cka": 0.4,
           "aggregate_entropy": 5.0, "tau": 1.1301, "tau_ci": [1.097, 1.162], "delta_vs_default": 0.0071,
           "delta_ci": [-0.016, 0.030], "speedup": 0.57, "speedup_ci": [0.55, 0.6],
           "seeds": [{"seed": 0}, {"seed": 1}], "tau_seed_range": 0.012}
    draft = {"name": "d", "layers": [2, 15, 27], "steps": 300, "tokens_seen": 200_000, "val_accuracy": [0.5, 0.4],
             "path": "/store/drafts/abc"}
    s = Session(model="m", bench_results=[bench_entry], drafts=[draft],
                         study=[{"rows": [row], "verdict": "No difference at this budget: <b>x</b>"}])
    page = session_report(s)
    drafts = page.split("<h2>Drafts</h2>")[1].split("</table>")[0]      # the page's drafts table, simulated_acc_len in
    assert "simulated_acc_len" in drafts and "0.700" in drafts and "50.0%, 40.0%" in drafts
    assert "1.133 [1.091, 1.160]" in page and "0.55× [0.52, 0.58]" in page    # one interval form everywhere
    assert "95% bootstrap intervals over the 40 prompts" in page
    assert "1.130 [1.097, 1.162]" in page and "+0.007 [-0.016, +0.030]" in page and "0.012" in page
    assert "No difference at this budget: &lt;b&gt;x&lt;/b&gt;" in page      # the verdict as plain text


def test_session_report_shows_every_name_as_plain_text_figures_included():
    link, paint = '<a href="https://evil.example/">click</a>', '<span style="position:fixed">X</span>'
    n = 6
    s = Session(name=link, model=paint, capture={"num_layers": n}, device=link,
                bench_results=[{"prompts": 4, "prompt_set": paint, "max_new_tokens": 8, "device": "cpu",
                                "results": [{"name": "autoregressive", "tau": 1.0, "speedup": 1.0},
                                            {"name": link, "layers": [1, 3], "tau": 1.2, "speedup": 1.1}]}])
    ent = [1.0 + 0.1 * i for i in range(n + 1)]
    s.set_stats({"capture_key": "k", "num_layers": n, "hidden_size": 8, "alpha": 1.0, "entropy": ent,
                 "entropy_normalized": ent, "entropy2": ent,
                 "cka": [[1.0 if i == j else 0.5 for j in range(n + 1)] for i in range(n + 1)]})
    s.add_layer_set(link, [1, 3])
    s.add_layer_set(paint, [2, 4])
    page = session_report(s)
    body = page[page.index("</head>"):]                      # the head holds plotly.js itself
    assert body.count("Plotly.newPlot") == 3                  # entropy, CKA, benchmark: each with the names
    assert "<a" not in body and "<span" not in body
    decoded = body.replace("\\u003c", "<").replace("\\u003e", ">").replace("\\u0026", "&").replace('\\"', '"')
    assert "<a" not in decoded and "<span" not in decoded     # nor inside the figures' JSON
    assert "&lt;a href=\"https://evil.example/\"&gt;click&lt;/a&gt;" in decoded     # shown, as text
    assert "&lt;span style=\"position:fixed\"&gt;X&lt;/span&gt;" in decoded


def test_the_report_keeps_every_warning_the_pages_showed():
    busy = quietness.classify(1.4, 1.4, 2.0, 2, 2, 5.0).to_json()
    drafts = [{"name": "shipped", "path": "/d/shipped", "layers": [2, 15, 27], "val_accuracy": [0.496],
               "tokens_seen": 1_250_000},
              {"name": "quick", "path": "/d/quick", "layers": [1, 9, 20], "val_accuracy": [0.042], "tokens_seen": 17_000}]
    bench_entry = {"prompts": 3, "prompt_set": "builtin", "max_new_tokens": 16, "device": "cpu", "machine": busy,
                   "drafts": [{"name": d["name"], "path": d["path"]} for d in drafts],
                   "results": [{"name": "autoregressive", "tau": 1.0, "tokens_per_s": 7.5, "lossless": True}]
                   + [{"name": d["name"], "layers": d["layers"], "tau": t, "speedup": 1.1, "tokens_per_s": 8.0,
                       "lossless": True} for d, t in zip(drafts, (1.6, 1.1))]}
    s = Session(model="m", bench_results=[bench_entry], drafts=drafts)
    page = html.unescape(session_report(s))
    shown = speculate.run_warnings(bench_entry, drafts)           # what the Speculative decoding page shows
    assert {level for level, _ in shown} == {"warning"} and len(shown) == 4
    for _, text in shown:
        assert text in page, text
    assert "machine: busy" in page and "Only 3 prompt(s)" in page and "4.2%, far below" in page
    assert "different budgets (shipped [2, 15, 27] 1,250,000, quick [1, 9, 20] 17,000" in page
