"""Job functions the pages start in the background: thin adapters from layerscope.steps.workflow to `Job` progress.

Each `*_job(...)` builds a function `fn(job) -> result` for `JobManager.submit`. Decorated with
`worker.job_task`, calling it returns a picklable `Task` (its name and arguments, the store as its root)
that the JobManager runs in the worker process, where the function is built; the function calls the step's
workflow function with the app's model cache as loader (`load_in_job`) and turns the step's progress
into `job.update`. Results are plain dicts (JSON-able), so a page can apply them to the session and
the session can be saved as is. Nothing here draws anything.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from pathlib import Path

from layerscope import eta
from layerscope.capture.run import CaptureOptions
from layerscope.capture.stored import open_capture
from layerscope.decoding.bench import BenchOptions, Tally, parse_lookup
from layerscope.draft import builtin
from layerscope.draft.checkpoint import read_meta
from layerscope.draft.training.fit import TrainOptions
from layerscope.draft.training.online import OnlineOptions
from layerscope.draft.training.progress import EvalProgress, FeaturesProgress, ResponsesProgress, TrainProgress
from layerscope.errors import DraftError, LayerScopeError, PromptSetError
from layerscope.prompts.sets import load_prompts
from layerscope.stats.analysis import AnalysisOptions, LayerStats
from layerscope.steps import forecast, workflow
from layerscope.store import atomic_write_bytes
from layerscope.study import probe
from layerscope.study.run import StudyOptions, propose_sets
from layerscope.target.load import default_device
from layerscope.ui.model_cache import get_model, load_message, loaded_models
from layerscope.ui.worker import job_task


def load_in_job(job, spec: str, store):
    """workflow's `load` for a job: the model from the app's per-process cache, saying so on the job."""
    job.update(None, load_message(spec, store), eta_s=None)
    target = get_model(spec, store)
    job.check_cancel()
    return target


# ---------------------------------------------------------------------------- prompts

def save_upload(store, name: str, data: bytes) -> Path:
    """Keep an uploaded prompt file in the store (content-addressed: uploads/<digest>/<name>) so capture can read it
    by path. An upload is a store entry: counted by the size limit, evicted least recently used, and removed when
    the last capture that holds it ends (`hold_upload`, `release_upload`: two sessions can queue captures of one
    file); the Capture page saves it again while it holds the file."""
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in Path(name).name)[:80] or "prompts.txt"
    if not safe.lower().endswith((".jsonl", ".txt", ".csv")):
        raise PromptSetError(f"{name} is not a .jsonl, .txt or .csv file",
                             "Upload JSON lines (prompt/turns/conversations), plain text (one prompt per line) or CSV with a 'prompt' column")
    digest = hashlib.sha256(data).hexdigest()[:16]
    path = Path(store.path("uploads", digest)) / safe
    if not path.is_file():
        atomic_write_bytes(path, data)
    store.touch("uploads", digest)
    return path


def upload_of(store, spec: str) -> str | None:
    """The upload entry (its digest) a prompt spec names, when it is a file `save_upload` kept; else None."""
    path = Path(spec)
    if path.parent.parent == Path(store.root) / "uploads" and store.path("uploads", path.parent.name) == path.parent:
        return path.parent.name
    return None


UPLOAD_HOLDS = ".holds"        # uploads/<digest>/.holds/<token>: one file per capture submitted with the upload


def hold_upload(store, spec: str | None) -> str | None:
    """A capture of the uploaded prompt file `spec` is being submitted: a hold on it (a token for release_upload),
    so that another capture of the same file, ending first, leaves it in place. None when `spec` is no upload."""
    digest = upload_of(store, spec) if spec else None
    if digest is None:
        return None
    token = uuid.uuid4().hex
    with store.lock("uploads", digest):
        holds = store.path("uploads", digest) / UPLOAD_HOLDS
        holds.mkdir(parents=True, exist_ok=True)
        (holds / token).touch()
    return token


def release_upload(store, spec: str, hold: str | None = None) -> None:
    """A capture that read an uploaded prompt file has ended (done, failed or cancelled): its hold goes, and the
    upload with it when no other capture holds it (a capture submitted without a hold: when none does)."""
    digest = upload_of(store, spec)
    if digest is None:
        return
    with store.lock("uploads", digest):
        holds = store.path("uploads", digest) / UPLOAD_HOLDS
        if hold:
            (holds / hold).unlink(missing_ok=True)
        if not (holds.is_dir() and any(holds.iterdir())):
            store.remove("uploads", digest)


def load_prompt_set(spec: str, limit: int | None, seed: int):
    return load_prompts(spec, limit=limit, seed=seed)


# ---------------------------------------------------------------------------- capture

def capture_summary(manifest: dict) -> dict:
    """What the session keeps about a capture."""
    keys = ("key", "model", "fingerprint", "num_layers", "hidden_size", "prompt_set", "tokens", "created",
            "seconds", "final_state")
    out = {k: manifest.get(k) for k in keys if manifest.get(k) is not None}
    prompts = manifest.get("prompts")
    out["conversations"] = manifest.get("conversations") or (len(prompts) if isinstance(prompts, list) else None)
    out["options"] = manifest.get("options", {})
    return out


def bench_defaults() -> BenchOptions:
    """What the benchmark widgets start from: BenchOptions' defaults (20 prompts: sanity.ENOUGH_PROMPTS)."""
    return BenchOptions()


@job_task
def capture_job(*, model: str, prompts: str, limit: int | None, max_new_tokens: int, batch_size: int, seed: int,
                store, analysis_options: dict | None = None, sample_positions: int | None = None,
                max_store_bytes: int | None = None, upload_hold: str | None = None):
    """workflow.capture (the model from the app's cache), then the default statistics (workflow.analyze).
    upload_hold: hold_upload's token when `prompts` is an uploaded file (released when the capture ends)."""
    options = CaptureOptions(limit=limit, max_new_tokens=max_new_tokens, batch_size=batch_size, seed=seed,
                             sample_positions=sample_positions, max_store_bytes=max_store_bytes)
    options.validate()                        # bad options fail where the page starts the job

    def run(job):
        t0 = time.perf_counter()

        def progress(p):
            if p.estimate is not None:            # before the first batch: what the capture will write
                job.update(0.05, "; ".join(p.estimate.lines()), estimate_bytes=p.estimate.total, eta_s=None)
                return
            total = max(p.conversations_total, 1)
            step = batch_size / total
            within = 0.8 * min(p.generated / max(max_new_tokens, 1), 1.0) if p.phase == "generate" else 0.8
            frac = p.conversations_done / total + step * within if p.fraction is None else p.fraction
            if p.phase == "done":
                frac = 1.0
            job.update(0.05 + 0.85 * min(frac, 1.0),
                       f"{p.phase}: {p.conversations_done}/{p.conversations_total} prompts, {p.tokens_done:,} tokens"
                       + (f" (batch at token {p.generated}/{max_new_tokens})" if p.phase == "generate" and p.generated else ""),
                       tokens=p.tokens_done, tokens_per_s=p.tokens_per_s, conversations=p.conversations_done,
                       conversations_total=p.conversations_total, eta_s=p.eta_s)

        job.update(0.0, f"reading prompt set {prompts}")
        try:
            done = workflow.capture(model, prompts, options, store, load=lambda spec, st: load_in_job(job, spec, st),
                                    progress=progress, should_stop=job.should_stop)
        finally:
            release_upload(store, prompts, upload_hold)    # an uploaded file is kept while a capture holds it
        result, prompt_set = done.result, done.prompt_set
        out = {"key": result.key, "cached": result.cached, "seconds": result.seconds, "tokens": result.tokens,
               "summary": capture_summary(result.manifest), "model": model, "prompt_set": prompt_set.name,
               "warnings": list(prompt_set.warnings)[:20],
               "conversations": min(limit or len(prompt_set.prompts), len(prompt_set.prompts)),
               "capture_seconds": time.perf_counter() - t0}
        job.update(0.9, f"captured {result.tokens:,} tokens; computing layer statistics", tokens=result.tokens)
        stats = analyze_now(store, result.key, analysis_options or {}, job, base=0.9, span=0.1)
        out["stats"], out["requested"] = stats, dict(analysis_options or {})
        return out

    return run


# ---------------------------------------------------------------------------- statistics

def fraction_progress(job, base: float = 0.0, span: float = 1.0):
    """A step's `progress(fraction, message)` on `job`: its share of [base, base + span] of the bar, and the time left
    at the step's own rate through its fractions (layerscope.eta)."""
    if job is None:
        return None
    timer = eta.PhaseClock(1.0)
    return lambda frac, msg="": job.update(base + span * float(frac), msg or None, eta_s=timer.left(float(frac)))


def analyze_now(store, capture_key: str, options: dict, job=None, base: float = 0.0, span: float = 1.0) -> dict:
    """workflow.analyze as a plain dict (LayerStats.to_json()), cached in the store; progress on `job`."""
    return workflow.analyze(store, capture_key, analysis_options_obj(options),
                            fraction_progress(job, base, span)).to_json()


@job_task
def analysis_job(*, store, capture_key: str, options: dict):
    def run(job):
        job.update(0.0, "computing layer statistics")
        return analyze_now(store, capture_key, options, job)

    return run


@job_task
def stats_job(*, store, capture_key: str, options: dict):
    """The session's layer statistics: {"capture_key", "requested" (the options), "stats"} (ui.apply keeps it)."""
    def run(job):
        job.update(0.0, "computing layer statistics")
        return {"capture_key": capture_key, "requested": dict(options), "stats": analyze_now(store, capture_key, options, job)}

    return run


def analysis_options_obj(options: dict) -> AnalysisOptions:
    """AnalysisOptions from the session's plain dict (unknown keys are a clear error)."""
    try:
        return AnalysisOptions(**options)
    except TypeError as e:
        raise LayerScopeError(f"Analysis options {sorted(options)} are not understood ({e})",
                              "Reset the options on the Entropy page") from None


# ---------------------------------------------------------------------------- drafts

def train_defaults() -> TrainOptions:
    """What the training widgets start from: TrainOptions' defaults with this machine's budget
    (TrainOptions.default_steps: 300 steps on a CPU, 2000 on a GPU)."""
    return TrainOptions().with_budget(default_device()[0])


@job_task
def train_job(*, store, capture_key: str, model: str, layers: list[int], strategy: str | None, name: str,
              options: dict):
    """workflow.train (or the draft from the store) for `layers`; live loss and per-step accuracy on the job."""

    def run(job):
        def progress(p: TrainProgress):              # one set: its loss and this batch's agreement per TTT step
            acc = list(p.acc[0])
            job.update(p.step / max(p.steps, 1),
                       f"step {p.step}/{p.steps} · loss {p.mean_loss:.3f} · acc@1 {acc[0]:.0%}",
                       step=p.step, steps=p.steps, loss=p.mean_loss, accuracy=acc, tokens_per_s=p.tokens_per_s,
                       eta_s=p.eta_s)
            job.push("history", {"step": p.step, "loss": p.mean_loss, "accuracy": list(acc)})

        def load(spec, st):
            target = load_in_job(job, spec, st)
            job.update(0.01, "reading the training features from the capture")
            return target

        done = workflow.train(store, capture_key, layers, TrainOptions(**options), model=model, strategy=strategy,
                              load=load, progress=progress, should_stop=job.should_stop)
        return draft_entry(done.path, done.meta, name=name)

    return run


@job_task
def online_train_job(*, store, model: str, sets: list[tuple[str, list[int], str | None]], options: dict):
    """workflow.train_online: one draft per (name, layers, strategy), all from one target pass per step.
    Live: phase, tokens seen, tokens/s, loss per set, held-out agreement per set, ETA; the learning-curve
    points as they come (series "curve": {"set", "tokens", "accuracy"})."""

    def run(job):
        names = [name for name, _, _ in sets]
        last = {}

        def progress(p):
            if isinstance(p, ResponsesProgress):
                job.update(0.02 + 0.18 * p.done / max(p.total, 1),
                           f"the target answers the training prompts: batch {p.done}/{p.total} · "
                           f"{p.tokens_per_s:.0f} tok/s" + (f" · {p.reused:,} answers reused" if p.reused else ""),
                           phase=p.phase, eta_s=p.eta_s)
            elif isinstance(p, FeaturesProgress):
                job.update(0.2, f"held-out conversations through the target: {p.done}/{p.total}", phase=p.phase,
                           eta_s=None)
            elif isinstance(p, EvalProgress):
                job.update(None, f"held-out evaluation at {p.tokens:,} tokens", phase=p.phase)
            elif isinstance(p, TrainProgress):
                job.update(0.2 + 0.8 * p.fraction, f"{p.tokens:,} tokens · {p.tokens_per_s:.0f} tok/s",
                           phase=p.phase, tokens=p.tokens, tokens_per_s=p.tokens_per_s, eta_s=p.eta_s,
                           loss=dict(zip(names, p.loss)), val=dict(zip(names, [v[0] if v else None for v in p.val])))
                for name, v in zip(names, p.val):
                    if v and last.get(name) != v:
                        last[name] = v
                        job.push("curve", {"set": name, "tokens": p.tokens, "accuracy": list(v)})

        def load(spec, st):
            return load_in_job(job, spec, st)

        result = workflow.train_online(store, model, [layers for _, layers, _ in sets], OnlineOptions(**options),
                                       strategy=[strategy or name for name, _, strategy in sets], load=load,
                                       progress=progress, should_stop=job.should_stop)
        return {"drafts": [draft_entry(d.path, read_meta(d.path), name=name)
                           for d, name in zip(result.drafts, names)],
                "seconds": result.seconds, "tokens_per_s": result.tokens_per_s, "cached": result.cached}

    return run


def draft_entry(path, meta: dict, *, name: str | None = None) -> dict:
    """What the session keeps about a trained draft."""
    layers = [int(l) for l in meta.get("layers") or meta.get("aux_layers") or []]
    return {"name": name or meta.get("strategy") or "draft", "path": str(path), "layers": layers,
            "strategy": meta.get("strategy"), "val_accuracy": meta.get("val_accuracy"),
            "target_fingerprint": meta.get("target_fingerprint"), "capture_key": meta.get("capture_key"),
            "steps": (meta.get("budget") or {}).get("resolved_steps"), "seconds": meta.get("seconds"),
            "train_tokens": meta.get("train_tokens"),
            "tokens_seen": meta.get("tokens_seen_total", meta.get("tokens_seen")),   # a continued draft: both runs
            "val_positions": meta.get("val_positions"),
            "curve": meta.get("curve")}


def stored_drafts(store, *, fingerprint: str | None = None) -> list[dict]:
    """Drafts in the store (drafts/<key>/ with layerscope.json), optionally only those for one target. An
    entry the store's path rule refuses, or whose files do not read, is left out here and listed by
    broken_drafts (what can be used is exactly what is offered)."""
    out = []
    for d, meta, problem in _draft_entries(store):
        if problem is not None:
            continue
        if fingerprint is not None and meta.get("target_fingerprint") not in (None, fingerprint):
            continue
        out.append({**draft_entry(d, meta), "saved": meta.get("saved")})
    return sorted(out, key=lambda r: r.get("saved") or "", reverse=True)


def broken_drafts(store) -> list[dict]:
    """The store's draft entries that cannot be used, each {"key", "problem", "fix"}, for the page to say."""
    return [{"key": d.name, "problem": problem,
             "fix": f"Remove {d} (`rm -r` it), or train the draft again; other drafts are unaffected"}
            for d, _, problem in _draft_entries(store) if problem is not None]


def _draft_entries(store):
    """(directory, layerscope.json or None, problem or None) for every entry under drafts/."""
    root = Path(store.root) / "drafts"
    if not root.is_dir():
        return
    for d in sorted(root.iterdir()):
        if d.name.startswith("."):          # staging areas and temporary files
            continue
        problem = store.entry_problem("drafts", d.name)
        if problem is None and not (d / "model.safetensors").is_file():
            problem = "it has no model.safetensors (an unfinished or damaged draft)"
        if problem is None and not (d / "layerscope.json").is_file():
            continue                        # a draft made elsewhere: not LayerScope's to list
        meta = None
        if problem is None:
            try:
                meta = read_meta(d)
            except LayerScopeError as e:
                problem = f"its layerscope.json does not read ({e.problem})"
        yield d, meta, problem


def builtin_entry(model: str | None) -> dict | None:
    """The draft shipped for `model` (None: the default model) as a session draft entry; None when none ships."""
    try:
        path = builtin.builtin_path(model)
    except DraftError:
        return None
    return draft_entry(path, read_meta(path), name="builtin")


def offer_builtin(s) -> bool:
    """Put the shipped draft into session `s` once, when one ships for its model (s.model, or the default model
    while the session has none); True when `s` changed. A user who removes it does not get it back."""
    if s.view.get("builtin_offered"):
        return False
    entry = builtin_entry(s.model)
    if entry is None:
        return False
    s.view["builtin_offered"] = True
    if entry["path"] not in {d["path"] for d in s.drafts}:
        s.drafts.append(entry)
    return True


# ---------------------------------------------------------------------------- the probe

@job_task
def probe_job(*, store, capture_key: str, model: str, sets: list[list[int]]):
    """probe.score_sets on the capture: each set's held-out agreement of a closed-form ridge map (no training;
    cached in the store per set). Result: {"capture_key", "sets": [{"layers", "agreement", "explained_variance",
    "agreement_ci", "hits", "counts"}]} (hits and counts: per held-out conversation, the sample behind the agreement)."""

    def run(job):
        target = load_in_job(job, model, store)
        job.update(0.05, "reading the capture")
        cap = open_capture(store, capture_key)
        report = probe.score_sets(cap, target, [list(x) for x in sets], store=store,
                                  progress=fraction_progress(job, 0.05, 0.95))
        return {"capture_key": capture_key, "seconds": report.seconds, "cached": report.cached,
                "sets": [{"layers": list(x.layers), "agreement": x.agreement, "explained_variance": x.explained_variance,
                          "agreement_ci": x.agreement_ci, "hits": x.hits, "counts": x.counts}
                         for x in report.sets]}

    return run


# ---------------------------------------------------------------------------- benchmark

class _LiveText:
    """The text of the run being decoded, as (piece, kind) with accepted draft tokens marked."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.kinds, self.text = tokenizer, [], [], ""
        self.pieces: list[tuple[str, str]] = []

    def add(self, tokens, accepted: int) -> None:
        for i, t in enumerate(tokens):
            kind = "draft" if i < accepted else "target"
            self.ids.append(int(t))
            text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
            piece, self.text = text[len(self.text):] if text.startswith(self.text) else text, text
            if self.pieces and self.pieces[-1][1] == kind:
                self.pieces[-1] = (self.pieces[-1][0] + piece, kind)
            else:
                self.pieces.append((piece, kind))


class _BenchLive:
    """bench.BenchProgress -> the job's live metrics: running τ and tokens/s, acceptance per draft
    position (a bench.Tally per contender), the text of the run being decoded."""

    def __init__(self, job):
        self.job, self.tokenizer = job, None
        self.live: dict[str, dict] = {}
        self.tallies: dict[str, Tally] = {}
        self.text, self.text_key = None, None

    def __call__(self, p) -> None:
        job, e = self.job, p.event
        job.check_cancel()
        if p.phase != "decode":                  # the wait, the cost curve, the calibration of K = auto
            frac = 0.01 + 0.01 * p.runs_done / p.runs_total if p.runs_total else None
            job.update(frac, p.message, phase=p.phase, eta_s=p.eta_s)
            return
        if p.tau is not None:
            self.live[p.contender] = {"tau": p.tau, "tokens_per_s": p.tokens_per_s}
        if e is not None:
            if e.step > 0:
                job.push(f"tau:{p.contender}", len(e.tokens))
                self.tallies.setdefault(p.contender, Tally()).add_event(e)
            if (p.prompt_index, p.contender) != self.text_key:
                self.text, self.text_key = _LiveText(self.tokenizer), (p.prompt_index, p.contender)
            self.text.add(e.tokens, e.accepted)
        base = (self.live.get("autoregressive") or {}).get("tokens_per_s")
        cur = self.live.get(p.contender, {})
        frac = (p.runs_done + (0.5 if e is not None else 0.0)) / max(p.runs_total, 1)
        job.update(0.02 + 0.98 * min(frac, 1.0),
                   f"{p.contender}: prompt {p.prompt_index + 1}/{p.prompts_total}"
                   + (f" · τ {cur['tau']:.2f}" if cur.get("tau") else ""),
                   contender=p.contender, prompt=p.prompt_index + 1, prompts_total=p.prompts_total,
                   live={name: dict(v) for name, v in self.live.items()},
                   speedup=(cur.get("tokens_per_s") / base) if base and cur.get("tokens_per_s") else None,
                   step_tau=len(e.tokens) if e is not None and e.step > 0 else None,
                   acceptance={name: {"drafted": list(t.drafted_at), "accepted": list(t.accepted_at)}
                               for name, t in self.tallies.items()},
                   text=list(self.text.pieces) if self.text is not None else [], text_of=p.contender, phase=p.phase,
                   eta_s=p.eta_s)


def bench_options(*, model: str | None, prompts: str, limit: int, max_new_tokens: int, k: int | str, peers: bool,
                  lookup: int | str = 0, seed: int = 0, assistant: str = "") -> BenchOptions:
    """The BenchOptions of the page's choices (k: a chain depth, or "auto"; lookup as `bench --lookup` takes it,
    bench.parse_lookup; assistant: a model spec for hf-assisted, "" for none), for the job and its estimate."""
    auto = k == "auto"
    draft_lookup, auto_lookup = parse_lookup(lookup)
    return BenchOptions(model=model, prompts=prompts, limit=limit, seed=seed, max_new_tokens=max_new_tokens,
                        ks=() if auto else (int(k),), auto_k=auto, peers=peers, draft_lookup=draft_lookup,
                        auto_lookup=auto_lookup, assistant=(assistant or "").strip() or None)


def held(manager, spec: str) -> bool:
    """Whether a job would find `spec` loaded already (a worker holds it, or this process in thread mode): then its
    estimate counts no model load."""
    spec = (spec or "").strip()
    return spec in manager.worker_models() or spec in loaded_models()


def bench_estimate(store, drafts: list[dict], manager=None, **choice):
    """The benchmark's forecast before it starts, for the session's `drafts` and the page's choices (bench_options);
    with `manager`, no model load when its worker holds the model."""
    options = bench_options(**choice)
    spec = workflow.bench_model(options, [(d["name"], d["path"]) for d in drafts])
    return forecast.bench(store, spec, len(drafts), options, held=manager is not None and held(manager, spec))


@job_task
def bench_job(*, store, model: str, drafts: list[dict], prompts: str, limit: int, max_new_tokens: int,
              k: int | str = "auto", peers: bool, lookup: int | str = 0, seed: int = 0, capture_key: str | None = None,
              assistant: str = ""):
    """workflow.bench of the session's drafts (and plain decoding, HF peers) with live stats on the job.
    k: a chain depth, or "auto" (the default): the depth with the best predicted speedup, chosen by a
    calibration (bench.plan) whose prompts show as progress like the decoding's.

    Live, per contender: running τ and tokens/s (metrics["live"]), τ of every step (series
    "tau:<name>"), accepted/drafted counts per draft position (metrics["acceptance"]), and the text
    of the run being decoded with accepted draft tokens marked (metrics["text"]); before the decoding,
    metrics["phase"] ("cost curve", "calibrate") with the message saying what it does.
    lookup: as `bench --lookup` takes it (bench.parse_lookup): N > 0 or "N..M" (adaptive), each draft's chain is also
    decoded with prompt lookup first (BenchOptions.draft_lookup); "auto": with the span predicted best, if one pays.
    assistant: a model spec, also decoded as transformers' assisted generation (hf-assisted); "" for none.
    """
    options = bench_options(model=model, prompts=prompts, limit=limit, max_new_tokens=max_new_tokens, k=k, peers=peers,
                            lookup=lookup, seed=seed, assistant=assistant)

    def run(job):
        if not drafts:
            raise LayerScopeError("No draft chosen for the benchmark", "Train a draft or pick one above first")
        live, loaded = _BenchLive(job), []

        def load(spec, store_):                 # the target, then the assistant (the same tokenizer: checked)
            target = load_in_job(job, spec, store_)
            loaded.append(target)
            live.tokenizer = loaded[0].tokenizer
            job.update(0.01, "warming up")
            return target

        done = workflow.bench([(d["name"], d["path"]) for d in drafts], options, store, load=load, progress=live)
        out = done.report.to_json()
        out["warnings"] = list(done.prompt_set.warnings)
        out["prompt_set"] = done.prompt_set.name
        out["k"] = k
        out["drafts"] = [{"name": d["name"], "path": d["path"], "layers": d["layers"]} for d in drafts]
        out["created"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        if capture_key:
            out["capture_key"] = capture_key      # the session's capture when the benchmark started
        if loaded:
            out["target_fingerprint"] = loaded[0].fingerprint    # the model measured (recommend: its evidence only)
        return out

    return run


# ---------------------------------------------------------------------------- the study

def study_options(session_sets: list[dict], *, k: int, train: TrainOptions, prompts: str, limit: int,
                  max_new_tokens: int, depth: int, lam: float = 0.5) -> StudyOptions:
    """StudyOptions for the session: every automatic strategy plus the session's own sets, each draft trained
    from the capture with `train`."""
    return StudyOptions(extra_sets=tuple(tuple(x["layers"]) for x in session_sets), k=k, lam=lam, train=train,
                        prompts=prompts, limit=limit, max_new_tokens=max_new_tokens, depth=depth)


def study_plan(stats: dict, options: StudyOptions) -> list[tuple[list[int], list[str]]]:
    """The distinct sets the study will train, each with the strategies that propose it."""
    return propose_sets(LayerStats.from_json(stats), options)


@job_task
def study_job(*, store, capture_key: str, model: str, options: StudyOptions, analysis_options: dict):
    """workflow.study in the background: one draft per set, the same budget for all, one benchmark;
    live progress through the training steps and the benchmark."""

    def run(job):
        def progress(p):
            job.check_cancel()       # raising here stops training or the benchmark where it is
            if p.phase == "analyze":
                job.update(0.02, "layer statistics", phase=p.phase, eta_s=None)
            elif p.phase == "train":
                u = p.detail if isinstance(p.detail, TrainProgress) else None
                within = u.step / max(u.steps, 1) if u else 0.0
                frac = 0.05 + 0.7 * (p.set_index + within) / max(p.sets_total, 1)
                job.update(frac, f"training {p.message}" + (f" · step {u.step}/{u.steps} · loss {u.mean_loss:.3f}"
                                                              if u else ""), phase=p.phase, eta_s=p.eta_s)
            elif p.phase == "bench":
                b = p.detail
                frac = 0.75 + 0.25 * (b.runs_done / max(b.runs_total, 1) if b is not None else 0.0)
                job.update(frac, p.message + (f", prompt {b.prompt_index + 1}/{b.prompts_total}" if b is not None else "")
                           + (f" · τ {b.tau:.2f}" if b is not None and b.tau else ""), phase=p.phase, eta_s=p.eta_s)

        done = workflow.study(store, capture_key, options, model=model, analysis=analysis_options_obj(analysis_options),
                              load=lambda spec, st: load_in_job(job, spec, st), progress=progress)
        out = done.report.to_json()
        out["created"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        out["device"] = str(done.target.device)
        out["target_fingerprint"] = done.target.fingerprint   # the model measured (recommend: its evidence only)
        return out

    return run
