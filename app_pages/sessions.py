"""Sessions: save the analysis under a name, reopen it, share it by link or as a file, import one."""

from __future__ import annotations

from urllib.parse import urlsplit

import pandas as pd
import streamlit as st

from layerscope import fmt
from layerscope.session import share, storage
from layerscope.ui import report
from layerscope.ui.access import me
from layerscope.ui.state import SHARE, commit, make_share_snapshot, session_title, switch_to
from layerscope.ui.views import page_header
from layerscope.ui.widgets import guard, md_text, offered, table

s, store = page_header("Sessions",
                       "A session is everything on these pages: the capture, analysis options, statistics, layer sets, "
                       "drafts and benchmark results. It is saved as you work and belongs to this browser; give it a "
                       "name to list it here. A share link opens a read-only snapshot; whoever opens it edits a copy. "
                       "Files are JSON + safetensors in one .zip, checked on import; nothing is ever unpickled.")


def share_link(sid: str) -> str:
    url = st.context.url or ""
    parts = urlsplit(url)
    base = f"{parts.scheme}://{parts.netloc}" if parts.scheme and parts.netloc else ""
    return f"{base}/cka?session={sid}"


left, right = st.columns(2, gap="large")
with left:
    st.subheader("This session")
    summary = st.empty()        # filled after the save button: it shows the name just given
    st.session_state.setdefault("ls_w_sess_name", s.name or "")
    name = st.text_input("Name", key="ls_w_sess_name", placeholder="e.g. SmolLM2 builtin-16, first look", max_chars=120)
    if st.button("Save", type="primary", key="ls_sess_save", icon=":material/save:"):
        with guard("save session"):
            if not name.strip():
                st.error("**A session needs a name to be saved.** Type one above.")
            else:
                if commit(s, name=name):
                    st.success(f"Saved as “{md_text(s.name)}”.")
    summary.markdown(f"**{md_text(session_title(s))}** · id `{s.id}` · capture `{s.capture_key or '—'}` · "
                     f"{len(s.layer_sets)} set(s) · {len(s.drafts)} draft(s) · {len(s.bench_results)} benchmark(s)")
    shared = s.view.get(SHARE) if isinstance(s.view.get(SHARE), dict) else None
    if st.button("Make a share link" if shared is None else "Make a new share link (of the session as it is now)",
                 key="ls_sess_share", icon=":material/share:"):
        with guard("share link"):
            make_share_snapshot(s)
            shared = s.view[SHARE]
    if shared is not None:
        st.markdown(f"**Share link** (a read-only snapshot of this session, as it was {fmt.when(shared.get('at'))}; "
                    "later changes are not in it; on this server, on the CKA page):")
        st.code(share_link(shared["id"]), language=None, wrap_lines=True)     # the whole link, even in a narrow column
    with_drafts = st.checkbox("Include drafts", key="ls_w_sess_with_drafts", disabled=not s.drafts,
                              help="Put each draft's files (weights and JSON) into the archive, so the session's "
                                   "benchmarks and exports work on another server; without it drafts stay paths")
    archive = lambda: share.export_bytes(s)    # noqa: E731  (built on click: a plain archive cannot fail)
    if with_drafts:
        archive = None    # built now, so a draft that does not load is one error line, not a failed download
        with guard("session archive"):
            archive = share.export_bytes(s, drafts=True)
    st.download_button("Download session file (.zip)", data=archive if archive is not None else b"",
                       disabled=archive is None,
                       file_name=f"layerscope-session-{fmt.file_part(s.name or s.id)}"
                                 f"{'-with-drafts' if with_drafts else ''}.zip",
                       mime="application/zip", key="ls_sess_download", on_click="ignore", icon=":material/download:")
    if with_drafts:
        missing = share.missing_drafts(s)
        st.caption(f"{len(s.drafts) - len(missing)} of {len(s.drafts)} draft(s) go into the archive"
                   + (f"; not on this server, so left out: {md_text(', '.join(missing))}" if missing else "") + ".")
    st.download_button("Download report (HTML)", data=lambda: report.session_report(s).encode(),
                       file_name=f"layerscope-report-{fmt.file_part(s.name or s.id)}.html", mime="text/html",
                       key="ls_sess_report",
                       on_click="ignore", icon=":material/description:",
                       help="One self-contained page: the statistics, ranked layer sets and recommendation, benchmark "
                            "and study results, with interactive figures that open without a network")

with right:
    st.subheader("Import a session file")
    up = st.file_uploader("Session archive (.zip) exported by LayerScope", type=["zip"], key="ls_sess_upload")
    if up is not None:
        marker = (up.name, up.size)
        if st.session_state.get("ls_sess_imported") != marker:
            with guard("import session"):
                imported = share.import_archive(up.getvalue(), store, source=up.name, owner=me())
                st.session_state["ls_sess_imported"] = marker
                st.session_state["ls_sess_imported_id"] = imported.session.id
                st.session_state["ls_sess_imported_drafts"] = len(imported.drafts)
        iid = st.session_state.get("ls_sess_imported_id")
        if st.session_state.get("ls_sess_imported") == marker and iid:
            brought = st.session_state.get("ls_sess_imported_drafts", 0)
            st.success(f"Imported session `{iid}`. Its statistics and sets come with it"
                       + (f", and {brought} draft(s), now in this store" if brought else "")
                       + "; its capture and other drafts are used when this store holds them.")
            if st.button("Open the imported session", key="ls_sess_open_imported", icon=":material/folder_open:"):
                with guard("open session"):
                    switch_to(storage.load(store, iid))
                    st.rerun()

st.divider()
st.subheader("Your saved sessions")
show_all = st.toggle("Also list unnamed (autosaved) sessions", key="ls_w_sess_all")
with guard("list sessions"):
    rows = storage.list_sessions(store, include_unnamed=show_all, owner=me())     # this browser's own
    if not rows:
        st.caption("No saved sessions yet.")
    else:
        df = pd.DataFrame([{"name": r.get("name") or "(unnamed)", "updated": fmt.when(r.get("updated")),
                            "model": r.get("model"), "prompt set": r.get("prompt_set"), "tokens": r.get("tokens"),
                            "layer sets": ", ".join(fmt.layers(x) if isinstance(x, list) else str(x)
                                                    for x in r.get("layer_sets", [])),
                            "drafts": r.get("drafts"), "id": r["id"], "problem": r.get("error", "")} for r in rows])
        table(df, key="ls_sess_table", filename="sessions")
        ids = [r["id"] for r in rows if not r.get("error")]
        labels = {r["id"]: f"{r.get('name') or '(unnamed)'} · {r['id']}" for r in rows}
        if ids:
            c1, c2, c3 = st.columns([3, 1, 1])
            offered("ls_sess_pick", ids)
            pick = c1.selectbox("Session", ids, format_func=labels.get, key="ls_sess_pick")
            if c2.button("Open", key="ls_sess_open", icon=":material/folder_open:"):
                with guard("open session"):
                    switch_to(storage.load(store, pick))
                    st.rerun()
            if c3.button("Delete", key="ls_sess_delete", icon=":material/delete:", disabled=pick == s.id,
                         help="The session open in this tab cannot be deleted"):
                with guard("delete session"):
                    storage.delete(store, pick, owner=me())
                    st.rerun()
