"""The layer-set study: which layer set gives the best draft, by how much, and do the proxies predict it?

For one capture:
  1. statistics   analysis.analyze (cached in the store) with the study's analysis options (these pick
                  the sets), and once more per proxy version: each kernel × each token-entropy
                  threshold (`kernels`, `filters`; 0 = no filter), for the proxies only;
  2. sets         one layer set per strategy (default, greedy, aggregate, entropy-topk, spread, `probe`
                  when asked for: the probe's search over the capture, plus any user sets) and the
                  controls: `random_sets` seeded random sets of the same size, the last k layers, a
                  single-layer draft; strategies that propose the same set share one draft. The default
                  rule is always in: it is the reference of every comparison;
  2b. probe       probe.score_sets (`probe` options; None skips it): the training-free proxy `probe`, a
                  closed-form ridge map per set and its held-out agreement with the target's argmax
                  (layerscope/study/probe.py), cached in the store;
  3. drafts       draft.training.train.draft_for per set and training seed (`seeds`), all with the same budget
                  and data (cached: a re-run that adds a set or a seed trains only those); online, one
                  target pass per seed and group of `sets_per_pass` of the sets it still lacks (study_units);
  4. benchmark    bench.measure on held-out prompts, each unit's drafts against plain decoding in one run as
                  soon as the unit is trained; each draft's result and its per-prompt totals are cached with
                  the prompts and decoding options and the machine's state during the run (layerscope.quietness;
                  the report's `machine` merges every run it used, and the verdict says so when one ran on a
                  busy machine). With `outcomes`, each finished (set, seed) is also written to that folder
                  (study/outcomes.py) and read back from it instead of being trained again;
  5. statistics   stats/paired.py: per set τ, acceptance and speedup with paired bootstrap intervals over
                  the prompts, the paired difference to the default rule, the seed spread; the Spearman
                  correlation of every proxy version with τ with an interval; a plain-words verdict.

`run_study(...)` returns the StudyReport and reports StudyProgress through a callback as it goes
(training steps and benchmark steps live, each with the time left of its phase: layerscope.eta), for a CLI bar
or the app's background job.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass, field, replace

from layerscope import eta, fmt, quietness
from layerscope.decoding import bench, specdec
from layerscope.draft import init_from
from layerscope.draft.checkpoint import read_meta
from layerscope.draft.training.fit import TrainingCancelled, TrainOptions
from layerscope.draft.training.loss import simulated_acc_len
from layerscope.draft.training.online import OnlineOptions, train_online
from layerscope.draft.training.progress import OnlineProgress, ResponsesProgress, TrainProgress, last_of
from layerscope.draft.training.train import draft_for
from layerscope.errors import LayerScopeError, SelectionError
from layerscope.prompts.sets import load_prompts
from layerscope.quietness import MachineOptions
from layerscope.stats import paired, select
from layerscope.stats.analysis import AnalysisOptions, analyze
from layerscope.stats.correlation import spearman
from layerscope.stats.entropy import KERNELS
from layerscope.stats.paired import PromptRuns
from layerscope.store import make_key
from layerscope.study import outcomes
from layerscope.study import probe as probe_mod
from layerscope.study.outcomes import Outcome, OutcomeFolder
from layerscope.study.probe import ProbeOptions
from layerscope.target.weights import TargetWeights
from layerscope.validate import check_number

STUDY_STRATEGIES = ("default", "greedy", "aggregate", "entropy-topk", "spread", "random", "last-k", "single")
PROXIES = ("mean_entropy", "mean_cka", "aggregate_entropy")
PROBE_VERSION = "held-out agreement"       # the `probe` proxy's one version in the correlations
BENCH_FORMAT = 2       # study-bench cache entries: the benchmark entry plus per-prompt totals


@dataclass
class StudyOptions:
    strategies: tuple[str, ...] = STUDY_STRATEGIES
    extra_sets: tuple[tuple[int, ...], ...] = ()      # hand-picked sets (--layers), studied as "manual"
    k: int = 3
    lam: float = 0.5
    train: TrainOptions = field(default_factory=TrainOptions)   # training from the capture (its seed: the seed when
                                                                 # `seeds` is None); workflow.study gives it the
                                                                 # device's default steps when it has no budget
    prompts: str = "sharegpt-heldout"
    limit: int = 20
    seed: int = 0
    max_new_tokens: int = 64
    max_prompt_tokens: int = bench.MAX_PROMPT_TOKENS
    depth: int = specdec.DEFAULT_K                     # chain draft depth K
    seeds: tuple[int, ...] | None = None               # training seeds, each set trained once per seed; None: train.seed
    random_sets: int = 2                               # seeded random control sets the "random" strategy adds
    online: OnlineOptions | None = None                # train every set online instead (all sets from one target pass
                                                       # per seed), with these options; None: from the capture
    kernels: tuple[str, ...] = KERNELS                  # proxy versions: token preparation of entropy and CKA ...
    filters: tuple[float, ...] = (0.0, 0.5, 1.0)       # ... × token-entropy threshold in nats (0: no filter)
    machine: MachineOptions = field(default_factory=MachineOptions)   # the benchmark's quiet rule and --wait-quiet
    probe: ProbeOptions | None = field(default_factory=ProbeOptions)  # the training-free `probe` proxy (None: off)
    sets_per_pass: int | None = None                   # online: sets trained per target pass (None: all of them);
                                                       # smaller passes fit a sitting, each benchmarked when done
    outcomes: str | None = None                        # a folder keeping every finished draft's outcome (its record
                                                       # and benchmark, study/outcomes.py), read back instead of
                                                       # training again: a long study across machines

    def validate(self) -> None:
        """The study's numbers by layerscope.validate's one rule, then its benchmark's (BenchOptions.validate)."""
        check_number("--random-sets", self.random_sets, minimum=0, maximum=MAX_RANDOM_SETS, integer=True)
        check_number("--k", self.k, minimum=1, maximum=MAX_K, integer=True)
        check_number("--sets-per-pass", self.sets_per_pass, minimum=1, integer=True, optional=True,
                     fix="Pass --sets-per-pass 1 or more, or leave it out to train every set in one pass")
        for threshold in self.filters:
            check_number("--filters", threshold, minimum=0,
                         fix="Pass token-entropy thresholds in nats, 0 or more, e.g. --filters 0,0.5,1")
        self.bench_options().validate()

    def bench_options(self) -> bench.BenchOptions:
        """The benchmark of the study: these prompts, one chain of depth K per draft, no HF peers."""
        return bench.BenchOptions(prompts=self.prompts, limit=self.limit, seed=self.seed,
                                  max_new_tokens=self.max_new_tokens, max_prompt_tokens=self.max_prompt_tokens,
                                  ks=(self.depth,), peers=False, machine=self.machine)


MAX_RANDOM_SETS = 64          # random control sets: each is a draft trained and benchmarked
MAX_K = 64                    # layers per set


@dataclass
class StudyRow:
    layers: list[int]
    strategies: list[str]
    mean_entropy: float                  # the proxies under the study's analysis options
    mean_cka: float
    aggregate_entropy: float
    val_accuracy: list[float]            # per TTT step, mean over seeds
    tau: float | None = None             # mean over seeds of the pooled τ
    speedup: float | None = None
    tokens_per_s: float | None = None
    acceptance_by_position: list[float] = field(default_factory=list)
    lossless: bool | None = None
    draft: str = ""                      # the first seed's draft
    tau_ci: list[float] | None = None    # 95% paired bootstrap interval over the prompts
    acceptance: float | None = None      # accepted / drafted tokens over all verification steps
    acceptance_ci: list[float] | None = None
    speedup_ci: list[float] | None = None
    delta_vs_default: float | None = None   # τ minus the default rule's τ (0 for the default's own row)
    delta_ci: list[float] | None = None
    paired: dict = field(default_factory=dict)          # {tau|acceptance|speedup: {"delta", "ci"}} vs default
    seeds: list[dict] = field(default_factory=list)     # per training seed: seed, tau, acceptance, speedup, ...
    tau_seed_range: float | None = None  # max − min of τ over the seeds
    tau_seed_sd: float | None = None
    proxies: dict = field(default_factory=dict)         # version ("linear, H≥0.5") -> {proxy: value}
    drafts: list[str] = field(default_factory=list)     # one per seed
    probe: dict | None = None            # the probe's SetScore.to_json(): agreement, explained_variance, lambda, ...
    simulated_acc_len: float | None = None   # SpecForge's Σ∏ of val_accuracy (draft/training/loss.py; no bonus token)

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class StudyReport:
    capture: str
    rows: list[StudyRow]
    spearman: dict[str, float | None]      # proxy -> rank correlation with τ over the rows (study's analysis)
    baseline_tokens_per_s: float | None
    prompts: int
    options: dict
    verdict: str = ""
    correlations: list[dict] = field(default_factory=list)   # every proxy version: proxy, version, rho, ci, sets
    best_proxies: dict = field(default_factory=dict)          # proxy -> its best-correlated version
    reference: int = 0                                        # index of the default rule's row
    machine: dict | None = None                               # quietness.merge of the benchmark runs it used

    def to_json(self) -> dict:
        return {"verdict": self.verdict, "rows": [r.to_json() for r in self.rows], "correlations": self.correlations,
                "best_proxies": self.best_proxies, "options": self.options, "capture": self.capture,
                "spearman": self.spearman, "baseline_tokens_per_s": self.baseline_tokens_per_s,
                "prompts": self.prompts, "reference": self.reference, "machine": self.machine}


@dataclass(frozen=True)
class StudyProgress:
    phase: str                       # "analyze" | "train" | "bench" | "done"
    message: str
    set_index: int = 0               # which set is training (train phase)
    sets_total: int = 0
    detail: OnlineProgress | bench.BenchProgress | None = None   # "train": draft/training/progress.py's (from the capture:
                                                                 # TrainProgress only); "bench": the benchmark's
    eta_s: float | None = None       # seconds left of the phase (layerscope.eta): from the capture, every draft this
                                     # pass trains (one budget each, measured over the drafts trained so far);
                                     # online, the pass's current phase; the benchmark's; None: estimating


def propose_sets(stats, o: StudyOptions, probe: probe_mod.ProbeInput | None = None) -> list[tuple[list[int], list[str]]]:
    """Distinct layer sets, each with the strategies that proposed it: the default rule first (always,
    the reference), the strategies in order, the user's sets, then the random controls ("random#1",
    ...), each redrawn until it differs from every set before it (when the model has room for that).
    `probe` (the capture and the target) feeds the `probe` strategy; without it that strategy is refused."""
    sets: dict[tuple[int, ...], list[str]] = {}
    strategies = ["default"] + [x for x in o.strategies if x not in ("default", "random")]
    for strategy in strategies:
        sel = select.select(stats, strategy, o.k, lam=o.lam, probe=probe if strategy in select.NEEDS_PROBE else None)
        sets.setdefault(tuple(sorted(sel.layers)), []).append(strategy)
    for layers in o.extra_sets:
        sel = select.select(stats, "manual", o.k, lam=o.lam, layers=list(layers))
        sets.setdefault(tuple(sorted(sel.layers)), []).append("manual")
    if "random" in o.strategies:
        draw = 0
        for i in range(o.random_sets):
            for _ in range(100):
                layers = tuple(select.select(stats, "random", o.k, seed=1000 * o.seed + draw).layers)
                draw += 1
                if layers not in sets:
                    break
            sets.setdefault(layers, []).append(f"random#{i + 1}")
    if not sets:
        raise SelectionError("The study has no layer sets", "Give at least one strategy or --layers set")
    return [(list(k), v) for k, v in sets.items()]


def proxy_versions(analysis: AnalysisOptions, o: StudyOptions) -> dict[str, AnalysisOptions]:
    """Version name -> analysis options for the proxies: the study's own analysis first, then each
    kernel × token-entropy threshold (the rest of the options as the study's)."""
    def name(a: AnalysisOptions) -> str:
        rule = f"H≥q{a.quantile:g}" if a.quantile is not None else \
            ("no filter" if not a.min_entropy else f"H≥{a.min_entropy:g}")
        return f"{a.kernel}, {rule}"

    out = {name(analysis): analysis}
    for kernel in o.kernels:
        for threshold in o.filters:
            a = replace(analysis, kernel=kernel, min_entropy=float(threshold), quantile=None)
            out.setdefault(name(a), a)
    return out


def training_seeds(o: StudyOptions) -> tuple[int, ...]:
    seeds = tuple(o.seeds) if o.seeds is not None else (o.train.seed,)
    if not seeds:
        raise SelectionError("The study has no training seeds", "Pass e.g. --seeds 0 or --seeds 0,1,2")
    return seeds


def study_units(n_sets: int, n_seeds: int, o: StudyOptions,
                done: Collection[tuple[int, int]] = ()) -> list[list[tuple[int, int]]]:
    """The study's units of work in order, each a list of (set index, seed index) pairs not in `done`: each
    unit is trained, benchmarked (one run against plain decoding) and recorded before the next. From a
    capture: one unit, every pair. Online: one target pass per seed and group of `sets_per_pass` of the sets
    that seed still lacks (None: all), so that a pass can be sized to what one sitting of the machine finishes."""
    if o.online is None:
        todo = [(i, j) for j in range(n_seeds) for i in range(n_sets) if (i, j) not in done]
        return [todo] if todo else []
    size = o.sets_per_pass or n_sets
    units = []
    for j in range(n_seeds):
        todo = [(i, j) for i in range(n_sets) if (i, j) not in done]
        units += [todo[a:a + size] for a in range(0, len(todo), size)]
    return units


def training_identity(cap, store, seed: int, o: StudyOptions) -> dict:
    """What decides a draft's training before it starts, for one training seed (study/outcomes.py): the capture
    or the online data and every option, the seed, the starting drafts. The passes a set trains in are left
    out: each draft learns on its own (seeded alone, the same batches)."""
    if o.online is not None:
        on = replace(o.online, seed=seed, data_seed=online_data_seed(o))
        prompts = load_prompts(on.prompts, limit=on.limit, seed=on.sample_seed, cache=store.root / "prompts")
        return {"online": on.run_fields(), "prompts": prompts.content_hash, **init_from.key_part(on.init_from)}
    tr = replace(o.train, seed=seed)
    return {"capture": cap.key, "options": tr.key_fields(), **init_from.key_part(tr.init_from)}


def outcome_identity(target, layers: list[int], seed: int, training: dict, bench_cache: dict) -> dict:
    """What decides a (set, seed)'s outcome: the target, the layers, the training (training_identity) and the
    benchmark (bench_cache)."""
    return {"target": target.fingerprint, "layers": list(layers), "seed": seed, "training": training,
            "bench": bench_cache, "format": outcomes.FORMAT}


def online_data_seed(o: StudyOptions) -> int:
    """Every seed trains on the same conversations and held-out split (those of the online options' data_seed,
    else of the first seed): a training seed moves the drafts' initialisation and batch order, not the data,
    so the seed spread is the training's own noise (and the target's answers are regenerated once)."""
    return o.online.sample_seed if o.online.data_seed is not None else training_seeds(o)[0]


def train_unit(cap, target, store, sets, todo: list[tuple[int, int]], o: StudyOptions, say,
               unit: int, units: int, measured: Callable[[dict], None] | None = None) -> dict[tuple[int, int], str]:
    """Draft paths of the (set index, seed index) pairs `todo`: from the capture, draft_for each (trained once,
    then from the store); online, train_online: every set of the unit from the same target pass (one seed).
    measured: an online pass passes it what it measured ({"kind": "online", "sets", "options", "last"}: the last
    ResponsesProgress and TrainProgress) as soon as it is done; workflow.study records it as this machine's pace."""
    seeds = training_seeds(o)
    if o.online is not None:
        seed = seeds[todo[0][1]]
        message = (f"online training of {len(todo)} draft{'s' if len(todo) != 1 else ''}"
                   + (f", seed {seed}" if len(seeds) > 1 else "") + (f" (pass {unit + 1}/{units})" if units > len(seeds) else ""))
        say(StudyProgress("train", message, unit, units))
        layer_sets = [sets[i][0] for i, _ in todo]
        options = replace(o.online, seed=seed, data_seed=online_data_seed(o))

        def seen(u, m=message):
            say(StudyProgress("train", m, unit, units, u, getattr(u, "eta_s", None)))
        watch, last = last_of(seen, ResponsesProgress, TrainProgress)
        try:
            result = train_online(target, layer_sets, store, strategy=[sets[i][1][0] for i, _ in todo],
                                  progress=watch, options=options)
        except TrainingCancelled:               # stopped: the pace it measured still informs the next estimate
            if measured is not None:
                measured({"kind": "online", "sets": layer_sets, "options": options, "last": last})
            raise
        if measured is not None:
            measured({"kind": "online", "sets": layer_sets, "options": options, "last": last})
        return {ij: d.path for ij, d in zip(todo, result.drafts)}
    paths, total = {}, len(sets) * len(seeds)
    timer, trained, served = eta.PhaseClock(len(todo)), 0, 0     # a draft from the store takes no time: not counted
    for i, j in todo:
        (layers, strategies), n = sets[i], i * len(seeds) + j
        seed_note = f", seed {seeds[j]}" if len(seeds) > 1 else ""
        message = f"draft {n + 1}/{total}: {'/'.join(strategies)} {layers}{seed_note}"
        say(StudyProgress("train", message, n, total, eta_s=timer.left(trained, len(todo) - served)))
        steps = []

        def seen(u, m=message, n=n, steps=steps):
            steps.append(u.step)
            say(StudyProgress("train", m, n, total, u, timer.left(trained + u.fraction, len(todo) - served)))
        paths[i, j] = draft_for(cap, layers, target, store, strategy=strategies[0], progress=seen,
                                options=replace(o.train, seed=seeds[j]))
        trained, served = (trained + 1, served) if steps else (trained, served + 1)
    return paths


def bench_cache(target, prompt_set, o: StudyOptions) -> dict:
    """What a study benchmark's result depends on besides the draft: the prompts, new tokens, depth, device."""
    return {"prompts": prompt_set.content_hash, "max_new_tokens": o.max_new_tokens, "k": o.depth,
            "device": str(target.device), "format": BENCH_FORMAT}


def benchmark(target, store, sets, paths: dict, prompts, cache: dict, o: StudyOptions, say,
              measured: Callable[[dict], None] | None = None) -> dict:
    """Every draft of `paths` ({(set, seed): path}) on the same prompts against plain decoding, as
    {(set, seed): Outcome}; drafts benchmarked before with these prompts and options come from the store
    (with the machine's state of their run, and plain decoding's entry of the latest run that measured it)."""
    baseline_key = make_key({"autoregressive": target.fingerprint, **cache})
    found, todo, metas = {}, [], {}
    for path in dict.fromkeys(str(p) for p in paths.values()):
        metas[path] = read_meta(path)
        key = make_key({"draft": metas[path].get("key", path), **cache})
        cached = store.get_json("study-bench", key)
        if cached is not None:
            found[path] = (cached["result"], PromptRuns.from_json(cached["per_prompt"]), cached.get("machine"), None)
        else:
            todo.append((path, key))
    if todo:
        heads = bench.load_drafts(target, [(path, path) for path, _ in todo])   # named by their (unique) paths
        started = []                   # when decoding began (after any wait for a quiet machine): for its pace

        def seen(p):
            if p.phase != "wait" and not started:
                started.append(time.perf_counter())
            say(StudyProgress("bench", p.message if p.phase != "decode" else f"benchmark: {p.contender}", detail=p,
                              eta_s=p.eta_s))

        bench_options = o.bench_options()
        contenders = bench.contenders_for(heads, bench_options)
        report = bench.measure(target, prompts, contenders, o.max_new_tokens, progress=seen,
                               machine_options=bench_options.machine)
        if started and measured is not None:    # its decoding's seconds, for workflow.study to record as a pace
            measured({"kind": "bench", "seconds": time.perf_counter() - started[0], "options": bench_options,
                      "drafts": len(heads), "prompts": len(prompts), "contenders": len(contenders)})
        by_name = {r["name"]: r for r in report.results}
        baseline = by_name["autoregressive"] | {"machine": report.machine}
        for path, key in todo:
            runs = bench.prompt_runs(by_name[path], by_name["autoregressive"])
            found[path] = (by_name[path], runs, report.machine, baseline)
            store.put_json("study-bench", key, {"result": by_name[path], "per_prompt": runs.to_json(),
                                                "machine": report.machine})
        store.put_json("study-bench", baseline_key, baseline)
    latest = store.get_json("study-bench", baseline_key) or {}
    seeds = training_seeds(o)
    out = {}
    for (i, j), p in paths.items():
        result, runs, state, baseline = found[str(p)]
        out[i, j] = Outcome(list(sets[i][0]), seeds[j], str(p), metas[str(p)], result, runs, state,
                            baseline if baseline is not None else latest)
    return out


def finish_drafts(cap, target, store, sets, o: StudyOptions, say,
                  measured: Callable[[dict], None] | None = None,
                  planned: Callable[[int, int, int], None] | None = None) -> list[list[Outcome]]:
    """Outcome per set and training seed ([set][seed]): from the outcomes folder where it holds one, else
    trained and benchmarked unit by unit (study_units), each written to the folder once benchmarked. `planned`
    hears (drafts to train, their units, drafts read back) before the first unit starts."""
    seeds = training_seeds(o)
    folder = OutcomeFolder(o.outcomes) if o.outcomes else None
    prompt_set, prompts = bench.fitting_prompts(target.tokenizer, o.bench_options(), cache=store.root / "prompts")
    cache = bench_cache(target, prompt_set, o)
    identities, done = {}, {}
    if folder is not None:
        trainings = [training_identity(cap, store, seed, o) for seed in seeds]      # once per seed, not per set
        for i, (layers, _) in enumerate(sets):
            for j, seed in enumerate(seeds):
                identities[i, j] = outcome_identity(target, layers, seed, trainings[j], cache)
                got = folder.get(identities[i, j])
                if got is not None:
                    done[i, j] = got
        say(StudyProgress("train", f"{len(done)} of {len(identities)} drafts (set, seed) already in {folder.root}"))
    units = study_units(len(sets), len(seeds), o, done)
    if planned is not None:
        planned(sum(len(todo) for todo in units), len(units), len(done))
    for u, todo in enumerate(units):
        paths = train_unit(cap, target, store, sets, todo, o, say, u, len(units), measured)
        for ij, outcome in benchmark(target, store, sets, paths, prompts, cache, o, say, measured).items():
            done[ij] = outcome
            if folder is not None:
                folder.put(identities[ij], outcome)
    return [[done[i, j] for j in range(len(seeds))] for i in range(len(sets))]


def run_study(cap, target, store, options: StudyOptions | None = None, analysis: AnalysisOptions | None = None,
              progress: Callable[[StudyProgress], None] | None = None,
              measured: Callable[[dict], None] | None = None,
              planned: Callable[[int, int, int], None] | None = None) -> StudyReport:
    """Run the study for capture `cap` (a CaptureReader) with `target` (its LoadedModel). `measured` hears what
    each online pass and each benchmark measured of this machine, as soon as it is done (workflow.study records
    them as paces for the next estimates: forecast.study_measured). `planned` hears how many drafts remain to
    train, in how many units, and how many were read back, once the plan is known (workflow.study estimates
    what remains: the estimate before the start cannot know what the outcomes folder holds)."""
    o = options or StudyOptions()
    seeds = training_seeds(o)
    analysis = analysis or AnalysisOptions()
    say = progress or (lambda p: None)
    say(StudyProgress("analyze", "layer statistics"))
    stats = analyze(cap, store, analysis)
    searched = None
    if any(x in select.NEEDS_PROBE for x in o.strategies):
        say(StudyProgress("analyze", "probe: searching for the best set"))
        searched = probe_mod.ProbeInput(cap, TargetWeights.of(target), o.probe or ProbeOptions(), store)
    sets = propose_sets(stats, o, searched)
    versions, skipped = {}, {}
    for name, a in proxy_versions(analysis, o).items():
        say(StudyProgress("analyze", f"layer statistics for the proxies: {name}"))
        try:
            versions[name] = stats if a == analysis else analyze(cap, store, a)
        except LayerScopeError as e:            # e.g. a threshold that leaves too few tokens: that version only
            skipped[name] = str(e)

    probed, probe_skipped = None, None
    if o.probe is not None:
        say(StudyProgress("analyze", "probe: a ridge map per set"))
        try:
            probed = probe_mod.score_sets(cap, target, [layers for layers, _ in sets], o.probe, store=store,
                                          progress=lambda frac, msg="": say(StudyProgress("analyze", msg)))
        except probe_mod.ProbeError as e:        # e.g. a capture without held-out response positions
            probe_skipped = str(e)

    finished = finish_drafts(cap, target, store, sets, o, say, measured, planned)
    n_prompts = len(finished[0][0].per_prompt.tokens)
    merged = quietness.merge([oc.machine for ocs in finished for oc in ocs])
    machine_state = merged.to_json() if merged is not None else None
    reference = next(i for i, (_, strategies) in enumerate(sets) if "default" in strategies)
    compared, tau_boot = paired.compare_sets([[oc.per_prompt for oc in ocs] for ocs in finished], reference,
                                             seed=o.seed)

    rows = []
    for i, ((layers, strategies), ocs, c) in enumerate(zip(sets, finished, compared)):
        score = select.score_set(stats, layers, o.lam)
        metas = [oc.meta for oc in ocs]
        entries = [oc.result for oc in ocs]
        paths = [oc.draft for oc in ocs]
        proxies = {}
        for name, v in versions.items():
            sc = select.score_set(v, layers, o.lam)
            proxies[name] = {p: sc[p] for p in PROXIES}
        per_seed = [{"seed": seed, **c["seeds"][j], "val_accuracy": metas[j].get("val_accuracy", []),
                     "simulated_acc_len": simulated_acc_len(metas[j].get("val_accuracy") or []),
                     "curve": metas[j].get("curve", []), "draft": str(p)} for j, (seed, p) in enumerate(zip(seeds, paths))]
        val_acc = _mean_lists([m.get("val_accuracy", []) for m in metas])
        rows.append(StudyRow(
            layers, strategies, score["mean_entropy"], score["mean_cka"], score["aggregate_entropy"],
            val_acc, c["tau"], c["speedup"],
            _mean([e["tokens_per_s"] for e in entries]), _mean_lists([e["acceptance_by_position"] for e in entries]),
            all(e["lossless"] for e in entries), str(paths[0]), tau_ci=c["tau_ci"], acceptance=c["acceptance"],
            acceptance_ci=c["acceptance_ci"], speedup_ci=c["speedup_ci"], delta_vs_default=c["delta_vs_default"],
            delta_ci=c["delta_ci"], paired=c["paired"], seeds=per_seed, tau_seed_range=c["tau_seed_range"],
            tau_seed_sd=c["tau_seed_sd"], proxies=proxies, drafts=[str(p) for p in paths],
            probe=probed.sets[i].to_json() if probed is not None else None,
            simulated_acc_len=simulated_acc_len(val_acc) if val_acc else None))

    taus = [r.tau for r in rows]
    corr = {p: spearman([getattr(r, p) for r in rows], taus) for p in PROXIES}
    corr["val_accuracy@1"] = spearman([r.val_accuracy[0] if r.val_accuracy else None for r in rows], taus)
    if probed is not None:
        corr["probe"] = spearman([r.probe["agreement"] for r in rows], taus)
    table = [r.proxies | {"training": {"val_accuracy@1": r.val_accuracy[0] if r.val_accuracy else None}}
             | ({PROBE_VERSION: {"probe": r.probe["agreement"]}} if probed is not None else {}) for r in rows]
    correlations = paired.correlate(table, taus, tau_boot, seed=o.seed + 1)
    text = paired.verdict([r.to_json() for r in rows], reference, correlations, prompts=n_prompts, seeds=len(seeds))
    busy = quietness.caution(machine_state, "speedups and tokens/s")
    text = f"{text} {busy}" if busy else text
    options_json = asdict(o) | {"seeds": list(seeds), "analysis": asdict(analysis), "kernel": analysis.kernel,
                                "proxy_versions": list(versions), "proxy_versions_skipped": skipped,
                                "probe_skipped": probe_skipped}
    baselines = {make_key(oc.baseline): oc.baseline for ocs in finished for oc in ocs}
    base_rate = _mean([b.get("tokens_per_s") for b in baselines.values()])   # plain decoding, over the runs used
    report = StudyReport(cap.key, rows, corr, base_rate, n_prompts, options_json, text,
                         correlations, paired.best_versions(correlations), reference, machine_state)
    say(StudyProgress("done", "study complete"))
    return report


def _mean(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _mean_lists(lists) -> list[float]:
    """Element-wise mean of lists (over the positions all of them have)."""
    lists = [x for x in lists if x]
    return [sum(v) / len(v) for v in zip(*lists)] if lists else []


# what a study says first of its online options: the fields the study command sets, in its order
ONLINE_SETTINGS = ("prompts", "limit", "responses", "ttt_steps", "lr", "seed", "steps", "tokens", "time_s")


def online_settings(online: dict) -> dict:
    """What a study says of its online training (StudyReport.options["online"], OnlineOptions' fields): the
    fields the study command sets (ONLINE_SETTINGS, in that order), then any other away from its default;
    None ones left out."""
    defaults = asdict(OnlineOptions())
    named = [k for k in ONLINE_SETTINGS if k in online] + [
        k for k in online if k not in ONLINE_SETTINGS and (k not in defaults or online[k] != defaults[k])]
    return {k: online[k] for k in named if online[k] is not None}


def budget_text(options: dict) -> str:
    """The training budget of a study's drafts in words, from its options (StudyReport.options)."""
    online = options.get("online")
    if online:
        return "online training (" + ", ".join(f"{k}={v}" for k, v in online_settings(online).items()
                                               if k != "seed") + ")"   # seeds: said apart
    return f"{(options.get('train') or {}).get('steps')} training steps per draft"


def format_study(report: StudyReport) -> str:
    """The verdict, the table (τ with its interval, the paired difference to the default rule, the seed
    spread), and the proxies' rank correlations with τ: the study's own and the best version of each."""
    head = ["layers", "strategy", "entropy", "redundancy", "agg.entropy", "val acc@1", "sim.acc.len", "probe", "tau",
            "tau 95% CI",
            "vs default", "diff 95% CI", "seed range", "speedup", "lossless"]
    rows = []
    f3 = lambda x: f"{x:.3f}" if x is not None else "-"  # noqa: E731
    for r in report.rows:
        rows.append([",".join(map(str, r.layers)), "/".join(r.strategies), f"{r.mean_entropy:.3f}", f"{r.mean_cka:.3f}",
                     f"{r.aggregate_entropy:.3f}", f"{r.val_accuracy[0]:.3f}" if r.val_accuracy else "-",
                     f3(r.simulated_acc_len),
                     f3(r.probe["agreement"]) if r.probe else "-",
                     f3(r.tau), fmt.ci(r.tau_ci, "tau"), f"{r.delta_vs_default:+.3f}" if r.delta_vs_default is not None else "-",
                     fmt.ci(r.delta_ci, "delta"), f3(r.tau_seed_range) if len(r.seeds) > 1 else "-",
                     f"{r.speedup:.2f}x" if r.speedup else "-", "yes" if r.lossless else "NO"])
    lines = [fmt.table(head, rows, rule=True)]
    o = report.options
    seeds = o.get("seeds") or []
    lines.insert(0, f"capture {report.capture}: {report.prompts} {o.get('prompts')} prompts, {o.get('max_new_tokens')} new "
                    f"tokens, chain K={o.get('depth')}, {budget_text(o)}, "
                    f"training seeds {','.join(map(str, seeds))}, {o.get('kernel')} kernel\n")
    lines.insert(1, report.verdict + "\n")
    if report.machine:
        lines.insert(2, quietness.line(report.machine, "speedups") + "\n")
    lines.append("")
    lines.append("Proxies from the study's statistics are in the table (entropy, redundancy = mean CKA, agg.entropy; "
                 "probe = the training-free ridge map's held-out agreement, layerscope/study/probe.py).")
    lines.append("val acc@1 = the drafts' held-out agreement at draft position 1; sim.acc.len = "
                 + fmt.NAMES["simulated_acc_len"] + ", over the TTT steps' agreement (mean over seeds).")
    lines.append("Spearman correlation with tau over the sets: " + ", ".join(
        f"{k} {v:+.2f}" if v is not None else f"{k} n/a" for k, v in report.spearman.items()))
    by_proxy: dict[str, list[dict]] = {}
    for c in report.correlations:
        by_proxy.setdefault(c["proxy"], []).append(c)
    if by_proxy:
        lines.append("Every version (kernel, token-entropy filter), rho with its 95% interval; * = best of the proxy:")
        for proxy, cs in by_proxy.items():
            best = report.best_proxies.get(proxy, {}).get("version")
            lines.append(f"  {proxy}: " + "; ".join(
                f"{c['version']} {c['rho']:+.2f} {fmt.ci(c['ci'], 'delta')}{'*' if c['version'] == best else ''}"
                if c["rho"] is not None else f"{c['version']} n/a" for c in cs))
    return "\n".join(lines)
