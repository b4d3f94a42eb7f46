"""The workflow, one function per step: capture → analyze → select → train → bench → study.

The CLI's step commands (layerscope/commands/) and the app's background jobs (layerscope/ui/tasks.py) call
these and nothing else for a step, so a step is written once. Five commands are no step and call no function
here for one: `captures` and `verify` (stored captures: capture.stored), `check-draft` and `export` (a draft
directory: draft.export.check, draft.export.engine_export) and `profile` (this machine's cost curve: decoding.costmodel; it
loads the target with `load_target`). Each step takes an options object (the one source of its defaults:
capture.run.CaptureOptions, stats.analysis.AnalysisOptions, SelectOptions here, draft.training.fit.TrainOptions,
decoding.bench.BenchOptions, study.run.StudyOptions), the store, and a progress callback (the step's own
progress type: capture.run.CaptureProgress, a fraction and a message, draft.training.progress's TrainProgress (online:
OnlineProgress), decoding.bench.BenchProgress, study.run.StudyProgress), and returns a typed result.

Loading the target model is the caller's choice of `load(spec, store) -> LoadedModel`: the CLI loads
it afresh (`load_target`), the app from its per-process cache (ui.model_cache.get_model). Before a capture, a
training, a benchmark or a study starts (its checks passed; a capture once its prompts are tokenized), its
`estimate` callback hears the step's forecast.Forecast: time and disk; a finished capture, training or
benchmark records its pace on this machine (`forecast.measured`) for the next estimate of that kind.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from layerscope import disk, layerset
from layerscope.capture import run as capture_mod
from layerscope.capture.export_states import export_states as export_capture_states
from layerscope.capture.import_states import ImportOptions, ImportResult
from layerscope.capture.import_states import import_states as import_dump
from layerscope.capture.run import CaptureOptions, CaptureResult
from layerscope.capture.stored import open_capture
from layerscope.decoding import bench as bench_mod
from layerscope.draft import builtin
from layerscope.draft.checkpoint import read_meta, save_draft
from layerscope.draft.training import online as online_mod
from layerscope.draft.training.fit import TrainingCancelled, TrainOptions
from layerscope.draft.training.progress import OnlineProgress, ResponsesProgress, TrainProgress, last_of
from layerscope.draft.training.train import draft_for, train_capture_draft
from layerscope.errors import DraftError
from layerscope.prompts.sets import NoPromptFits, PromptSet, load_prompts
from layerscope.stats import select as select_mod
from layerscope.stats.analysis import AnalysisOptions, LayerStats
from layerscope.stats.analysis import analyze as analyze_capture
from layerscope.steps import forecast, preflight
from layerscope.store import Store
from layerscope.study import probe as probe_mod
from layerscope.study.run import StudyOptions, StudyReport, run_study
from layerscope.target.aliases import DEFAULT_MODEL
from layerscope.target.load import LoadedModel, default_device, load_model
from layerscope.target.weights import TargetWeights

Loader = Callable[[str, Store], LoadedModel]
Estimate = Callable[[forecast.Forecast], None] | None    # hears the step's estimate before it starts (the CLI prints it)
DEFAULT_PROMPTS = "builtin"          # the capture's prompt set when none is named


def load_target(spec: str, store: Store) -> LoadedModel:
    """The CLI's loader: the model behind `spec`, de-quantized weights cached in `store`."""
    return load_model(spec, store=store)


def timed(load: Loader) -> Loader:
    """`load`, its seconds recorded as this machine's load pace (forecast.timed_load) for the next estimate."""
    return lambda spec, store: forecast.timed_load(store, spec, load)


# ---------------------------------------------------------------------------- 1. capture

@dataclass
class Captured:
    result: CaptureResult
    prompt_set: PromptSet            # .warnings: prompts left out or replaced, for the user
    target: LoadedModel


def capture(model: str, prompts: str, options: CaptureOptions, store: Store, *, load: Loader = load_target,
            progress: Callable[[capture_mod.CaptureProgress], None] | None = None,
            should_stop: Callable[[], bool] | None = None, estimate: Estimate = None) -> Captured:
    """Every layer's hidden states of `model` over the prompt set `prompts`, stored under captures/<key>."""
    options.validate()                                      # bad options fail before the model loads
    disk.writable(store)                               # ... and so does a read-only store
    prompt_set = load_prompts(prompts, limit=options.limit, seed=options.seed, cache=store.root / "prompts")
    target = timed(load)(model, store)
    seen = {}

    def watch(p):
        if progress is not None:
            progress(p)
        if p.estimate is not None:
            seen["plan"] = p.estimate
            if estimate is not None:
                estimate(forecast.capture(store, model, p.estimate, options.batch_size))
        elif p.phase in ("generate", "record"):
            seen.setdefault("resumed", p.tokens_done > 0)
    result = capture_mod.capture(target, prompt_set, store, progress=watch, should_stop=should_stop,
                                 **asdict(options))
    if not result.cached and seen.get("resumed") is False and options.max_tokens is None:   # a whole capture: its pace
        forecast.measured(store, "capture", model, target, result.seconds,
                          lambda t: forecast.capture_rule(t, seen["plan"], options.batch_size))
    return Captured(result, prompt_set, target)


def import_states(directory: str | Path, model: str, options: ImportOptions, store: Store, *,
                  progress: Callable[[capture_mod.CaptureProgress], None] | None = None,
                  should_stop: Callable[[], bool] | None = None) -> ImportResult:
    """An engine's hidden-state dump (speculators, SpecForge) of `model`, stored as a capture under captures/<key>."""
    options.validate()                                      # bad options fail before the target's ends load
    disk.writable(store)
    return import_dump(directory, model, store, options, progress=progress, should_stop=should_stop)


def export_states(store: Store, capture_key: str, layers: Sequence[int], out: str | Path,
                  progress: Callable[[int, int], None] | None = None) -> dict:
    """A stored capture written as speculators' offline training data for `layers` (+ the last layer) at `out`,
    a folder outside the store (checked first, with the rest of --out's rule: capture.export_states.output_folder)."""
    preflight.outside_store(store, out, "--out", "the export")
    return export_capture_states(open_capture(store, capture_key), out, list(layers), progress=progress)


# ---------------------------------------------------------------------------- 2. analyze

def analyze(store: Store, capture_key: str, options: AnalysisOptions,
            progress: Callable[[float, str], None] | None = None) -> LayerStats:
    """Matrix entropy per layer and CKA between layers of a stored capture (cached in the store)."""
    return analyze_capture(open_capture(store, capture_key), store, options, progress=progress)


# ---------------------------------------------------------------------------- 3. select

@dataclass
class SelectOptions:
    k: int = 3                       # layers in the set
    strategy: str | None = None      # None: aggregate, or manual when `layers` is given
    lam: float = 0.5                 # λ: weight of redundancy in greedy mRMR and in the mrmr score
    layers: tuple[int, ...] | None = None   # a hand-picked set, scored like the others
    compare: bool = False            # every strategy, side by side


def select(stats: LayerStats, options: SelectOptions,
           probe: probe_mod.ProbeInput | None = None) -> list[select_mod.Selection]:
    """The proposed layer set (one Selection), or with `compare` every strategy's. The `probe` strategy
    also needs `probe` (probe_input)."""
    o = options
    layers = list(o.layers) if o.layers is not None else None
    if o.compare:
        return select_mod.compare(stats, o.k, lam=o.lam, layers=layers)
    strategy = o.strategy or ("manual" if layers else "aggregate")
    return [select_mod.select(stats, strategy, o.k, lam=o.lam, layers=layers, probe=probe)]


def probe_input(store: Store, capture_key: str, options: probe_mod.ProbeOptions | None = None, *,
                model: str | None = None, load: Loader = load_target) -> probe_mod.ProbeInput:
    """A capture and its target's weights (default: the capture's model), for layerscope/study/probe.py and the
    `probe` selection strategy; probe results are cached in `store`."""
    cap = open_capture(store, capture_key)
    cap.require_every_position("the probe", preflight.PROBE_FIX)                 # before the load
    target = load(model or cap.manifest["model"], store)
    return probe_mod.ProbeInput(cap, TargetWeights.of(target), options or probe_mod.ProbeOptions(), store)


# ---------------------------------------------------------------------------- 4. train

@dataclass
class Trained:
    path: Path                       # the draft directory (config.json, model.safetensors, layerscope.json)
    meta: dict                       # its layerscope.json


def train(store: Store, capture_key: str, layers: Sequence[int], options: TrainOptions, *, model: str | None = None,
          strategy: str | None = None, out: str | Path | None = None, load: Loader = load_target,
          progress: Callable[[TrainProgress], None] | None = None,
          should_stop: Callable[[], bool] | None = None, estimate: Estimate = None) -> Trained:
    """A draft reading `layers`, trained on the capture with the target `model` (default: the capture's).

    Without `out` it lives in the store under drafts/<key> (trained once per capture, target, layers
    and options); with `out` it is trained and written there. No budget: TrainOptions.default_steps.
    """
    cap, (layers,), out = preflight.train_capture(store, capture_key, [list(layers)], options.draft_vocab, out,
                                                   options.init_from, options.draft_intermediate)       # before the load
    if estimate is not None:
        estimate(forecast.training(store, model or cap.manifest["model"], layers,
                                   options.with_budget(default_device()[0])))
    target = timed(load)(model or cap.manifest["model"], store)
    if target.fingerprint != cap.manifest.get("fingerprint", target.fingerprint):
        raise DraftError(f"Model {target.spec} now loads with fingerprint {target.fingerprint}, but capture "
                         f"{cap.key} was made with {cap.manifest['fingerprint']}", "Capture again with the current model")
    o = options.with_budget(target.device)
    watch, last = last_of(progress, TrainProgress)
    if out is None:
        path = draft_for(cap, layers, target, store, strategy=strategy, progress=watch, should_stop=should_stop,
                         options=o)
    else:
        head, report = train_capture_draft(cap, layers, target, options=o, strategy=strategy, progress=watch,
                                           should_stop=should_stop)
        path = save_draft(out, head, report.meta, target=target)         # out: its real path (links followed)
    p = last.get(TrainProgress)
    if p is not None and p.tokens_per_s > 0:            # trained now (not from the store): seconds a row
        forecast.measured(store, "training", target.spec, target, 1 / p.tokens_per_s,
                          lambda t: forecast.row_rule(t, [layers], o, online=False))
    return Trained(Path(path), read_meta(path))


def layers_from_strategy(store: Store, cap, strategy: str, k: int) -> list[int]:
    """The layer set a selection strategy proposes for a capture (`default` needs no statistics)."""
    if strategy == "default":
        return layerset.default_layers(cap.num_layers)[0]
    return select_mod.select(analyze_capture(cap, store, AnalysisOptions()), strategy, k).layers


def train_online(store: Store, model: str, layer_sets: Sequence[Sequence[int]], options: online_mod.OnlineOptions, *,
                 strategy: list[str] | None = None, load: Loader = load_target,
                 progress: Callable[[OnlineProgress], None] | None = None,
                 should_stop: Callable[[], bool] | None = None, estimate: Estimate = None) -> online_mod.OnlineResult:
    """One draft per layer set, trained online with `model` in the loop (draft/training/online.py): resumable, and
    served from the store when the same run has finished."""
    options.validate()                                      # bad options fail before the model loads
    sets = [list(s) for s in layer_sets]
    preflight.train_online(store, model, sets, options)
    if estimate is not None:
        estimate(forecast.online(store, model, sets, options))
    target = timed(load)(model, store)
    watch, last = last_of(progress, ResponsesProgress, TrainProgress)
    try:
        result = online_mod.train_online(target, sets, store, progress=watch, should_stop=should_stop,
                                         strategy=strategy, options=options)
    except TrainingCancelled:                   # stopped (Ctrl-C, the app's Stop): what it measured still counts
        forecast.online_measured(store, model, target, sets, options, last)
        raise
    forecast.online_measured(store, model, target, sets, options, last)     # its paces, for the next estimate
    return result


# ---------------------------------------------------------------------------- 5. bench

@dataclass
class Benchmarked:
    report: bench_mod.BenchReport
    prompt_set: PromptSet            # .warnings: prompts replaced for length, for the user
    target: LoadedModel


def bench(drafts: Sequence[tuple[str, str | Path]], options: bench_mod.BenchOptions, store: Store, *,
          load: Loader = load_target, progress: Callable[[bench_mod.BenchProgress], None] | None = None,
          estimate: Estimate = None) -> Benchmarked:
    """Decode the same prompts with each (name, draft directory) and the baselines; see layerscope/decoding/bench.py."""
    options.validate()
    drafts = [(name, builtin.resolve(path, options.model, store)) for name, path in drafts]   # 'builtin' too
    preflight.bench_drafts([path for _, path in drafts])   # missing, looping or self-contradicting drafts: before the load
    preflight.prompt_spec(options.prompts)
    spec = bench_model(options, drafts)
    if estimate is not None:
        estimate(forecast.bench(store, spec, len(drafts), options))
    target = timed(load)(spec, store)
    target.check_room(1, options.max_new_tokens, "a prompt of one token", "--max-new-tokens")
    # prompts longer than the room --max-new-tokens leaves are replaced like any prompt over --max-prompt-tokens
    room = target.context_length - options.max_new_tokens
    limit = "--max-prompt-tokens" if options.max_prompt_tokens <= room else "--max-new-tokens"   # the tighter one
    options = replace(options, max_prompt_tokens=min(options.max_prompt_tokens, room))
    heads = bench_mod.load_drafts(target, drafts)
    assistant = None
    if options.assistant:                     # the classic small-model draft: its tokenizer must be the target's
        assistant = load(options.assistant, store)
        bench_mod.check_assistant(target, assistant)
    try:
        prompt_set, prompts = bench_mod.fitting_prompts(target.tokenizer, options, cache=store.root / "prompts")
    except NoPromptFits as e:
        if limit == "--max-prompt-tokens":
            raise
        raise NoPromptFits(f"{e.problem}: --max-new-tokens {options.max_new_tokens} leaves that much of {spec}'s "
                           f"context of {target.context_length} tokens for a prompt",
                           "Lower --max-new-tokens, or use a prompt set with shorter prompts") from None
    if options.machine.wait_s:                # --wait-quiet: once, before the first timing (curve or decoding)
        bench_mod.wait_quiet(options.machine, progress)
        options = replace(options, machine=replace(options.machine, wait_s=None))
    timings = {}                              # each phase's seconds: the next estimate's paces
    contenders, curve = bench_mod.plan(target, heads, options, store, progress, assistant,   # `auto` resolved; the
                                       timings=timings)                                       # curve
    t0 = time.perf_counter()
    report = bench_mod.measure(target, prompts, contenders, options.max_new_tokens, progress,
                               machine_options=options.machine)
    bench_mod.annotate(report, contenders, curve)
    forecast.bench_measured(store, spec, target, time.perf_counter() - t0, options, len(heads), len(prompts),
                            len(contenders), timings)
    return Benchmarked(report, prompt_set, target)


def bench_model(options: bench_mod.BenchOptions, drafts: Sequence[tuple[str, str | Path]]) -> str:
    """The benchmark's target: options.model, else the model the first draft was trained for, else the default."""
    return options.model or (read_meta(drafts[0][1]).get("target_model") if drafts else None) or DEFAULT_MODEL


# ---------------------------------------------------------------------------- 6. study

@dataclass
class Studied:
    report: StudyReport
    target: LoadedModel


def study(store: Store, capture_key: str, options: StudyOptions, *, model: str | None = None,
          analysis: AnalysisOptions | None = None, load: Loader = load_target,
          progress: Callable | None = None, estimate: Estimate = None) -> Studied:
    """One draft per strategy's layer set with the same budget, benchmarked together; see layerscope/study/run.py."""
    cap = open_capture(store, capture_key)
    cap.require_every_position("a study (it trains drafts on the capture)", preflight.TRAIN_FIX)
    spec = model or cap.manifest["model"]
    preflight.study(store, spec, options)     # before the model loads
    if estimate is not None:
        estimate(forecast.study(store, spec, replace(options, train=options.train.with_budget(default_device()[0]))))
    target = timed(load)(spec, store)
    o = replace(options, train=options.train.with_budget(target.device))
    report = run_study(cap, target, store, o, analysis or AnalysisOptions(), progress,     # its paces as it goes
                       measured=lambda what: forecast.study_measured(store, spec, target, what),
                       planned=None if estimate is None else
                       lambda drafts, units, done: estimate(forecast.study(store, spec, o, left=(drafts, units, done))))
    return Studied(report, target)
