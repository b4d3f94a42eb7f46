"""Home: what LayerScope answers, the workflow with this session's progress, and what good results look like."""

from __future__ import annotations

import streamlit as st

from layerscope import fmt
from layerscope.ui import progress
from layerscope.ui.views import interrupted_jobs, page_header
from layerscope.ui.widgets import md_text

s, store = page_header("LayerScope",
                       "Which layers of the target model should an EAGLE-3 speculative-decoding draft read? LayerScope "
                       "measures how informative each layer is (matrix entropy) and how redundant two layers are (CKA), "
                       "proposes layer sets, and then checks a proposal for real: it trains a draft that reads the set "
                       "and measures how many of its tokens the target accepts (τ) in lossless speculative decoding.")

interrupted_jobs(s.id)      # a job a stopped server left unfinished: said here too, with how to resume
steps = progress.steps(s)
upcoming = progress.next_step(steps)
st.subheader("The workflow, and where this session is")
for i, x in enumerate(steps, start=1):
    mark = ":material/check_circle:" if x.done else (":material/arrow_circle_right:" if x is upcoming
                                                    else ":material/radio_button_unchecked:")
    with st.container(border=x is upcoming):
        c1, c2 = st.columns([4, 1], vertical_alignment="center")
        c1.markdown(f"{mark} **{i} · {x.name}**" + (" · next" if x is upcoming else "") + f"  \n{md_text(x.summary)}")
        c2.page_link(x.page, label="Open" if x.done else "Start here" if x is upcoming else "Go",
                     icon=":material/arrow_forward:")
if upcoming is None:
    st.success("Every step is done for this session: the Layer sets page recommends a set from the measurements, "
               "and the Sessions page writes the report.", icon=":material/task_alt:")

st.subheader("What good looks like")
st.markdown(
    "- **τ** (tokens per target forward) is what a draft buys: every speculative step runs the target once and keeps "
    "the accepted draft tokens plus one, so τ ≥ 1, and plain decoding has τ = 1. A higher τ with the same draft "
    "depth K is a better layer set.\n"
    "- **Speedup** is τ divided by what a speculative step costs in target forwards. A draft pays off only above the "
    "**break-even τ**: the cost of K draft steps and one target forward over K + 1 tokens, in plain decoding steps.\n"
    "- **Held-out agreement** of a trained draft (how often its first token is the target's on conversations it "
    "never saw) estimates first-position acceptance; near 0 means it has not learned, and then its τ says nothing "
    "about its layers.\n"
    "- **Intervals** [lo, hi] are 95% bootstrap intervals over the benchmark's prompts: two sets differ only when "
    "the interval of their difference excludes 0.")
even = progress.break_even(s)
if even:
    st.markdown(f"**Break-even τ on this machine** ({md_text(even['device'] or '?')}, from the cost curve of "
                f"{even['source']}, {fmt.when(even['when'])}): "
                + " · ".join(f"K = {k}: {fmt.tau(t)}" for k, t in zip(even["k"], even["tau"])))
    st.caption(f"A draft step costs {fmt.number(even['draft_step'], 3)}× a one-token target forward here, "
               + (f"as {md_text(even['draft_from'])} measured it in that benchmark (the draft and the decoder's "
                  "upkeep per step), the figure its verdict uses" if even["draft_from"] else
                  "as the cost curve timed it alone (no draft row of that benchmark measured a speedup)") + ".")
    if even["busy"]:
        st.caption("That benchmark ran while other work loaded this machine, so its cost curve (and these τ) are "
                   "rough; a benchmark on a quiet machine measures them again.")
else:
    st.caption("Break-even τ on this machine: not measured yet. A benchmark measures this machine's cost curve once "
               "(Speculative decoding page; or `layerscope profile`), and this page then shows the τ each draft depth "
               "needs to beat plain decoding here.")
