"""The layer-set study: do the proxy scores predict acceptance?

For one capture:
  1. statistics   analysis.analyze (cached in the store);
  2. sets         one layer set per strategy (default, greedy, aggregate, entropy-topk, ... plus any
                  user sets); strategies that propose the same set share one draft;
  3. drafts       draft.train.draft_for per set, all with the same budget, data and seed (cached:
                  a re-run that adds a set trains only that one);
  4. benchmark    bench.run on held-out prompts, every draft against plain decoding in one run
                  (each draft's result is cached with the prompts and decoding options);
  5. table        per set: proxy scores, validation accuracy, τ, speedup; and the Spearman
                  correlation between each proxy and τ.

`run_study(...)` returns the StudyReport and reports StudyProgress through a callback as it goes
(training steps and benchmark steps live), for a CLI bar or the app's background job.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from layerscope import bench, select, specdec
from layerscope.analysis import AnalysisOptions, analyze
from layerscope.draft.export import read_meta
from layerscope.draft.train import draft_for
from layerscope.errors import SelectionError
from layerscope.metrics.correlation import spearman
from layerscope.store import make_key

STUDY_STRATEGIES = ("default", "greedy", "aggregate", "entropy-topk", "spread")
PROXIES = ("mean_entropy", "mean_cka", "aggregate_entropy")


@dataclass
class StudyOptions:
    strategies: tuple[str, ...] = STUDY_STRATEGIES
    extra_sets: tuple[tuple[int, ...], ...] = ()      # hand-picked sets (--layers), studied as "manual"
    k: int = 3
    lam: float = 0.5
    train: dict = field(default_factory=dict)   # draft.train.TrainOptions fields; workflow.study adds the
                                                 # device's default steps (workflow.default_train_steps) when none
    prompts: str = "sharegpt-heldout"
    limit: int = 20
    seed: int = 0
    max_new_tokens: int = 64
    max_prompt_tokens: int = bench.MAX_PROMPT_TOKENS
    depth: int = specdec.DEFAULT_K                     # chain draft depth K

    def bench_options(self) -> bench.BenchOptions:
        """The benchmark of the study: these prompts, one chain of depth K per draft, no HF peers."""
        return bench.BenchOptions(prompts=self.prompts, limit=self.limit, seed=self.seed,
                                  max_new_tokens=self.max_new_tokens, max_prompt_tokens=self.max_prompt_tokens,
                                  ks=(self.depth,), peers=False)


@dataclass
class StudyRow:
    layers: list[int]
    strategies: list[str]
    mean_entropy: float
    mean_cka: float
    aggregate_entropy: float
    val_accuracy: list[float]
    tau: float | None = None
    speedup: float | None = None
    tokens_per_s: float | None = None
    acceptance_by_position: list[float] = field(default_factory=list)
    lossless: bool | None = None
    draft: str = ""

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class StudyReport:
    capture: str
    rows: list[StudyRow]
    spearman: dict[str, float | None]      # proxy -> rank correlation with τ over the rows
    baseline_tokens_per_s: float | None
    prompts: int
    options: dict

    def to_json(self) -> dict:
        return {"capture": self.capture, "rows": [r.to_json() for r in self.rows], "spearman": self.spearman,
                "baseline_tokens_per_s": self.baseline_tokens_per_s, "prompts": self.prompts, "options": self.options}


@dataclass(frozen=True)
class StudyProgress:
    phase: str                       # "analyze" | "train" | "bench" | "done"
    message: str
    set_index: int = 0               # which set is training (train phase)
    sets_total: int = 0
    detail: object = None            # the train progress dict, or the bench.BenchProgress


def propose_sets(stats, o: StudyOptions) -> list[tuple[list[int], list[str]]]:
    """Distinct layer sets in strategy order, each with the strategies that proposed it."""
    sets: dict[tuple[int, ...], list[str]] = {}
    for strategy in o.strategies:
        sel = select.select(stats, strategy, o.k, lam=o.lam)
        sets.setdefault(tuple(sorted(sel.layers)), []).append(strategy)
    for layers in o.extra_sets:
        sel = select.select(stats, "manual", o.k, lam=o.lam, layers=list(layers))
        sets.setdefault(tuple(sorted(sel.layers)), []).append("manual")
    if not sets:
        raise SelectionError("The study has no layer sets", "Give at least one strategy or --layers set")
    return [(list(k), v) for k, v in sets.items()]


def run_study(cap, target, store, options: StudyOptions | None = None, analysis: AnalysisOptions | None = None,
              progress: Callable[[StudyProgress], None] | None = None) -> StudyReport:
    """Run the study for capture `cap` (a CaptureReader) with `target` (its LoadedModel)."""
    o = options or StudyOptions()
    say = progress or (lambda p: None)
    say(StudyProgress("analyze", "layer statistics"))
    stats = analyze(cap, store, analysis or AnalysisOptions())
    sets = propose_sets(stats, o)

    drafts = []
    for i, (layers, strategies) in enumerate(sets):
        label = f"{'/'.join(strategies)} {layers}"
        message = f"draft {i + 1}/{len(sets)}: {label}"
        say(StudyProgress("train", message, i, len(sets)))
        path = draft_for(cap, layers, target, store, strategy=strategies[0],
                         progress=lambda u, m=message, i=i: say(StudyProgress("train", m, i, len(sets), u)), **o.train)
        drafts.append(path)

    bench_options = o.bench_options()
    prompt_set, prompts = bench.fitting_prompts(target.tokenizer, bench_options)
    cache = {"prompts": prompt_set.content_hash, "max_new_tokens": o.max_new_tokens, "k": o.depth,
             "device": str(target.device)}
    baseline_key = make_key({"autoregressive": target.fingerprint, **cache})
    results, todo = {}, []
    for path in drafts:
        key = make_key({"draft": read_meta(path).get("key", str(path)), **cache})
        cached = store.get_json("study-bench", key)
        if cached is not None:
            results[str(path)] = cached
        else:
            todo.append((path, key))
    baseline = store.get_json("study-bench", baseline_key)
    if todo:
        heads = bench.load_drafts(target, [(str(p), p) for p, _ in todo])
        report = bench.measure(target, prompts, bench.contenders_for(heads, bench_options), o.max_new_tokens,
                               progress=lambda p: say(StudyProgress("bench", f"benchmark: {p.contender}", detail=p)))
        by_name = {r["name"]: r for r in report.results}
        for path, key in todo:
            results[str(path)] = by_name[str(path)]
            store.put_json("study-bench", key, by_name[str(path)])
        baseline = by_name["autoregressive"]
        store.put_json("study-bench", baseline_key, baseline)

    rows = []
    for (layers, strategies), path in zip(sets, drafts):
        score = select.score_set(stats, layers, o.lam)
        r = results[str(path)]
        rows.append(StudyRow(layers, strategies, score["mean_entropy"], score["mean_cka"], score["aggregate_entropy"],
                             read_meta(path).get("val_accuracy", []), r["tau"], r["speedup"], r["tokens_per_s"],
                             r["acceptance_by_position"], r["lossless"], str(path)))
    taus = [r.tau for r in rows]
    corr = {p: spearman([getattr(r, p) for r in rows], taus) for p in PROXIES}
    corr["val_accuracy@1"] = spearman([r.val_accuracy[0] if r.val_accuracy else None for r in rows], taus)
    report = StudyReport(cap.key, rows, corr, (baseline or {}).get("tokens_per_s"), len(prompts), asdict(o))
    say(StudyProgress("done", "study complete"))
    return report


def format_study(report: StudyReport) -> str:
    head = ["layers", "strategy", "entropy", "redundancy", "agg.entropy", "val acc@1", "tau", "speedup", "lossless"]
    rows = [head]
    for r in report.rows:
        rows.append([",".join(map(str, r.layers)), "/".join(r.strategies), f"{r.mean_entropy:.3f}", f"{r.mean_cka:.3f}",
                     f"{r.aggregate_entropy:.3f}", f"{r.val_accuracy[0]:.3f}" if r.val_accuracy else "-",
                     f"{r.tau:.3f}" if r.tau is not None else "-", f"{r.speedup:.2f}x" if r.speedup else "-",
                     "yes" if r.lossless else "NO"])
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    o = report.options
    lines.insert(0, f"capture {report.capture}: {report.prompts} {o.get('prompts')} prompts, {o.get('max_new_tokens')} new "
                    f"tokens, chain K={o.get('depth')}, {o.get('train', {}).get('steps')} training steps per draft\n")
    lines.append("")
    lines.append("Spearman correlation with tau over the sets: " + ", ".join(
        f"{k} {v:+.2f}" if v is not None else f"{k} n/a" for k, v in report.spearman.items()))
    return "\n".join(lines)
