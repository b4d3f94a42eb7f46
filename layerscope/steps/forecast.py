"""What a step will cost before it starts: its time and what it stores, said as an estimate with what it assumed.
The CLI prints `Forecast.line()` on stderr before a capture, a training (online: the target's answers, then the
training at its budget), a benchmark or a study starts; the app shows it next to the start button. Once the step
runs, its time left is measured instead (layerscope.eta).

Time is a rule of the target's parameter count P (target.config.param_count of the config read without the weights,
target.shape.target_shape), multiplied by the pace measured on this machine when there is one:

    a decode step of one row            P x DECODE_S   (1 ns: SmolLM2-135M's plain decoding ran at about 8 tokens/s
                                                        on the 2-core development machine, docs/internals.md: 0.93 ns
                                                        a parameter; a GPU is far faster, so the rule overstates there)
    ... of a batch of b rows            x (1 + (b - 1) x BATCH_ROW)   (0.25: the rows share the weights' reads and
                                                        the step's overhead; a batch of 32 writes 3.7x the tokens of one)
    a token read in a whole forward     P x FORWARD_S  (0.04 ns: 2 flops a parameter at 50 GFLOP/s)
    a row of draft training, per set    the draft's parameters x TRAIN_PASSES (forward and backward) x TTT steps
                                        x FORWARD_S

    capture     its answers (conversations x max_new_tokens, decoded --batch-size rows at a time) and every token
                read once (capture.size's Estimate: prompts and full-length answers, an upper bound)
    answers     online training's regenerated answers: conversations x max_new_tokens, decoded gen_batch_size rows at
                a time (every conversation of the prompt set unless --limit; answers already stored are not written again)
    training    rows x (the target's forward when online + each set's draft): rows = the tokens budget, or steps x
                batch x rows a window (capture: seq_len; online: max_prompt_tokens + max_new_tokens, an upper
                bound); a time budget is its own time
    model load  a first use of a GGUF (an alias, a .gguf file) de-quantizes it: P x DEQUANTIZE_S (SmolLM2-135M's
                first load took ~15 s, Qwen2.5-Coder-1.5B's 2-3 min); a later load reads the float32 copy:
                P x LOAD_S; none when the process that runs the step holds the model already (`held`)
    bench       the model load; the cost curve (curve_rule: the forwards costmodel.cost_curve times), once per
                machine and model: none when a run here measured it before (a busy curve is measured again when
                the machine is quiet: counted, at most); for K = auto the calibration's prompts per draft
                (bench.CALIBRATION_PROMPTS, at most 64 tokens each, decoded one row at a time); then prompts x
                max_new_tokens x contenders, decoded one row at a time
    study       each draft's training, then the benchmarks of its drafts against plain decoding

Measured pace: after every finished run, workflow records its seconds over the rule's (`remember`: the store's
index, namespace "pace", per kind, model spec and device), and the next forecast of that kind multiplies the rule by
it ("measured here"). Without one the rule stands alone, and says so. The benchmark records a pace per phase
(its model load, cost curve, calibration and decoding), so each part of its next estimate is this machine's own.
A time under a second reads "under a second", never "about 0.0 s" (`about`).
Disk: capture.size's Estimate; the drafts, checkpoints and answers as preflight counts them; a benchmark stores nothing.
"""

from __future__ import annotations

import datetime as _dt
import math
import time
from dataclasses import dataclass

import torch

from layerscope import fmt
from layerscope.decoding import bench as bench_mod
from layerscope.decoding import costmodel
from layerscope.draft import size as draft_size
from layerscope.draft.training import responses
from layerscope.draft.training.progress import ResponsesProgress, TrainProgress
from layerscope.steps import preflight
from layerscope.store import Store, make_key
from layerscope.target.aliases import ALIASES
from layerscope.target.load import default_device
from layerscope.target.shape import Target, target

DECODE_S = 1e-9            # seconds a decode step of one row costs per target parameter (the rule)
BATCH_ROW = 0.25           # each row more in a decode step's batch adds this share of a one-row step
FORWARD_S = 4e-11          # seconds a token read in a whole forward costs per parameter (2 flops at 50 GFLOP/s)
TRAIN_PASSES = 3           # a training row's forward and backward through a draft, in forwards
DEQUANTIZE_S = 1.1e-7      # seconds a first load costs per parameter: the GGUF parsed and de-quantized, stored
LOAD_S = 1.5e-8            # seconds a later load costs per parameter: float32 safetensors read back
HELD_S = 0.05              # a loader that returned sooner held the model already: no load measured
PACE = "pace"              # the index namespace of measured paces
KINDS = {"capture": "capture", "answers": "answer writing", "training": "training from a capture",
         "online": "online training", "bench": "benchmark", "load": "load", "first load": "first load",
         "cost curve": "cost curve", "calibration": "calibration"}


def about(seconds: float | None) -> str:
    """An estimate's time in words: "about 3 min", "under a second" (never "about 0.0 s")."""
    if seconds is None:
        return "no time estimate"
    return "under a second" if seconds < 1 else f"about {fmt.duration(seconds)}"


@dataclass(frozen=True)
class Part:
    """One part of a step's time: what it is, its seconds, and where its pace comes from."""
    what: str
    seconds: float
    source: str


@dataclass
class Forecast:
    """A step's estimate before it starts: seconds (None: no estimate, `why`), bytes stored at most (None: unknown),
    and the parts the time is made of."""
    what: str
    seconds: float | None
    bytes: int | None
    parts: list[Part]
    why: str = ""

    def line(self) -> str:
        """One line for the user: what it will take, what it stores, and what that assumed."""
        took = about(self.seconds)
        stored = "" if self.bytes is None else (", nothing stored" if self.bytes == 0
                                                 else f", up to {fmt.size(self.bytes)} stored")
        sources = list(dict.fromkeys(p.source for p in self.parts))
        if len(self.parts) == 1:
            how = f"{self.parts[0].what}, {self.parts[0].source}"
        elif len(sources) == 1:                   # one pace for every part: said once
            how = "; ".join([f"{p.what}: {about(p.seconds)}" for p in self.parts] + sources)
        else:
            how = "; ".join(f"{p.what}: {about(p.seconds)}, {p.source}" for p in self.parts) or self.why
        return f"Estimate before the {self.what} starts: {took}{stored} ({how})."


# ---------------------------------------------------------------------------- the target and the measured pace

def _key(kind: str, model: str, device: str) -> str:
    return make_key({"kind": kind, "model": str(model).strip(), "device": device})


def remember(store: Store, kind: str, model: str, seconds: float, rule_seconds: float, device: str,
             **extra) -> None:
    """Record a finished run's pace: its seconds over the rule's for the same work (a kind of KINDS); `extra`:
    what else the next forecast needs to know (a cost curve: whether it was measured quiet)."""
    if not (seconds > 0 and rule_seconds > 0 and math.isfinite(seconds / rule_seconds)):
        return
    store.put_json(PACE, _key(kind, model, device), {
        "kind": kind, "model": str(model).strip(), "device": device, "pace": seconds / rule_seconds,
        "seconds": seconds, "threads": torch.get_num_threads(),
        "when": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")} | extra)


def measured(store: Store, kind: str, model: str, loaded, seconds: float, rule, **extra) -> None:
    """Record a finished run's pace for the next forecast of its kind: `seconds` against `rule(Target)`, the rule's
    seconds for the same work, on the device of `loaded` (the LoadedModel that ran it)."""
    t = target(store, model)
    if t is not None:
        remember(store, kind, model, seconds, rule(t), loaded.device.type, **extra)


def first_load(store: Store, model: str) -> bool:
    """Whether loading `model` de-quantizes a GGUF file first (an alias or a .gguf file whose float32 copy is not in
    the store yet)."""
    spec = str(model).strip()
    return (spec in ALIASES or spec.endswith(".gguf")) and not preflight.dequantized(spec, store)


def timed_load(store: Store, model: str, load):
    """`load(model, store)` (a workflow Loader), its seconds recorded as this machine's load pace (a first use's
    apart) unless it returned at once: a loader that held the model already (the app's worker) loaded nothing."""
    first = first_load(store, model)
    t0 = time.perf_counter()
    loaded = load(model, store)
    seconds = time.perf_counter() - t0
    if seconds >= HELD_S:
        measured(store, "first load" if first else "load", model, loaded, seconds, lambda t: load_rule(t, first))
    return loaded


def online_measured(store: Store, model: str, loaded, sets, options, last: dict) -> None:
    """An online training's paces (workflow.train_online and the study's passes): its target's answers when this run
    wrote them all, and its training's seconds a row. `last`: the last ResponsesProgress and TrainProgress it reported
    (draft.training.progress.last_of)."""
    a, p = last.get(ResponsesProgress), last.get(TrainProgress)
    if a is not None and a.done == a.total and a.prompts:
        measured(store, "answers", model, loaded, a.elapsed_s,
                 lambda t: generated_s(t, a.prompts, options.max_new_tokens, options.gen_batch_size))
    if p is not None and p.tokens_per_s > 0:
        measured(store, "online", model, loaded, 1 / p.tokens_per_s, lambda t: row_rule(t, sets, options, True))


def bench_measured(store: Store, model: str, loaded, seconds: float, options, drafts: int, prompts: int,
                   contenders: int, timings: dict | None = None) -> None:
    """A benchmark's paces (workflow.bench and the study's benchmarks): `seconds` of decoding against the rule's for
    the tokens it generated at most (bench_tokens); `timings` (bench.plan's): the cost curve's measurement and the
    calibration, each against its own rule."""
    measured(store, "bench", model, loaded, seconds, lambda t: generated_s(t, bench_tokens(
        options, drafts, prompts=prompts, contenders=contenders)))
    timings = timings or {}
    if "cost curve" in timings:
        measured(store, "cost curve", model, loaded, timings["cost curve"], curve_rule,
                 quiet=bool(timings.get("cost curve quiet", True)))
    if "calibration" in timings:
        measured(store, "calibration", model, loaded, timings["calibration"], lambda t: generated_s(
            t, calibration_tokens(options, drafts, timings.get("calibration prompts"))))


def study_measured(store: Store, model: str, loaded, what: dict) -> None:
    """Record what a study's online pass or benchmark measured (study.run's `measured` dicts) as this machine's
    pace of that kind, as train-draft and bench record theirs."""
    if what["kind"] == "online":
        online_measured(store, model, loaded, what["sets"], what["options"], what["last"])
    elif what["kind"] == "bench":
        bench_measured(store, model, loaded, what["seconds"], what["options"], what["drafts"], what["prompts"],
                       what["contenders"])


def pace(store: Store, kind: str, model: str, t: Target) -> tuple[float, str]:
    """(the rule's multiplier, where it comes from): the last measured pace of `kind` for `model` on this machine's
    device, else 1 and the rule."""
    device = default_device()[0].type
    got = store.get_json(PACE, _key(kind, model, device))
    try:
        x = float(got["pace"])
        if x > 0 and math.isfinite(x):
            return x, f"at the pace the last {KINDS[kind]} of {str(model).strip()} measured here"
    except (TypeError, KeyError, ValueError):
        pass
    return 1.0, (f"by a conservative rule of thumb for {t.params / 1e6:.3g}M parameters until a run here measures "
                 f"the pace")


# ---------------------------------------------------------------------------- the rules (seconds)

def generated_s(t: Target, rows: int, new_tokens: int = 1, batch: int = 1) -> float:
    """The rule's seconds for `rows` answers of up to `new_tokens` tokens, decoded `batch` rows at a time."""
    b = max(1, min(int(batch), int(rows)))
    return math.ceil(int(rows) / b) * int(new_tokens) * t.params * DECODE_S * (1 + (b - 1) * BATCH_ROW)


def read_s(t: Target, tokens: int) -> float:
    return float(tokens) * t.params * FORWARD_S


def capture_rule(t: Target, plan, batch_size: int) -> float:
    """A capture of capture.size Estimate `plan` in batches of `batch_size`: its answers decoded, every token read once."""
    return (generated_s(t, plan.conversations, plan.max_new_tokens, batch_size)
            + read_s(t, plan.prompt_tokens + plan.response_tokens))


def draft_params(t: Target, sets, draft_vocab: int, intermediate: int | None = None) -> int:
    """The parameters of one draft per layer set (draft.size.draft_params)."""
    return sum(draft_size.draft_params(t.shape, list(s), int(draft_vocab), intermediate) for s in sets)


def row_rule(t: Target, sets, options, online: bool) -> float:
    """Seconds a training row costs: the target's forward when online, and each set's draft forward and backward
    over the TTT steps."""
    drafts = draft_params(t, sets, options.draft_vocab, options.draft_intermediate) * TRAIN_PASSES * int(options.ttt_steps) * FORWARD_S
    return (t.params * FORWARD_S if online else 0.0) + drafts


def training_rows(options, online: bool) -> int | None:
    """The rows a training budget spends (an upper bound for steps); None for a time budget."""
    if options.tokens is not None:
        return int(options.tokens)
    if options.steps is None:
        return None
    window = int(options.max_prompt_tokens) + int(options.max_new_tokens) if online else int(options.seq_len)
    return int(options.steps) * int(options.batch_size) * window


def bench_tokens(options, drafts: int, prompts: int | None = None, contenders: int | None = None) -> int:
    """The tokens a benchmark decodes at most: prompts x max_new_tokens x contenders."""
    lineup = bench_mod.contenders_for([(f"draft {i}", None) for i in range(drafts)], options)
    auto = (int(options.auto_k) + int(options.auto_tree) + int(options.auto_k and options.draft_lookup > 0)) * drafts
    n = len(lineup) + auto if contenders is None else contenders
    return (options.limit if prompts is None else prompts) * options.max_new_tokens * n


def calibrates(options) -> bool:
    return bool(options.auto_k or options.auto_tree or options.auto_lookup)


def calibration_tokens(options, drafts: int, prompts: int | None = None) -> int:
    """The tokens a benchmark's calibration for K = auto decodes at most: its prompts (bench.CALIBRATION_PROMPTS)
    per draft, at most 64 tokens each; none without auto."""
    if not calibrates(options):
        return 0
    n = bench_mod.CALIBRATION_PROMPTS if prompts is None else int(prompts)
    return int(drafts) * n * min(int(options.max_new_tokens), 64)


def curve_rule(t: Target) -> float:
    """The rule's seconds of measuring a cost curve (costmodel.cost_curve at its defaults): per cache length, its
    prefill, a warm-up and REPEATS forwards over each of 1..MAX_TOKENS new tokens; then the draft's steps."""
    lengths, repeats, most = costmodel.CACHE_LENGTHS, costmodel.REPEATS, costmodel.MAX_TOKENS
    forwards = len(lengths) * (2 + repeats * most)
    tokens = sum(lengths) + len(lengths) * (most + repeats * most * (most + 1) // 2)
    return generated_s(t, forwards) + read_s(t, tokens) + generated_s(t, 1 + repeats * costmodel.DRAFT_ROWS) / 10


def load_rule(t: Target, first: bool) -> float:
    """The rule's seconds of loading the target: a first use de-quantizes a GGUF, a later load reads it back."""
    return t.params * (DEQUANTIZE_S if first else LOAD_S)


NO_CONFIG = "the target's config cannot be read before its first load here"


def load_parts(store: Store, model: str, t: Target, held: bool = False) -> list[Part]:
    """The model load's part of a step (none when the process that runs it holds the model: `held`)."""
    if held:
        return []
    first = first_load(store, model)
    x, source = pace(store, "first load" if first else "load", model, t)
    what = ("loading the model, its GGUF file de-quantized on this first use" if first else "loading the model")
    return [Part(what, load_rule(t, first) * x, source)]


def curve_part(store: Store, model: str, t: Target) -> Part:
    """The cost curve's part of a benchmark: measured once per machine and model, then read from the store."""
    x, source = pace(store, "cost curve", model, t)
    seconds = curve_rule(t) * x
    seen = store.get_json(PACE, _key("cost curve", model, default_device()[0].type))
    if seen is None:
        return Part("measuring the cost curve (once per machine and model)", seconds, source)
    if seen.get("quiet", True):
        return Part("the cost curve, measured here before and read from the store", 0.0, "no time")
    return Part("the cost curve, measured on a busy machine before: read from the store, or measured again if the "
                "machine is quiet now, at most", seconds, source)


# ---------------------------------------------------------------------------- the forecasts

def capture(store: Store, model: str, plan, batch_size: int, held: bool = False) -> Forecast:
    """A capture of capture.size Estimate `plan` (None: unknown before the model loads) in batches of `batch_size`,
    after the model load (none when `held`)."""
    t = target(store, model)
    if plan is None or t is None:
        return Forecast("capture", None, None if plan is None else plan.total, [], NO_CONFIG)
    x, source = pace(store, "capture", model, t)
    parts = load_parts(store, model, t, held) + [Part(
        f"{fmt.count(plan.conversations)} conversations, up to {fmt.count(plan.max_new_tokens)} answer tokens each",
        capture_rule(t, plan, batch_size) * x, source)]
    return Forecast("capture", sum(p.seconds for p in parts), plan.total, parts)


def online(store: Store, model: str, sets, options) -> Forecast:
    """Online training of `sets` with OnlineOptions `options`: the target's answers (when regenerated), then the
    training at the budget."""
    t = target(store, model)
    conversations = preflight.online_conversations(options, store)
    stored = preflight.online_bytes(store, t.shape if t else None, sets, options)[0]
    if t is None:
        return Forecast("online training", None, stored, [], NO_CONFIG)
    parts = load_parts(store, model, t)
    seconds = sum(p.seconds for p in parts)
    if options.responses == "regenerate":
        part = answers_part(store, model, t, options, conversations)
        seconds += part.seconds
        parts.append(part)
    s, label, source = training_time(store, t, model, sets, options, online=True)
    return Forecast("online training", seconds + s, stored, parts + [Part(label, s, source)])


def training(store: Store, model: str, layers, options) -> Forecast:
    """Training one draft for `layers` from a capture with TrainOptions `options` (its budget resolved)."""
    t = target(store, model)
    if t is None:
        return Forecast("training", None, None, [], NO_CONFIG)
    s, label, source = training_time(store, t, model, [layers], options, online=False)
    parts = load_parts(store, model, t) + [Part(label, s, source)]
    return Forecast("training", sum(p.seconds for p in parts),
                    draft_size.draft_bytes(t.shape, list(layers), int(options.draft_vocab),
                                            options.draft_intermediate), parts)


def training_time(store: Store, t: Target, model: str, sets, options, online: bool) -> tuple[float, str, str]:
    """(seconds, what, where the pace comes from) of training `sets` at the budget of `options`."""
    n = f"{len(sets)} draft{'s' if len(sets) != 1 else ''}"
    if options.time_s is not None:
        return float(options.time_s), f"training {n}", "its time budget"
    rows = training_rows(options, online)
    x, source = pace(store, "online" if online else "training", model, t)
    budget = (f"{fmt.count(options.tokens)} tokens" if options.tokens is not None else
              f"{fmt.count(options.steps)} steps (at most {fmt.count(rows)} tokens)")
    return rows * row_rule(t, sets, options, online) * x, f"training {n} on {budget}", source


def bench(store: Store, model: str, drafts: int, options, held: bool = False) -> Forecast:
    """A benchmark of `drafts` drafts with BenchOptions `options` on `model`: its every phase, the model load (none
    when `held`), the cost curve, the calibration for K = auto, and the decoding."""
    t = target(store, model)
    if t is None:
        return Forecast("benchmark", None, 0, [], NO_CONFIG)
    parts = load_parts(store, model, t, held)
    if drafts:
        parts.append(curve_part(store, model, t))
    if drafts and calibrates(options):
        x, source = pace(store, "calibration", model, t)
        parts.append(Part(f"the calibration for K = auto ({bench_mod.CALIBRATION_PROMPTS} prompts x up to "
                          f"{min(options.max_new_tokens, 64)} tokens per draft)",
                          generated_s(t, calibration_tokens(options, drafts)) * x, source))
    x, source = pace(store, "bench", model, t)
    tokens = bench_tokens(options, drafts)
    parts.append(Part(f"up to {fmt.count(tokens)} tokens decoded ({options.limit} prompts x "
                      f"{options.max_new_tokens} tokens x each decoder)", generated_s(t, tokens) * x, source))
    return Forecast("benchmark", sum(p.seconds for p in parts), 0, parts)


def answers_part(store: Store, model: str, t: Target, options, conversations: int) -> Part:
    """The target's answers that online training with OnlineOptions `options` still has to write: those of its
    draw of at most `conversations` that the store does not hold (responses.stored_draw)."""
    left, held = responses.stored_draw(store, model, options, conversations)
    x, source = pace(store, "answers", model, t)
    s = generated_s(t, left, options.max_new_tokens, options.gen_batch_size) * x if left else 0.0
    stored = f", {fmt.count(held)} stored" if held else ""
    return Part(f"the target's answers to {fmt.count(left)} conversations, up to {fmt.count(options.max_new_tokens)} "
                f"tokens each (written once{stored})", s, source if left else "the store holds them")


def study(store: Store, model: str, options, sets: int | None = None,
          left: tuple[int, int, int] | None = None) -> Forecast:
    """A study with StudyOptions `options` (its training budget resolved): `sets` layer sets when known (the app
    knows its plan), else as many as it may train (preflight.study_sets: an upper bound). `left` = (drafts still
    to train, their target passes, drafts read back from the outcomes folder) once the study has its plan: the
    estimate of what remains, training and benchmarks (the answers, written once, are then in hand or next)."""
    t = target(store, model)
    if t is None:
        return Forecast("study", None, None, [], NO_CONFIG)
    seeds = len(options.seeds) if options.seeds else 1
    if left is None:
        sizes = [options.k] * sets if sets is not None else preflight.study_sets(t.shape, options)
        drafts = sizes * seeds                   # one per (set, seed)
        stored, _ = preflight.study_bytes(store, t.shape, options, sizes)
        passes = seeds * math.ceil(len(sizes) / (options.sets_per_pass or len(sizes))) if options.online else 1
        what, read_back = "study", ""
    else:
        drafts, passes, done = [options.k] * left[0], left[1], left[2]
        stored, what, read_back = None, "study's training", f" ({done} read back from its outcomes folder)" if done else ""
    parts = load_parts(store, model, t) if left is None else []
    seconds = sum(p.seconds for p in parts)
    if options.online is not None:
        on = options.online
        if on.responses == "regenerate" and left is None:
            part = answers_part(store, model, t, on, preflight.online_conversations(on, store))
            seconds += part.seconds
            parts.append(part)
        if on.time_s is not None:
            s, source = passes * float(on.time_s), "its time budget"
        else:
            x, source = pace(store, "online", model, t)
            s = training_rows(on, online=True) * (passes * t.params * FORWARD_S
                                                  + sum(row_rule(t, [range(n)], on, online=False) for n in drafts)) * x
        label = f"{len(drafts)} drafts in {passes} target pass{'es' if passes != 1 else ''}"
    else:
        tr = options.train
        if tr.time_s is not None:
            s, source = len(drafts) * float(tr.time_s), "its time budget"
        else:
            x, source = pace(store, "training", model, t)
            s = training_rows(tr, online=False) * sum(row_rule(t, [range(n)], tr, online=False) for n in drafts) * x
        label = f"{len(drafts)} drafts"
    seconds += s
    # at most: a draft the store already holds (a pass stopped at its benchmark) is served from it, in no time
    parts.append(Part(f"training {label}{read_back}, at most (none for drafts the store holds)", s, source))
    if drafts:                                   # the benchmarks' cost curve: once, or read from the store
        curve = curve_part(store, model, t)
        parts.append(curve)
        seconds += curve.seconds
    b = options.bench_options()
    x, source = pace(store, "bench", model, t)
    s = generated_s(t, b.limit * b.max_new_tokens * (len(drafts) + passes)) * x if drafts else 0.0
    parts.append(Part(f"benchmarks of {options.limit} prompts x {options.max_new_tokens} tokens", s, source))
    return Forecast(what, seconds + s, stored, parts)
