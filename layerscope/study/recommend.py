"""The Layer sets page's decision, from evidence: which layer set of one size a draft should read, and why.

A set's proxies (aggregate entropy, mean entropy, mean CKA) describe it but cannot rank the strategies: each
strategy maximises one of them (`aggregate` the aggregate entropy, `entropy-topk` the mean entropy), so ranking
by a proxy crowns that proxy's own strategy by construction. Sets are ranked instead by the strongest evidence
that no strategy optimises and that covers at least two of them:

    1. measured τ: the latest study (one budget, the same prompts; Δτ to the default rule with a paired interval),
       else the latest benchmark run, with its 95% interval;
    2. held-out agreement: a trained draft's agreement with the target at draft position 1 on held-out
       conversations (the estimate of first-position acceptance);
    3. the probe: the held-out agreement of a closed-form ridge map of the set (layerscope.study.probe; no training),
       when the session holds probe scores (s.view["probe"]: {"capture_key", "sets": [{"layers", "agreement"}]},
       from the Layer sets page's probe job); select.compare leaves the `probe` strategy out, so no set here was
       chosen by maximising it.

and only within one set size (a set with more layers carries more, whatever they are), and only what measured the
model the session analyses now (`same_target`; a study of the model captured before "Replace here" ranks nothing).
Every ranking states its sample: τ with its 95% interval, a draft's agreement with its held-out positions and training tokens, the probe's
with its held-out positions and conversations and a 95% bootstrap interval over conversations. Drafts trained on
different budgets (tokens seen more than sanity.BUDGET_RATIO apart) are not ranked by agreement against each other: the
largest group of one budget is, the others are left out and named, and with no such group the basis is refused (a
benchmark's τ of such drafts is ranked, with the budgets named). Sets the evidence cannot tell apart from the best
(`tied`: a paired bootstrap over the probe's conversations, a binomial interval over a draft's positions, the τ
intervals) are a tie, called one and ranked level; on a tie the default rule is recommended when it is among them,
else the first set without a flag (never one reading the embedding output or the final state). A measured winner is
recommended only when it beats the default rule beyond the interval; otherwise the default rule is (the
established choice, as good as far as the measurements tell). With no evidence at all the default rule is
recommended as the prior and the text says what to measure. When the evidence disagrees with the proxies (the
set with the highest aggregate entropy measured worse), the text says so, with the numbers.

Plain data in, plain data out; no Streamlit here (the Layer sets page, the HTML report and `layerscope recommend`
decide through it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from layerscope import fmt, layerset
from layerscope.decoding import sanity
from layerscope.stats import bootstrap
from layerscope.stats import select as sel
from layerscope.stats.analysis import LayerStats
from layerscope.stats.select import score_set
from layerscope.study.probe import MIN_HELD_OUT, ProbeOptions, held_out_conversations

BASES = ("τ", "held-out agreement", "probe agreement")


@dataclass
class Ranked:
    name: str                         # first proposer, then the others ("greedy = aggregate")
    layers: list[int]
    aggregate_entropy: float | None   # proxies: describe the set, never rank it
    mean_entropy: float | None
    mean_cka: float | None            # None for a one-layer set (no pair of layers)
    flags: list[str] = field(default_factory=list)
    is_default: bool = False
    tau: float | None = None          # measured, with its interval and where from
    tau_ci: list | None = None
    delta: float | None = None        # τ − the default rule's τ (a study's paired difference)
    delta_ci: list | None = None
    tau_source: str | None = None
    agreement: float | None = None    # a trained draft's held-out agreement at position 1
    probe: float | None = None        # the closed-form probe's held-out agreement
    rank: int | None = None           # by the basis; None when the basis did not measure this set
    agreement_n: int | None = None    # the draft's held-out positions behind `agreement`
    budget: int | None = None         # the draft's training tokens (tokens seen)
    probe_ci: list | None = None      # the probe's 95% bootstrap interval over held-out conversations
    probe_hits: list | None = None    # the probe's held-out positions right, per held-out conversation ...
    probe_counts: list | None = None  # ... of these positions
    tied: bool = False                # the evidence cannot tell it from the best measured set
    draft: str | None = None          # whose figures τ, agreement and budget are: one draft's name (None: unknown)
    draft_path: str | None = None
    tau_decoding: str | None = None   # the decoding τ was measured with ("chain k=2 + lookup 4"), when a benchmark says

    def value(self, basis: str | None) -> float | None:
        return {"τ": self.tau, "held-out agreement": self.agreement, "probe agreement": self.probe}.get(basis)


@dataclass
class Recommendation:
    k: int
    ranked: list[Ranked]              # the sets of size k: measured by the basis first (best first), then the rest
    best: Ranked | None               # None: no evidence at this size and no default rule of this size
    basis: str | None                 # what ranked them: one of BASES, or None (no evidence)
    source: str | None                # where the basis came from ("study #2", "benchmark #3", "drafts", "probe")
    text: str                         # the recommendation and why, in sentences
    disagreement: str | None = None   # the proxies' favourite lost on the evidence: said with the numbers
    other_sizes: list[Ranked] = field(default_factory=list)   # sets of another size, not ranked with these
    default_rank: int | None = None   # where the default rule stands (when it is of size k and measured)


def flags(layers, num_layers: int) -> list[str]:
    """Warnings about a set's layers: the embedding output (layer 0) and the final state (layer N)."""
    out = []
    if 0 in layers:
        out.append("reads layer 0, the embedding output: token identity only, which the draft already gets "
                   "from its own input embedding")
    if num_layers in layers:
        out.append(f"reads layer {num_layers}, the final state after the norm: drafts read layers 0..{num_layers - 1}")
    return out


# ---------------------------------------------------------------------------- evidence in a session

@dataclass
class Evidence:
    measured: list[tuple[str, dict]] = field(default_factory=list)   # [(source, {layers: entry})], preferred first
    agreement: dict = field(default_factory=dict)                   # {layers: held-out agreement @1}
    probe: dict = field(default_factory=dict)                       # {layers: probe agreement}
    drafts: dict = field(default_factory=dict)    # {layers: {"positions", "tokens"}}: the sample behind `agreement`
    probe_sample: dict = field(default_factory=dict)   # {layers: {"ci", "hits", "counts"}}: behind `probe`
    other_target: list[str] = field(default_factory=list)   # sources measured on another model: not used
    draft_of: dict = field(default_factory=dict)  # {layers: {"path", "name"}}: the draft behind `agreement`
    by_path: dict = field(default_factory=dict)   # {path: {"name", "agreement", "positions", "tokens"}}: every draft


def same_target(s, entry: dict) -> bool:
    """Whether a study, benchmark run or draft of session `s` measured the model the session now analyses: its
    target's fingerprint is the capture's, else (older entries without one) its capture is the session's. An
    entry that names neither predates both records and is taken as the session's."""
    fp, theirs = (getattr(s, "capture", None) or {}).get("fingerprint"), entry.get("target_fingerprint")
    if fp and theirs:
        return theirs == fp
    key = entry.get("capture_key") or entry.get("capture")
    return not (key and s.capture_key) or key == s.capture_key


def _key(layers) -> tuple:
    return tuple(int(l) for l in layers)


def evidence_of(s) -> Evidence:
    """What the session measured about layer sets: its latest study and latest benchmark run (τ with intervals), its
    drafts' held-out agreement, and the probe scores it holds for its capture; only what measured the model the
    session analyses now (same_target): a study of another model, captured earlier in this session, is named in
    `other_target` and ranks nothing."""
    ev = Evidence()
    for i in range(len(s.study) - 1, -1, -1):                  # the latest study of this model
        if not same_target(s, s.study[i]):
            ev.other_target.append(f"study #{i + 1}")
            continue
        rows = {_key(r["layers"]): {"tau": r["tau"], "tau_ci": r.get("tau_ci"), "delta": r.get("delta_vs_default"),
                                    "delta_ci": r.get("delta_ci"), "draft": r.get("draft")}
                for r in s.study[i].get("rows") or [] if r.get("tau") is not None}
        if rows:
            ev.measured.append((f"study #{i + 1}", rows))
        break
    for i in range(len(s.bench_results) - 1, -1, -1):          # the latest run of this model that measured a draft
        rows = {}
        for r in s.bench_results[i].get("results") or []:     # a set's first row: its draft's first decoding
            if r.get("layers") and r.get("tau") is not None and _key(r["layers"]) not in rows:
                d = _bench_draft(s.bench_results[i], r)
                rows[_key(r["layers"])] = {"tau": r["tau"], "tau_ci": r.get("tau_ci"), "draft": d.get("path"),
                                           "draft_name": d.get("name"), "decoding": r.get("decoding")}
        if rows and not same_target(s, s.bench_results[i]):
            ev.other_target.append(f"benchmark #{i + 1}")
            continue
        if rows:
            ev.measured.append((f"benchmark #{i + 1}", rows))
            break
    for d in s.drafts:                                          # later drafts of a set replace earlier ones
        if not same_target(s, d):
            continue
        a = sanity.agreement(d.get("val_accuracy"))
        sample = {"positions": d.get("val_positions"), "tokens": d.get("tokens_seen") or d.get("train_tokens")}
        if d.get("path"):
            ev.by_path[d["path"]] = {"name": d.get("name"), "agreement": a, **sample}
        if a is not None and d.get("layers"):
            ev.agreement[_key(d["layers"])] = a
            ev.drafts[_key(d["layers"])] = sample
            ev.draft_of[_key(d["layers"])] = {"path": d.get("path"), "name": d.get("name")}
    probe = s.view.get("probe") if isinstance(s.view.get("probe"), dict) else {}
    if probe.get("capture_key") == s.capture_key:
        for x in probe.get("sets") or []:
            if isinstance(x, dict) and x.get("layers") and not fmt.missing(x.get("agreement")):
                ev.probe[_key(x["layers"])] = float(x["agreement"])
                ev.probe_sample[_key(x["layers"])] = {"ci": x.get("agreement_ci"), "hits": x.get("hits"),
                                                      "counts": x.get("counts")}
    return ev


def _bench_draft(run: dict, row: dict) -> dict:
    """The draft ({"name", "path"}) a benchmark row decoded with, from the run's `drafts`: the one of the row's layers,
    or of several the one whose name starts the row's name (bench.build_contenders names rows so); {} if unknown."""
    same = [d for d in run.get("drafts") or [] if isinstance(d, dict) and _key(d.get("layers") or []) == _key(row["layers"])]
    named = [d for d in same if str(row.get("name", "")).startswith(str(d.get("name")))]
    pick = max(named, key=lambda d: len(str(d.get("name"))), default=None) or (same[0] if len(same) == 1 else None)
    return pick or {}


def draft_text(r: Ranked) -> str | None:
    """Whose figures a row shows, so two drafts of one set tell apart: "builtin · 3,750,000 tok · benchmark #2"."""
    if r.draft is None and r.draft_path is None:
        return None
    parts = [r.draft or r.draft_path.rstrip("/").rsplit("/", 1)[-1]]
    if r.budget:
        parts.append(f"{fmt.count(r.budget)} tok")
    if r.tau is not None and r.tau_source:
        parts.append(r.tau_source + (f", {r.tau_decoding}" if r.tau_decoding else ""))
    return " · ".join(parts)


# ---------------------------------------------------------------------------- the candidates

def candidates(selections, stats, num_layers: int, *, names: dict[str, str] | None = None,
               extra: list[tuple[str, list[int]]] = ()) -> list[Ranked]:
    """One row per distinct set: the strategies' selections (select.compare), then `extra` (name, layers) pairs
    (the session's sets, studied sets, drafts' sets), each with its proxies; named after its first proposer."""
    names = names or {}
    default = _key(layerset.default_layers(num_layers)[0])
    merged: dict[tuple, Ranked] = {}
    for label, layers, e in ([(names.get(x.strategy, x.strategy), x.layers, x.explanation) for x in selections]
                             + [(n, l, None) for n, l in extra]):
        key = _key(layers)
        if key in merged:
            if label not in merged[key].name.split(" = "):
                merged[key].name += f" = {label}"
            continue
        if e is None:
            try:
                e = score_set(stats, list(key))
            except Exception:        # a set that does not fit these statistics: shown without proxies
                e = {}
        k = len(key)
        merged[key] = Ranked(label, list(key), e.get("aggregate_entropy"), e.get("mean_entropy"),
                             e.get("mean_cka") if k > 1 else None, flags(key, num_layers), is_default=key == default)
    return list(merged.values())


# ---------------------------------------------------------------------------- the decision

def _attach(rows: list[Ranked], ev: Evidence) -> tuple[list[Ranked], str | None]:
    """Fill each row's measurements, one draft's figures to a row: when a set's τ was measured on another draft than
    the one behind its held-out agreement and budget, the set gets a second row for that draft (labelled by `draft`),
    never one row mixing the two. Returns (the rows, the measured source used for τ: the one covering most rows)."""
    best_source, best_cover = None, 0
    for source, measured in ev.measured:
        cover = sum(_key(r.layers) in measured for r in rows)
        if cover > best_cover:
            best_source, best_cover = source, cover
    out = []
    for r in rows:
        key = _key(r.layers)
        m, source = None, None
        for source, measured in sorted(ev.measured, key=lambda x: x[0] != best_source):
            if key in measured:
                m = measured[key]
                break
        d, p = ev.drafts.get(key) or {}, ev.probe_sample.get(key) or {}
        r.probe = ev.probe.get(key)
        r.probe_ci, r.probe_hits, r.probe_counts = p.get("ci"), p.get("hits"), p.get("counts")
        latest = ev.draft_of.get(key) or {}
        if m is None or not m.get("draft") or m.get("draft") == latest.get("path") or not latest.get("path"):
            if m is not None:                        # one draft (or nothing tells them apart): one row
                _set_tau(r, m, source)
            r.agreement, r.agreement_n, r.budget = ev.agreement.get(key), d.get("positions"), d.get("tokens")
            r.draft_path = (m or {}).get("draft") or latest.get("path")
            r.draft = (m or {}).get("draft_name") or latest.get("name") or (ev.by_path.get(r.draft_path) or {}).get("name")
            out.append(r)
            continue
        own = ev.by_path.get(m["draft"]) or {}        # τ's draft, with its own agreement and budget if the session has it
        _set_tau(r, m, source)
        r.agreement, r.agreement_n, r.budget = own.get("agreement"), own.get("positions"), own.get("tokens")
        r.draft_path, r.draft = m["draft"], m.get("draft_name") or own.get("name")
        twin = replace(r, flags=list(r.flags), tau=None, tau_ci=None, delta=None, delta_ci=None, tau_source=None,
                       tau_decoding=None,
                       probe=None, probe_ci=None, probe_hits=None, probe_counts=None,
                       agreement=ev.agreement.get(key), agreement_n=d.get("positions"), budget=d.get("tokens"),
                       draft_path=latest.get("path"), draft=latest.get("name"))
        for x in (r, twin):                          # the text names them apart too
            x.name += f" (draft {x.draft or 'unnamed'})"
        out += [r, twin]
    return out, best_source


def _set_tau(r: Ranked, m: dict, source: str) -> None:
    r.tau, r.tau_ci, r.delta, r.delta_ci, r.tau_source = (m["tau"], m.get("tau_ci"), m.get("delta"),
                                                          m.get("delta_ci"), source)
    r.tau_decoding = m.get("decoding")


def _above(ci) -> bool:
    return bool(ci) and None not in ci and ci[0] > 0


def _interval_text(r: Ranked) -> str:
    return fmt.interval(r.tau, r.tau_ci, "tau")


def evidence(r: Ranked, basis: str | None, sample: bool = True) -> str | None:
    """A set's number on `basis` with its sample and interval, in words: "15.6% [9.4%, 22.9%] over 96 held-out
    positions of 2 conversations"; `sample` False: the probe's number and interval alone (a tie's listing, whose sets
    share one sample, says it once: probe_sample_text)."""
    if basis == "τ":
        return None if r.tau is None else _interval_text(r) + (f" ({r.tau_source})" if r.tau_source else "")
    if basis == "held-out agreement":
        if r.agreement is None:
            return None
        sample = [f"over {fmt.count(r.agreement_n)} held-out positions" if r.agreement_n else "held-out positions "
                  "not recorded", f"{fmt.count(r.budget)} training tokens" if r.budget else "budget not recorded"]
        return f"{fmt.percent(r.agreement)} ({', '.join(sample)})"
    if basis == "probe agreement":
        if r.probe is None:
            return None
        if not r.probe_counts:
            return f"{fmt.percent(r.probe)} (sample not recorded: score the sets again)"
        ci = f" {fmt.ci(r.probe_ci, 'percent')}" if fmt.has_ci(r.probe_ci) else ""
        return f"{fmt.percent(r.probe)}{ci}" + (" " + probe_sample_text(r) if sample else "")
    return None


def probe_sample_text(r: Ranked) -> str:
    """The sample behind a probe score, once: "over 96 held-out positions of 2 conversation(s), too few to tell sets
    apart (fewer than 5)"; "(no interval: one conversation)" where the bootstrap has one to draw from."""
    n = len(r.probe_counts or [])
    few = f", too few to tell sets apart (fewer than {MIN_CONVERSATIONS})" if n < MIN_CONVERSATIONS else ""
    alone = "" if fmt.has_ci(r.probe_ci) or n != 1 else " (no interval: one conversation)"
    return f"over {fmt.count(sum(r.probe_counts or []))} held-out positions of {n} conversation(s){alone}{few}"


def probe_note(conversations) -> str | None:
    """Said before the probe runs, when it cannot settle anything: a capture of `conversations` conversations leaves
    the probe fewer than MIN_CONVERSATIONS held out (probe.held_out_conversations), so every set would tie; None
    when it leaves enough (or the count is unknown)."""
    if not isinstance(conversations, int) or conversations < 1:
        return None
    held = held_out_conversations(conversations, ProbeOptions.val_fraction)
    if held >= MIN_CONVERSATIONS:
        return None
    return (f"This capture has {conversations} conversation(s): the probe holds out {held}, fewer than "
            f"{MIN_CONVERSATIONS}, so it will call every set a tie. Capture at least {3 * MIN_CONVERSATIONS} prompts "
            "for the probe to tell sets apart.")


Z95 = 1.96
MIN_CONVERSATIONS = MIN_HELD_OUT   # fewer held-out conversations: the probe's sets are a tie, whatever the numbers


def _same_budget(rows: list[Ranked]) -> tuple[list[Ranked], list[Ranked]]:
    """(the rows to compare, the rows left out): the largest group of drafts whose training tokens lie within
    BUDGET_RATIO of each other; rows whose budget is unknown are kept (nothing says they differ)."""
    known = sorted((r for r in rows if r.budget), key=lambda r: r.budget)
    if not sanity.different_budgets(_budget_rows(known)):
        return rows, []
    group = max(([r for r in known if lo.budget <= r.budget <= sanity.BUDGET_RATIO * lo.budget] for lo in known),
                key=len)
    left = [r for r in known if r not in group]
    return [r for r in rows if r not in left], left


def _budget_rows(rows: list[Ranked]) -> list[dict]:
    return [{"name": r.name, "layers": r.layers, "tokens": r.budget} for r in rows]


def _budgets(rows: list[Ranked]) -> str:
    return sanity.budgets_text(_budget_rows(rows))


def tied(top: Ranked, r: Ranked, basis: str) -> bool:
    """Whether the evidence cannot tell `r` from the better-measured `top`: the probe by a paired bootstrap of
    the difference over the same held-out conversations (else the intervals overlapping), a draft's agreement by
    a binomial interval of the difference over their held-out positions, τ by a paired interval to the default
    rule or the intervals overlapping; without a sample, equal values (as shown) are a tie. A probe over fewer
    than MIN_CONVERSATIONS held-out conversations ties every set."""
    a, b = top.value(basis), r.value(basis)
    if basis == "probe agreement":
        if top.probe_counts and len(top.probe_counts) < MIN_CONVERSATIONS:
            return True                  # a bootstrap over so few conversations cannot tell sets apart
        if top.probe_counts and top.probe_counts == r.probe_counts and top.probe_hits and r.probe_hits \
                and len(top.probe_counts) >= 2:
            idx = bootstrap.resample(len(top.probe_counts))
            counts = torch.tensor(top.probe_counts)
            diff = (bootstrap.ratio_of_sums(torch.tensor(top.probe_hits), counts, idx)
                    - bootstrap.ratio_of_sums(torch.tensor(r.probe_hits), counts, idx))
            ci = bootstrap.interval(diff)
            return ci is None or not ci[0] > 0
        if fmt.has_ci(top.probe_ci) and fmt.has_ci(r.probe_ci):
            return top.probe_ci[0] <= r.probe_ci[1]
    elif basis == "held-out agreement" and top.agreement_n and r.agreement_n:
        se = math.sqrt(a * (1 - a) / top.agreement_n + b * (1 - b) / r.agreement_n)
        return a - b <= Z95 * se
    elif basis == "τ":
        if r.is_default and top.delta_ci and None not in top.delta_ci:       # a study's paired difference
            return not _above(top.delta_ci)
        if top.is_default and r.delta_ci and None not in r.delta_ci:
            return not r.delta_ci[1] < 0
        if fmt.has_ci(top.tau_ci) and fmt.has_ci(r.tau_ci):
            return top.tau_ci[0] <= r.tau_ci[1]
        return fmt.tau(a) == fmt.tau(b)
    return fmt.percent(a) == fmt.percent(b)


def _rank(measured: list[Ranked], basis: str) -> list[Ranked]:
    """Ranks 1.. by the basis, the sets tied with the best all 1 (`tied` set), equal values level; returns the
    tie at the top (the best and those tied with it)."""
    top = measured[0]
    group = [top] + [r for r in measured[1:] if tied(top, r, basis)]
    for i, r in enumerate(measured, start=1):
        r.tied = len(group) > 1 and r in group
        prev = measured[i - 2] if i > 1 else None
        r.rank = 1 if r in group else (prev.rank if prev is not None and prev.value(basis) == r.value(basis) else i)
    return group


def _tie_pick(group: list[Ranked]) -> tuple[Ranked, str]:
    """The set recommended from a tie, and why: the default rule when it is in the tie, else the first set with
    no flag (never one that reads the embedding output or the final state), else the best measured."""
    default = next((r for r in group if r.is_default and not r.flags), None)
    if default is not None:
        return default, "the default rule, the established choice"
    clean = next((r for r in group if not r.flags), None)
    if clean is not None:
        why = "the best measured of them" if clean is group[0] else "the best measured of them without a flag"
        return clean, why + (" (the others read the embedding output or the final state)"
                             if any(r.flags for r in group) else "")
    return group[0], "the best measured; every set in the tie has a flag"


def recommend(rows: list[Ranked], k: int, ev: Evidence | None = None) -> Recommendation:
    """Rank the rows of size `k` by the strongest evidence covering two or more of them; recommend one, say why."""
    ev = ev or Evidence()
    same = [r for r in rows if len(r.layers) == k]
    other = [r for r in rows if len(r.layers) != k]
    if not same and not other:
        raise ValueError("recommend needs at least one layer set")
    same, source = _attach(same, ev)
    other, _ = _attach(other, ev)
    basis, measured, refused, left_out = _basis_of(same)
    group = _rank(measured, basis) if measured else []
    ranked = measured + [r for r in same if r not in measured]
    default = next((r for r in same if r.is_default), None)
    if basis is None:
        text = _unmeasured_text(default, len(same), k, refused) + _other_target_text(ev)
        return Recommendation(k, ranked, default, None, None, text, None, other, None)
    where = {"τ": source, "held-out agreement": "the session's drafts", "probe agreement": "the probe"}[basis]
    best, why = _pick_measured(measured, group, basis, where, default)
    best, tie_text = _tie_text(group, basis, best, measured[0])
    if len(group) > 1 and basis != "τ":
        why[0] = f"tied at the top by the {basis}, from {where}"
    text = f"Recommended: {best.name} {fmt.layers(best.layers)}, " + "; ".join(why) + "." + tie_text
    text += _ranking_notes(measured, left_out, basis, source)
    disagreement = _disagreement(same, best, basis)
    if disagreement:
        text += " " + disagreement
    text += _collapse_note(measured, basis)
    text += "".join(" " + x for x in refused)
    if basis != "τ" and ev.measured:
        text += f" (No measured τ covers two or more sets of {k} layers yet.)"
    text += _other_target_text(ev)
    return Recommendation(k, ranked, best, basis, where, text, disagreement, other,
                          default.rank if default is not None else None)


def _basis_of(same: list[Ranked]) -> tuple[str | None, list[Ranked], list[str], list[Ranked]]:
    """(the basis, the rows it measured best first, why stronger bases were refused, the rows left out of it): the
    first of BASES that measured two or more rows; drafts' agreement only among drafts of one budget."""
    refused: list[str] = []
    for b in BASES:
        have = [r for r in same if r.value(b) is not None]
        left: list[Ranked] = []
        if b == "held-out agreement":
            have, left = _same_budget(have)
            if left and len(have) < 2:
                refused.append(f"The drafts' held-out agreement does not rank these sets: the drafts were trained on "
                               f"different budgets ({_budgets(left + have)} training tokens), so their agreement "
                               "differs by the budget as much as by the layers. Train them on one budget (the study "
                               "does) to compare them.")
                continue
        if len(have) >= 2:
            return b, sorted(have, key=lambda r: (-r.value(b), r.layers)), refused, left
    return None, [], refused, []


def _unmeasured_text(default: Ranked | None, count: int, k: int, refused: list[str]) -> str:
    """The recommendation when nothing measured tells the `count` sets of `k` layers apart: the default rule, if of
    this size, and what to measure."""
    if default is not None:
        text = (f"Recommended: the default rule {fmt.layers(default.layers)}, EAGLE-3's choice, as "
                f"{'no comparable measurement' if refused else 'nothing measured'} yet tells these {count} "
                f"sets of {k} layers apart.")
    else:
        text = f"No recommendation for sets of {k} layers yet: nothing measured tells these {count} sets apart."
    text += "".join(" " + x for x in refused)
    return text + (" The proxies in the table describe each set, but every strategy maximises one of them, so they "
                   "cannot rank the strategies. Train a draft for two or more sets (or run the study) on the Speculative "
                   "decoding page; their held-out agreement and measured τ then rank them.")


def _pick_measured(measured: list[Ranked], group: list[Ranked], basis: str, where: str | None,
                   default: Ranked | None) -> tuple[Ranked, list[str]]:
    """(the set recommended before a tie is considered, the reasons): the best measured, except that on τ the
    default rule stays unless the best beat it beyond the interval."""
    top = measured[0]
    if basis != "τ":
        why = [f"the highest {basis} of the {len(measured)} sets with one, from {where}: {evidence(top, basis)}"]
        if len(measured) > 1 and len(group) == 1:
            nxt = measured[1]
            why.append(f"next, {nxt.name} {fmt.layers(nxt.layers)}: {evidence(nxt, basis)}")
        why.append("an estimate of first-position acceptance, not a measurement of τ: confirm it with a benchmark "
                   "or the study" if basis == "held-out agreement" else
                   "a closed-form fit, not a trained draft: confirm it with drafts, a benchmark or the study")
        return top, why
    why = [f"the highest measured τ of the {len(measured)} sets measured ({where}): {_interval_text(top)}"]
    if default is None or top is default or default.tau is None:
        return top, why
    if top.delta is not None and top.delta_ci:
        beaten = _above(top.delta_ci)
        gap = f"Δτ to the default rule {fmt.interval(top.delta, top.delta_ci, 'delta')}"
    elif top.tau_ci and default.tau_ci:
        beaten = top.tau_ci[0] > default.tau_ci[1]
        gap = f"the default rule {fmt.interval(default.tau, default.tau_ci, 'tau')}"
    else:
        beaten, gap = False, f"the default rule {fmt.tau(default.tau)}, no intervals"
    if not beaten:
        return default, [f"no set beat it beyond the interval: the best measured, {top.name} {fmt.layers(top.layers)} "
                         f"at {_interval_text(top)}, against {gap}"]
    return top, why + [f"above the default rule beyond the interval ({gap})"]


def _tie_text(group: list[Ranked], basis: str, best: Ranked, top: Ranked) -> tuple[Ranked, str]:
    """(the set recommended, the sentence on the tie at the top, "" without one): from a tie, `_tie_pick`'s choice,
    unless the default rule was kept over the best measured on τ."""
    if len(group) < 2:
        return best, ""
    pick, reason = _tie_pick(group)
    if best is top or best not in group:
        best = pick
    shared = basis == "probe agreement" and all(r.probe_counts == group[0].probe_counts for r in group)
    names = "; ".join(f"{r.name} {fmt.layers(r.layers)} {evidence(r, basis, sample=not shared)}" for r in group)
    if shared and group[0].probe_counts:            # one sample for all: said once, not once per set
        names += f"; each {probe_sample_text(group[0])}"
    return best, (f" A tie: the {basis} does not tell {len(group)} sets apart ({names}); they are ranked level, "
                  f"and {best.name} {fmt.layers(best.layers)} is recommended as "
                  + (reason if best is pick else "the default rule, the established choice") + ".")


def _ranking_notes(measured: list[Ranked], left_out: list[Ranked], basis: str, source: str | None) -> str:
    """What the ranking leaves out (drafts of another budget) and, for a benchmark's τ, drafts of different budgets."""
    text = ""
    if left_out:
        text += (f" Left out of the ranking: {_budgets(left_out)} training tokens, a different budget from the drafts "
                 f"ranked ({_budgets([r for r in measured if r.budget])}); their agreement is not comparable.")
    if basis == "τ" and (source or "").startswith("benchmark"):
        budgets = sanity.budget_warning(_budget_rows(measured))
        if budgets:
            text += " Caution: " + budgets
    return text


def _disagreement(same: list[Ranked], best: Ranked, basis: str) -> str | None:
    """When the set with the highest aggregate entropy (no flag) measured lower than the one recommended, and not
    in a tie with it: the sentence that says so, with the numbers; else None."""
    proxy_top = max((r for r in same if r.aggregate_entropy is not None and not r.flags),
                    key=lambda r: r.aggregate_entropy, default=None)
    if proxy_top is None or proxy_top is best or proxy_top.value(basis) is None or best.value(basis) is None \
            or not proxy_top.value(basis) < best.value(basis) or proxy_top.tied:
        return None
    if basis == "τ":
        diff = (fmt.interval(proxy_top.delta, proxy_top.delta_ci, "delta")
                if best.is_default and proxy_top.delta is not None else fmt.delta(proxy_top.tau - best.tau))
        numbers = f"τ {_interval_text(proxy_top)} against {_interval_text(best)} (Δτ {diff})"
    else:
        numbers = f"{basis} {evidence(proxy_top, basis)} against {evidence(best, basis)}"
    return (f"The measurements disagree with the proxies: {proxy_top.name} {fmt.layers(proxy_top.layers)} "
            f"has the highest aggregate entropy of these sets (the proxy the `aggregate` strategy maximises), "
            f"but measured lower: {numbers}. The recommendation follows the measurement.")


def _collapse_note(measured: list[Ranked], basis: str) -> str:
    """A caution naming the measured drafts that may not have learned (sanity.collapse_reasons); "" when none."""
    if basis not in ("τ", "held-out agreement"):
        return ""
    reasons = sanity.collapse_reasons([{"layers": r.layers, "tau": r.tau if basis == "τ" else None,
                                        "val_accuracy": r.agreement} for r in measured])
    doubtful = [f"{r.name} {fmt.layers(r.layers)}" for r, why in zip(measured, reasons) if why]
    if not doubtful:
        return ""
    return (f" Caution: the drafts behind {', '.join(doubtful)} may not have learned ("
            + next(why for why in reasons if why) + "), so their numbers say little about their layers.")


def _other_target_text(ev: Evidence) -> str:
    if not ev.other_target:
        return ""
    return (f" Not used: {', '.join(ev.other_target)}, measured on another model (this session's earlier "
            "capture): which layers serve one model says nothing of another's.")


def probe_job_current(view, k: int) -> bool:
    """Whether the Layer sets page shows the latest probe job's status at set size `k`: while it runs or when it
    failed, and once done only when it scored a set of `k` layers (a "done" from another size is stale)."""
    if view is None:
        return False
    if view.state != "done":
        return True
    return any(len(x.get("layers") or []) == int(k) for x in (view.result or {}).get("sets") or [])


def set_label(names, layers, session_sets=()) -> str:
    """How a studied set reads: its first proposer, then the others ("default, also greedy"); "manual" (a
    set of the session) becomes the name the user gave it."""
    own = {tuple(x["layers"]): x["name"] for x in session_sets}
    shown = [own.get(tuple(layers), "your set") if n == "manual" else n for n in names]
    shown = list(dict.fromkeys(shown))
    return shown[0] + (f", also {', '.join(shown[1:])}" if len(shown) > 1 else "")


def for_session(s, stats: dict, k: int, *, lam: float = 0.5, manual=None, manual_name: str = "hand-picked"):
    """(Recommendation, selections) for the session: every strategy's set of size `k` (select.compare, with the
    hand-picked `manual` set), the session's own sets, its latest study's sets and its drafts' sets, ranked by the
    session's evidence. The Layer sets page and the HTML report both decide through here."""
    n = int(stats["num_layers"])
    layer_stats = LayerStats.from_dict(stats)
    selections = sel.compare(layer_stats, int(k), lam=float(lam), layers=list(manual) if manual else None)
    extra = ([(x["name"], x["layers"]) for x in s.layer_sets]
             + [(set_label(r["strategies"], r["layers"], s.layer_sets), r["layers"])
                for study in s.study[-1:] for r in study.get("rows") or []]
             + [(d["name"], d["layers"]) for d in s.drafts])
    rows = candidates(selections, layer_stats, n, names={"manual": manual_name},
                      extra=[(name, ls) for name, ls in extra if ls and all(0 <= l < n for l in ls)])
    return recommend(rows, int(k), evidence_of(s)), selections


def as_left(s, stats: dict) -> Recommendation:
    """The Layer sets page's recommendation for session `s` as it was left (its set size k, λ, hand-picked set and
    its name, in s.view), from the statistics `stats` and the session's evidence: the HTML report and
    `layerscope recommend` say this."""
    n = int(stats["num_layers"])
    k = max(1, min(int(s.view.get("sets_k") or len(layerset.default_layers(n)[0])), n))
    manual = [l for l in s.manual_picks if 0 <= l < n]
    rec, _ = for_session(s, stats, k, lam=float(s.view.get("sets_lam", 0.5)), manual=manual,
                         manual_name=s.view.get("sets_name") or "hand-picked")
    return rec


def headroom(k: int) -> float:
    """How far a set's aggregate entropy can rise above its layers' own α = 2 entropy: log k (no shared information)."""
    return math.log(k) if k > 0 else 0.0
