"""Benchmark: drafts against each other and against the decoders a user has without LayerScope.

Every contender decodes the same prompts with the same `max_new_tokens`, greedily:

    autoregressive     specdec.autoregressive, one target forward per token: the speedup baseline
    <draft>            specdec.speculative with that draft (a chain of depth k, or a tree)
    hf-generate        transformers `generate`, greedy
    hf-prompt-lookup   transformers `generate` with `prompt_lookup_num_tokens`
    hf-assisted        transformers `generate` with a small model as `assistant_model` (`--assistant`: the classic
                       small-model draft; its tokenizer must be the target's, `check_assistant`)

Per contender: τ = tokens produced / target forwards (prefill included; 1 for plain decoding),
acceptance at each draft position (the share of verification steps whose i-th draft token was
accepted, so 1 + their sum ≈ τ), tokens/s, speedup = tokens/s over autoregressive's, and
`lossless` = every output equals autoregressive's token for token (`mismatched`: how many prompts' outputs do
not); transformers' own speculative peers (HF_PROPOSERS) are compared with transformers' plain `generate` of the
same run, their own baseline (`compared_with` names the one each entry is held to). In bfloat16 LayerScope's
decoders pad every target forward to aligned rows (specdec.row_alignment) and let each row attend alone
(exact_attention), so a difference is a bug there as in
float32; transformers' do not, and a near-tie can
flip between their verification and their one-token step: reported, never hidden (`row_align` in the report says
which rule held). All also per prompt category. A draft's
entry also has `spec_decode`: its acceptance histogram under vLLM's metric names (num_drafts,
num_draft_tokens, num_accepted_tokens, num_accepted_tokens_per_pos, mean_acceptance_length; Tally.spec_decode).
Prompts are the outer loop, so a change in machine load touches every contender alike.

Honest numbers: each entry also carries its per-prompt totals (`per_prompt`: tokens, forwards, seconds,
drafted, accepted) and 95% bootstrap intervals over the prompts (`intervals`, the study's statistics:
paired.compare_sets): `tau_ci`, `speedup_ci` (paired with plain decoding: the same resampled
prompts for both), `acceptance` and `acceptance_ci` (accepted / drafted tokens), and `paired`, the
difference to the reference contender (the first draft, else plain decoding) under the same resamples.

`run(...)` is a generator of `BenchProgress` (live stats for a progress bar or the app); the last
item carries the `BenchReport`. The set-up around it lives here once, for the CLI, the study and the
app alike: `fitting_prompts` (the seeded sample whose prompts fit, chat-encoded), `load_drafts`
(distinct contender names), `contenders_for` (the line-up a `BenchOptions` asks for),
`stop_tokens` (EOS and pad) and `measure` (run to the report, progress through a callback). With the cost
model (costmodel.py): `plan` (the line-up with `--k auto` / `--tree auto` / `--lookup auto` resolved by a
calibration, and the cost curve) and `annotate` (each contender's predicted speedup beside what it measured).

The machine: `measure` samples it just before the run (or waits for it to be quiet: `BenchOptions.machine`,
`--wait-quiet`) and watches it during the run (layerscope.quietness); the report carries `machine`, and the
table says "machine: busy — …; speeds are not trustworthy" when other processes took CPU while it timed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from transformers import GenerationConfig

from layerscope import eta, fmt, quietness
from layerscope.decoding import costmodel, specdec
from layerscope.decoding.specdec import LookupSpan, StepEvent, TreeSpec
from layerscope.draft.checkpoint import load_draft
from layerscope.errors import LayerScopeError
from layerscope.prompts.sets import PromptSet, chat_ids, load_fitting_prompts
from layerscope.quietness import MachineOptions
from layerscope.stats import bootstrap, paired
from layerscope.stats.paired import PromptRuns
from layerscope.validate import check_number

MAX_PROMPT_TOKENS = 1024    # longer prompts are left out of a benchmark by default (CLI, study, app)
HF_PROPOSERS = ("hf-prompt-lookup", "hf-assisted")   # transformers' speculative peers: checked against hf-generate


MAX_NEW_TOKENS = 2**20               # any --max-new-tokens or --max-prompt-tokens; the model's context decides below


@dataclass
class BenchOptions:
    """What a benchmark decodes and with which contenders: the one source of the bench defaults."""

    model: str | None = None         # target spec; None: the one the first draft was trained for, else smollm2-135m
    prompts: str = "sharegpt-heldout"
    split: str | None = None         # train | heldout (ShareGPT only); None: the prompt set's own
    limit: int = 20                  # prompts to run (a seeded sample)
    seed: int = 0
    max_new_tokens: int = 64
    max_prompt_tokens: int = MAX_PROMPT_TOKENS   # longer prompts are replaced by the next of the sample
    ks: tuple[int, ...] = (specdec.DEFAULT_K,)   # chain depths, each a contender per draft
    trees: tuple[TreeSpec, ...] = ()             # EAGLE-2 trees, each a contender per draft
    peers: bool = True               # HF generate and HF prompt lookup
    lookup_tokens: int = 10          # prompt_lookup_num_tokens of the HF peer
    assistant: str | None = None     # a model spec: also transformers' assisted generation with it (hf-assisted)
    draft_lookup: int | LookupSpan = 0   # > 0: also each draft's chain with prompt lookup first (specdec `lookup`;
                                         # a LookupSpan: adaptive); `parse_lookup` reads --lookup
    auto_k: bool = False             # also the chain depth with the best predicted speedup (`plan`)
    auto_tree: bool = False          # also the tree shape with the best predicted speedup
    auto_lookup: bool = False        # also each chain with the lookup span predicted best, if any pays (draft_lookup
                                     # is then unused)
    auto_even_if_slower: bool = False  # run auto's pick even when it is predicted to lose to plain decoding
    machine: MachineOptions = field(default_factory=MachineOptions)   # the quiet rule; wait_s: --wait-quiet

    def validate(self) -> None:
        """The machine's options, at least one chain depth (or --k auto); every number by layerscope.validate's
        one rule."""
        self.machine.validate()
        if not self.ks and not self.auto_k:
            raise LayerScopeError("no chain depth given", "Write it like --k 4 or --k 2,3,4")
        for k in self.ks:
            check_number("--k", k, minimum=1, integer=True, fix="Write it like --k 4 or --k 2,3,4")
        check_number("--max-new-tokens", self.max_new_tokens, minimum=1, maximum=MAX_NEW_TOKENS, integer=True)
        check_number("--max-prompt-tokens", self.max_prompt_tokens, minimum=1, maximum=MAX_NEW_TOKENS, integer=True)
        check_number("--limit", self.limit, minimum=1, integer=True, fix="Pass --limit 1 or more")
        check_number("--prompt-lookup", self.lookup_tokens, minimum=1, integer=True,
                     fix="Pass --prompt-lookup 1 or more (prompt_lookup_num_tokens of the HF peer; default 10)")
        specdec.lookup_span(self.draft_lookup, "--lookup")
        if self.auto_even_if_slower and not (self.auto_k or self.auto_tree):
            raise LayerScopeError("--auto-even-if-slower applies to --k auto and --tree auto, and neither is given",
                                  "Add --k auto or --tree auto, or leave --auto-even-if-slower out")


@dataclass(frozen=True)
class EncodedPrompt:
    id: str
    category: str
    input_ids: list[int]


@dataclass(frozen=True)
class Contender:
    name: str
    kind: str                        # "autoregressive" | "draft" | "hf-generate" | "hf-prompt-lookup" | "hf-assisted"
                                     # ("declined":
                                     # a marker auto_contenders leaves for lookup_declined, never decoded)
    decoding: str                    # e.g. "chain k=4", "tree budget=16 top_k=4 depth=5", "greedy"
    draft: object = None             # DraftHead for kind "draft"; the assistant model for "hf-assisted"
    k: int = specdec.DEFAULT_K
    tree: TreeSpec | None = None
    lookup_tokens: int | LookupSpan = 0   # HF prompt lookup: prompt_lookup_num_tokens; a draft: specdec's `lookup`
    auto: dict | None = None         # an `auto` contender: costmodel.Prediction.to_json() of its choice
    lookup_auto: dict | None = None  # `--lookup auto`'s choice (costmodel.LookupChoice.to_json()): on the chain with
                                     # the chosen lookup, or on the chain alone when no lookup was predicted to pay


@dataclass
class Tally:
    """Running totals of one contender (over all prompts, or one category)."""

    tokens: int = 0
    forwards: int = 0
    seconds: float = 0.0
    drafted_at: list[int] = field(default_factory=list)     # per draft position: verification steps that drafted it
    accepted_at: list[int] = field(default_factory=list)    # per draft position: ... that accepted it
    lossless: bool = True
    mismatched: int = 0              # prompts (runs) whose output differs from plain decoding's
    drafted: int = 0                 # draft tokens verified (a tree: its nodes), over all steps
    accepted: int = 0                # ... of those accepted
    lookup_steps: int = 0            # steps whose tokens prompt lookup proposed (counted in drafted/accepted,
    lookup_drafted: int = 0          # not in drafted_at/accepted_at, which stay the draft's own)
    lookup_accepted: int = 0
    lookup_sizes: dict[int, int] = field(default_factory=dict)     # {tokens a lookup step proposed: steps}

    def add_event(self, e: StepEvent) -> None:
        self.tokens += len(e.tokens)
        self.forwards += 1
        self.seconds += e.elapsed_s
        self.drafted += e.drafted
        self.accepted += e.accepted
        if e.proposer == "lookup":
            self.lookup_steps += 1
            self.lookup_drafted += e.drafted
            self.lookup_accepted += e.accepted
            self.lookup_sizes[e.drafted] = self.lookup_sizes.get(e.drafted, 0) + 1
            return
        for i, ok in enumerate(e.accepted_mask):
            if i == len(self.drafted_at):
                self.drafted_at.append(0), self.accepted_at.append(0)
            self.drafted_at[i] += 1
            self.accepted_at[i] += bool(ok)

    def add_run(self, tokens: int, forwards: int, seconds: float) -> None:
        """A whole decode seen from outside (an HF peer): no per-step acceptance."""
        self.tokens, self.forwards, self.seconds = self.tokens + tokens, self.forwards + forwards, self.seconds + seconds

    @property
    def tau(self) -> float | None:
        return self.tokens / self.forwards if self.forwards else None

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.seconds if self.seconds > 0 else None

    def acceptance_by_position(self) -> list[float]:
        return [a / d for a, d in zip(self.accepted_at, self.drafted_at)]

    def spec_decode(self) -> dict:
        """The acceptance histogram under the names of vLLM's spec-decode metrics, over the draft's own steps
        (prompt lookup's steps are in `lookup`): num_drafts (verification steps that drafted at least one
        token), num_draft_tokens (tokens drafted; a tree: its nodes), num_accepted_tokens, and
        num_accepted_tokens_per_pos[i] (steps whose draft token at position i+1 was accepted: a histogram of
        accepted lengths read cumulatively). mean_acceptance_length = 1 + num_accepted_tokens / num_drafts,
        vLLM's, bonus token included; τ also counts the prefill and any step that drafted nothing."""
        drafts, accepted = (self.drafted_at[0] if self.drafted_at else 0), self.accepted - self.lookup_accepted
        return {"num_drafts": drafts, "num_draft_tokens": self.drafted - self.lookup_drafted,
                "num_accepted_tokens": accepted, "num_accepted_tokens_per_pos": list(self.accepted_at),
                "mean_acceptance_length": 1 + accepted / drafts if drafts else None}


@dataclass
class BenchReport:
    prompts: int
    max_new_tokens: int
    device: str
    results: list[dict]              # one JSON entry per contender, see `_entry` (and `annotate`)
    cost_curve: list[dict] | None = None       # [{tokens, seconds}] the predictions used (`annotate`)
    draft_step_seconds: float | None = None
    intervals: dict | None = None    # how the entries' intervals were made: level, draws, over, reference
    machine: dict | None = None      # MachineState.to_json() while it decoded (`measure`; `run` alone: None)
    cost_curve_machine: dict | None = None     # ... while the cost curve was measured
    dtype: str = ""                  # the target's dtype (float32, bfloat16) and why (precision.Choice.why)
    dtype_why: str = ""
    row_align: int = 0               # specdec.row_alignment of the target: the rows bf16 forwards were padded to at
                                     # least, each row attending alone (measured: 1-16); 0 where neither held

    def to_json(self) -> dict:
        out = {"prompts": self.prompts, "max_new_tokens": self.max_new_tokens, "device": self.device,
               "results": self.results}
        if self.dtype:
            out |= {"dtype": self.dtype, "dtype_why": self.dtype_why, "row_align": self.row_align}
        if self.intervals is not None:
            out["intervals"] = self.intervals
        if self.machine is not None:
            out["machine"] = self.machine
        if self.cost_curve is not None:
            out |= {"cost_curve": self.cost_curve, "draft_step_seconds": self.draft_step_seconds,
                    "cost_curve_machine": self.cost_curve_machine}
        return out


@dataclass(frozen=True)
class BenchProgress:
    """One live update: after every step of our decoders, after every prompt of the HF peers; before the
    decoding, the other phases say what they do in `message` (calibrate: prompt_index/prompts_total and
    runs_done/runs_total count calibration prompts; wait and cost curve: no counts)."""

    contender: str
    prompt_index: int                # 0-based index of the prompt being decoded
    prompts_total: int
    runs_done: int                   # (prompt, contender) runs finished so far
    runs_total: int
    tau: float | None                # running τ of this contender over all its steps so far
    tokens_per_s: float | None       # running tokens/s of this contender
    event: StepEvent | None          # the latest step; None for HF peers and the final item
    report: BenchReport | None = None   # set on the last item only
    phase: str = "decode"            # "wait" (for a quiet machine) | "cost curve" | "calibrate" | "decode"
    message: str = ""                # a phase other than decode, in words
    eta_s: float | None = None       # seconds left of this phase (layerscope.eta; cost curve: its timed forwards,
                                     # calibrate: its prompts, decode: its token budget, max_new_tokens per run); None:
                                     # estimating, or a wait


def encode(tokenizer, prompt_set) -> list[EncodedPrompt]:
    """Chat-templated ids of each prompt (length caps are applied when loading: prompts.load_fitting_prompts)."""
    return [EncodedPrompt(p.id, p.category, chat_ids(tokenizer, p)) for p in prompt_set.prompts]


def build_contenders(drafts: Sequence[tuple[str, object]], *, ks: Sequence[int] = (specdec.DEFAULT_K,),
               trees: Sequence[TreeSpec] = (), peers: bool = True, lookup_tokens: int = 10,
               draft_lookup: int | LookupSpan = 0, assistant=None) -> list[Contender]:
    """autoregressive, each draft under each decoding (with `draft_lookup`, each chain and tree also with prompt
    lookup first), then the HF peers (with `assistant`, a LoadedModel, also hf-assisted)."""
    out = [Contender("autoregressive", "autoregressive", "greedy")]
    decodings = [(draft_label(k), k, None, 0) for k in ks] + \
                [(draft_label(specdec.DEFAULT_K, t), specdec.DEFAULT_K, t, 0) for t in trees]
    if draft_lookup:
        decodings += [(hybrid_label(k, draft_lookup), k, None, draft_lookup) for k in ks] + \
                     [(hybrid_label(specdec.DEFAULT_K, draft_lookup, t), specdec.DEFAULT_K, t, draft_lookup)
                      for t in trees]
    for name, draft in drafts:
        for label, k, tree, lookup in decodings:
            out.append(Contender(name if len(decodings) == 1 else f"{name} {label}", "draft", label, draft, k, tree,
                                 lookup_tokens=lookup))
    if peers:
        out.append(Contender("hf-generate", "hf-generate", "greedy"))
        out.append(Contender("hf-prompt-lookup", "hf-prompt-lookup", f"prompt lookup n={lookup_tokens}",
                             lookup_tokens=lookup_tokens))
    if assistant is not None:
        out.append(Contender("hf-assisted", "hf-assisted", f"assistant {assistant.spec}", assistant.model))
    return out


def hybrid_label(k: int, lookup: int | LookupSpan, tree: TreeSpec | None = None) -> str:
    """The decoding of a draft's chain, or `tree`, with prompt lookup first: "chain k=1 + lookup 4" (adaptive:
    "lookup 4..16"), "tree budget=12 top_k=3 depth=4 + lookup 4"."""
    span = lookup if isinstance(lookup, LookupSpan) else LookupSpan.fixed(lookup)
    return f"{draft_label(k, tree)} + {span.label}"


def draft_label(k: int, tree: TreeSpec | None = None) -> str:
    """"chain k=4", or the tree's "tree budget=12 top_k=3 depth=4"."""
    return costmodel.tree_label(tree) if tree is not None else f"chain k={k}"


LOOKUP_FIX = "Write it like --lookup 4 (a fixed span), --lookup 4..16 (adaptive: 4 tokens, up to 16) or --lookup auto"


def parse_lookup(text) -> tuple[int | LookupSpan, bool]:
    """--lookup's value -> (BenchOptions.draft_lookup, auto_lookup): '4' -> (4, False), '4..16' -> (LookupSpan(4, 16),
    False), 'auto' -> (0, True), '0' -> off; one line for anything else."""
    value = str(text).strip()
    if value == "auto":
        return 0, True
    start, dots, cap = value.partition("..")
    try:
        span = LookupSpan(int(start), int(cap)) if dots else int(value)
    except ValueError:
        raise LayerScopeError(f"--lookup {text!r} is not a span, a range of spans or auto", LOOKUP_FIX) from None
    if dots and span.start < 1:
        raise LayerScopeError(f"--lookup {text!r} starts below 1 token", LOOKUP_FIX)
    specdec.lookup_span(span, "--lookup")
    return span, False


def fitting_prompts(tokenizer, o: BenchOptions, cache: Path | None = None) -> tuple[PromptSet, list[EncodedPrompt]]:
    """The options' seeded sample of prompts that fit in `o.max_prompt_tokens`, and their encodings
    (`cache`: the store's prompts/ folder, where the ShareGPT index is kept)."""
    prompt_set = load_fitting_prompts(o.prompts, tokenizer, limit=o.limit, seed=o.seed, max_tokens=o.max_prompt_tokens,
                                      cache=cache, **({"split": o.split} if o.split else {}))
    return prompt_set, encode(tokenizer, prompt_set)


def unique_names(names: Sequence[str], heads: Sequence) -> list[str]:
    """Contender names for drafts: each as given; a name given twice gets the draft's layers, and a pair
    still alike (same name, same layers) gets its position: "low", "d [1, 2]", "d [1, 2]#3"."""
    names = [n if names.count(n) == 1 else f"{n} {list(h.aux_layers)}" for n, h in zip(names, heads)]
    return [f"{n}#{i + 1}" if names.count(n) > 1 else n for i, n in enumerate(names)]


def folder_names(paths: Sequence) -> list[str]:
    """Names for draft directories: their folder names."""
    return [Path(p).resolve().name or "draft" for p in paths]


def load_drafts(target, named: Sequence[tuple[str, object]]) -> list[tuple[str, object]]:
    """(name, path) pairs -> (unique contender name, DraftHead checked against `target`, on its device, in its dtype:
    specdec.decoding_draft)."""
    heads = [specdec.decoding_draft(load_draft(path, target), target) for _, path in named]
    return list(zip(unique_names([n for n, _ in named], heads), heads))


def contenders_for(drafts: Sequence[tuple[str, object]], o: BenchOptions, assistant=None) -> list[Contender]:
    """The line-up `o` asks for: autoregressive, each draft under each of o.ks and o.trees (and with
    o.draft_lookup each chain with prompt lookup first, unless o.auto_k: then only the automatic chain gets
    it, auto_contenders; o.auto_lookup: auto_contenders adds them), the HF peers, hf-assisted with `assistant`
    (o.assistant loaded)."""
    return build_contenders(drafts, ks=o.ks, trees=o.trees, peers=o.peers, lookup_tokens=o.lookup_tokens,
                            draft_lookup=0 if o.auto_k or o.auto_lookup else o.draft_lookup, assistant=assistant)


def stop_tokens(target) -> tuple[object, int | None]:
    """(eos, pad) for decoding `target`: EOS from its generation config, else its tokenizer's (an id or a
    list of ids); pad from the tokenizer, else the EOS id when there is a single one."""
    eos = target.model.generation_config.eos_token_id
    eos = eos if eos is not None else target.tokenizer.eos_token_id
    pad = target.tokenizer.pad_token_id
    return eos, pad if pad is not None else (eos if isinstance(eos, int) else None)


# ----------------------------------------------------------------------------- planning: the cost model's part

CALIBRATION_PROMPTS = 8              # prompts of a calibration run, a seed apart from the benchmark's own sample


def plan(target, drafts: Sequence[tuple[str, object]], options: BenchOptions, store,
         progress: Callable[[BenchProgress], None] | None = None,
         assistant=None, timings: dict | None = None) -> tuple[list[Contender], costmodel.CostCurve | None]:
    """The benchmark's line-up with its `auto` contenders resolved, and the cost curve its predictions use
    (measured once per machine, model and draft shape, then read from the store: costmodel.cost_curve; None
    without drafts). `progress` hears the curve's measurement (phase "cost curve") and the calibration
    ("calibrate"), each with its time left. `assistant`: options.assistant loaded (hf-assisted). `timings`, when
    given, gets each phase's seconds as it ran: "cost curve" (and "cost curve quiet") when the curve was measured,
    "calibration" with its "calibration prompts" when --k/--tree/--lookup auto calibrated (forecast.bench_measured
    makes them the next estimate's paces)."""
    contenders = contenders_for(drafts, options, assistant)
    if not drafts:
        return contenders, None
    timings = timings if timings is not None else {}

    def say(message, eta_s=None):
        if progress is not None:
            progress(BenchProgress("", 0, 0, 0, 0, None, None, None, phase="cost curve", message=message, eta_s=eta_s))

    def measured(seconds, quiet):
        timings.update({"cost curve": seconds, "cost curve quiet": quiet})

    curve = costmodel.cost_curve(target, store, drafts[0][1], machine_options=options.machine, progress=say,
                                 measured=measured)
    if options.auto_k or options.auto_tree or options.auto_lookup:
        t0 = time.monotonic()
        cal = replace(options, seed=options.seed + 1, limit=CALIBRATION_PROMPTS)
        _, prompts = fitting_prompts(target.tokenizer, cal, cache=store.root / "prompts")
        contenders = lookup_declined(lineup(contenders, auto_contenders(
            target, drafts, options, curve, [p.input_ids for p in prompts], progress)))
        timings.update({"calibration": time.monotonic() - t0, "calibration prompts": len(prompts)})
    return contenders, curve


def auto_contenders(target, drafts: Sequence[tuple[str, object]], options: BenchOptions, curve: costmodel.CostCurve,
                    calibration: Sequence[Sequence[int]],
                    progress: Callable[[BenchProgress], None] | None = None,
                    clock: Callable[[], float] = time.monotonic) -> list[Contender]:
    """For `bench --k auto` / `--tree auto` / `--lookup auto`: per draft, the chain depth and the tree with the best
    speedup predicted from `curve` and the draft's acceptance on the `calibration` prompts (token id lists), and for
    each chain (o.ks and the automatic one) and the automatic tree the prompt lookup span predicted best
    (costmodel.choose_lookup) when one beats the draft alone; where none does, a marker of kind "declined" carries
    the choice to that chain or tree (`lookup_declined` moves it there); a BenchProgress of phase "calibrate" to `progress` after each prompt of
    each draft, with the time left at the rate of the calibration's prompts (`clock`: its seconds)."""
    if not (options.auto_k or options.auto_tree or options.auto_lookup) or not drafts:
        return []
    eos, _ = stop_tokens(target)
    out, total = [], len(drafts) * len(calibration)
    timer = eta.PhaseClock(total, clock=clock)
    for d, (name, head) in enumerate(drafts):
        def seen(done, n, name=name, d=d):
            if progress is not None:
                progress(BenchProgress(name, done - 1, n, d * n + done, total, None, None, None, phase="calibrate",
                                       message=f"calibration for --k auto: {name}, prompt {done}/{n}",
                                       eta_s=timer.left(d * n + done)))
        profile = costmodel.calibrate(target.model, head, calibration, max_new_tokens=min(options.max_new_tokens, 64),
                                      eos_token_id=eos, progress=seen)
        chain = costmodel.best_chain(curve, profile) if options.auto_k else None
        tree = costmodel.best_tree(curve, profile) if options.auto_tree else None
        picks = [p for p in (chain, tree) if p]
        if picks and not options.auto_even_if_slower and max(p.speedup for p in picks) < 1.0:
            best = max(picks, key=lambda p: p.speedup)       # nothing pays: auto says so and decodes plainly
            out.append(Contender(f"{name} auto plain", "autoregressive", "auto: plain decoding", None,
                                 auto=best.to_json() | {"declined": True}))
            chain = tree = None
        else:
            for p in picks:
                out.append(Contender(f"{name} auto {p.decoding}", "draft", f"auto: {p.decoding}", head,
                                     p.k or specdec.DEFAULT_K, p.tree, auto=p.to_json()))
        # each chain (o.ks, the automatic one) and the automatic tree with prompt lookup first: the span predicted
        # best, if one pays (--lookup auto), else o.draft_lookup's on the automatic ones
        hybrids = []
        if options.auto_lookup:
            hybrids += [(k, None) for k in dict.fromkeys(list(options.ks) + ([chain.k] if chain else []))]
        elif chain and options.draft_lookup:
            hybrids.append((chain.k, None))
        if tree and (options.auto_lookup or options.draft_lookup):
            hybrids.append((specdec.DEFAULT_K, tree.tree))
        for k, shape in hybrids:
            choice = costmodel.choose_lookup(curve, profile, k, tree=shape) if options.auto_lookup else None
            if choice is not None and choice.chosen is None:
                out.append(Contender(f"{name} {draft_label(k, shape)} declined lookup",
                                     "declined", "", head, k, shape, lookup_auto=choice.to_json()))
                continue
            span = choice.chosen if choice is not None else options.draft_lookup
            label = hybrid_label(k, span, shape)
            out.append(Contender(f"{name} auto {label}", "draft", f"auto: {label}", head, k, shape,
                                 lookup_tokens=span, lookup_auto=choice.to_json() if choice is not None else None))
    return out


def lookup_declined(contenders: Sequence[Contender]) -> list[Contender]:
    """The line-up without auto_contenders' "declined" markers, each one's choice moved to the first chain (or
    tree) of its draft and shape that decodes without lookup (its row then says why no lookup runs)."""
    out = [c for c in contenders if c.kind != "declined"]
    for mark in (c for c in contenders if c.kind == "declined"):
        i = next(i for i, c in enumerate(out) if c.kind == "draft" and c.draft is mark.draft and c.tree == mark.tree
                 and c.k == mark.k and not c.lookup_tokens and c.lookup_auto is None)
        out[i] = replace(out[i], lookup_auto=mark.lookup_auto)
    return out


def lineup(contenders: Sequence[Contender], auto: Sequence[Contender]) -> list[Contender]:
    """The automatic contenders placed after the last draft contender (before the HF peers)."""
    cut = max((i + 1 for i, c in enumerate(contenders) if c.kind in ("draft", "autoregressive")), default=0)
    return list(contenders[:cut]) + list(auto) + list(contenders[cut:])


def annotate(report: BenchReport, contenders: Sequence[Contender], curve: costmodel.CostCurve | None) -> None:
    """Add the cost model's view to a benchmark report: `cost_curve`, and per contender `predicted_speedup`
    (from the curve and the tau the contender measured: the model of cost checked on every run), plus for
    `auto` contenders the `chosen` decoding and what the calibration predicted for it, and for chains `--lookup auto`
    chose for, or declined for, its choice (`lookup_auto`)."""
    if curve is None:
        return
    report.cost_curve = curve.to_json()["cost_curve"]
    report.draft_step_seconds = curve.draft_s(1)
    report.cost_curve_machine = curve.machine.to_json() if curve.machine is not None else None
    for c, entry in zip(contenders, report.results):
        if c.lookup_auto is not None:
            entry["lookup_auto"] = c.lookup_auto
        if c.kind == "autoregressive":
            entry["predicted_speedup"] = 1.0
            if c.auto is not None:                          # auto declined: nothing was predicted to pay
                entry["chosen"] = {"plain": True}
                entry["calibrated"] = {"decoding": c.auto["decoding"], "tau": c.auto["tau"],
                                       "speedup": c.auto["speedup"], "break_even_tau": c.auto["break_even_tau"]}
        elif c.kind == "draft" and c.lookup_tokens:      # from the spans its lookup steps verified, and its draft's
            entry["predicted_speedup"] = _lookup_predicted(curve, c.k, entry, c.tree)  # steps (`lookup_auto` has the
                                                                                   # calibration's where auto chose it)
        elif c.kind == "draft":
            k, tree = (None, c.tree) if c.tree is not None else (c.k, None)
            tau = 1.0 + sum(entry["acceptance_by_position"])              # per verification step
            entry["predicted_speedup"] = tau * curve.target_s(1) / costmodel.step_seconds(curve, k=k, tree=tree, tau=tau)
            entry |= break_even_entry(curve, k, tree, entry)
            entry["verdict"] = verdict(entry["tau"], entry["break_even_tau"], c.decoding, entry.get("speedup"),
                                       predicted=entry["curve_break_even_tau"], draft=entry.get("draft_step_share"))
            if c.auto is not None:
                entry["chosen"] = {"k": k} if tree is None else {"tree": asdict(tree)}
                entry["calibrated"] = {"tau": c.auto["tau"], "speedup": c.auto["speedup"]}
        else:
            entry["predicted_speedup"] = None


def break_even_entry(curve: costmodel.CostCurve, k: int | None, tree: TreeSpec | None, entry: dict) -> dict:
    """A draft entry's break-even, one rule (costmodel.break_even_tau) with the draft step this run measured
    (costmodel.run_draft_step, when it has a measured speedup): `break_even_tau`, `curve_break_even_tau` (the cost
    curve's alone), `draft_step_seconds` (measured) and `draft_step_share` ([the curve's, this run's] draft forward
    as a share of a one-token target forward), `verified_tokens` (what the cost chart places the step at)."""
    out = {"curve_break_even_tau": costmodel.break_even_tau(curve, k=k, tree=tree),
           "verified_tokens": costmodel.verified_tokens(k=k, tree=tree)}
    out["break_even_tau"] = out["curve_break_even_tau"]
    if entry.get("tau") and entry.get("speedup"):
        step = costmodel.run_draft_step(curve, k=k, tree=tree, tau=entry["tau"], speedup=entry["speedup"])
        out |= {"break_even_tau": costmodel.break_even_tau(costmodel.with_draft_step(curve, step), k=k, tree=tree),
                "draft_step_seconds": step,
                "draft_step_share": [curve.draft_s(1) / curve.target_s(1), step / curve.target_s(1)]}
    return out


def _lookup_predicted(curve: costmodel.CostCurve, k: int, entry: dict, tree: TreeSpec | None = None) -> float | None:
    """costmodel.lookup_run_speedup of a chain- (or tree-) with-lookup entry: its lookup steps by size, and its draft
    steps with the tokens they made (1 + the draft's accepted tokens each, from its per-position acceptance)."""
    look = entry.get("lookup") or {}
    sizes = {int(n): int(c) for n, c in (look.get("sizes") or {}).items()}
    draft_steps = int(look.get("draft_steps") or 0)
    per_step = 1.0 + sum(entry.get("acceptance_by_position") or [])
    return costmodel.lookup_run_speedup(curve, k, lookup_sizes=sizes,
                                        lookup_tokens=int(look.get("accepted") or 0) + sum(sizes.values()),
                                        draft_steps=draft_steps, draft_tokens=round(draft_steps * per_step),
                                        tree=tree)


def wait_quiet(options: MachineOptions, progress: Callable[[BenchProgress], None] | None = None):
    """machine.settle with its wait reported as BenchProgress of phase "wait"; returns the MachineState."""
    def seen(state, left):
        if progress is not None:
            progress(BenchProgress("", 0, 0, 0, 0, None, None, None, phase="wait",
                                   message=quietness.wait_message(state, left)))
    return quietness.settle(options, seen)


def measure(target, prompts: Sequence[EncodedPrompt], contenders: Sequence[Contender], max_new_tokens: int,
            progress: Callable[[BenchProgress], None] | None = None, warmup: bool = True,
            machine_options: MachineOptions | None = None, clock: Callable[[], float] = time.monotonic) -> BenchReport:
    """`run` to the end with `target`'s stop tokens: every live BenchProgress to `progress`, the report
    returned with `machine`: sampled (or waited for: machine_options.wait_s) before, watched during."""
    options = machine_options or MachineOptions()
    eos, pad = stop_tokens(target)
    before = wait_quiet(options, progress)
    with quietness.Monitor(options, before) as watched:
        for p in run(target.model, prompts, contenders, max_new_tokens=max_new_tokens, eos_token_id=eos,
                     pad_token_id=pad, warmup=warmup, clock=clock):
            if p.report is not None:
                report = p.report
                break
            if progress is not None:
                progress(p)
        else:
            raise AssertionError("bench.run ended without a report")
    report.machine = watched.state.to_json()
    report.dtype, report.dtype_why = str(target.dtype).replace("torch.", ""), getattr(target, "dtype_why", "")
    report.row_align = specdec.row_alignment(target.model)
    return report


def run(model, prompts: Sequence[EncodedPrompt], contenders: Sequence[Contender], *, max_new_tokens: int = 64,
        eos_token_id=None, pad_token_id: int | None = None, warmup: bool = True,
        clock: Callable[[], float] = time.monotonic) -> Iterator[BenchProgress]:
    """Decode every prompt with every contender; yields BenchProgress, the last one with the report. The time
    left (`eta_s`) is the decoding's own rate through its token budget: max_new_tokens per (prompt, contender) run,
    counted in full when a run ends sooner (layerscope.eta; `clock`: its seconds, from the end of the warm-up)."""
    names = [c.name for c in contenders]
    if len(set(names)) != len(names) or names[0] != "autoregressive":
        raise ValueError(f"contender names must be unique and start with autoregressive: {names}")
    if warmup and prompts:                                  # first calls pay one-time costs; not timed
        for c in contenders:
            for _ in _decode(model, c, prompts[0].input_ids, min(4, max_new_tokens), eos_token_id, pad_token_id):
                pass
    total = {c.name: Tally() for c in contenders}
    per_prompt = {c.name: [Tally() for _ in prompts] for c in contenders}
    by_cat: dict[str, dict[str, Tally]] = {}
    done, runs_total = 0, len(prompts) * len(contenders)
    timer = eta.PhaseClock(runs_total * max_new_tokens, clock=clock)
    for i, prompt in enumerate(prompts):
        cat = by_cat.setdefault(prompt.category, {c.name: Tally() for c in contenders})
        reference = hf_reference = None
        for c in contenders:
            tallies, out = (total[c.name], cat[c.name], per_prompt[c.name][i]), []
            for item in _decode(model, c, prompt.input_ids, max_new_tokens, eos_token_id, pad_token_id):
                if isinstance(item, StepEvent):
                    out += item.tokens
                    for t in tallies:
                        t.add_event(item)
                    yield BenchProgress(c.name, i, len(prompts), done, runs_total, total[c.name].tau,
                                        total[c.name].tokens_per_s, item,
                                        eta_s=timer.left(done * max_new_tokens + min(len(out), max_new_tokens)))
                else:                                       # an HF run: (tokens, forwards, seconds)
                    tokens, forwards, seconds = item
                    out = tokens
                    for t in tallies:
                        t.add_run(len(tokens), forwards, seconds)
            if c.kind == "hf-generate":
                hf_reference = out
            if reference is None:
                reference = out
            elif out != (hf_reference if c.kind in HF_PROPOSERS and hf_reference is not None else reference):
                for t in tallies:
                    t.lossless = False
                    t.mismatched += 1
            done += 1
            yield BenchProgress(c.name, i, len(prompts), done, runs_total, total[c.name].tau,
                                total[c.name].tokens_per_s, None, eta_s=timer.left(done * max_new_tokens))
    results = []
    has_hf = any(c.kind == "hf-generate" for c in contenders)
    for c in contenders:
        entry = _entry(c, total[c.name], total["autoregressive"])
        entry["compared_with"] = "hf-generate" if c.kind in HF_PROPOSERS and has_hf else contenders[0].name
        entry["by_category"] = {name: _entry(c, t[c.name], t["autoregressive"], short=True)
                                for name, t in sorted(by_cat.items())}
        entry["per_prompt"] = per_prompt_totals(per_prompt[c.name])
        results.append(entry)
    reference = next((c.name for c in contenders if c.kind == "draft"), "autoregressive")
    report = BenchReport(len(prompts), max_new_tokens, str(model.device), results,
                         intervals=add_intervals(results, reference))
    yield BenchProgress("", len(prompts) - 1, len(prompts), done, runs_total, None, None, None, report)


def per_prompt_totals(tallies: Sequence[Tally]) -> dict[str, list]:
    """One contender's totals per prompt (lists of length P): tokens, forwards, seconds, drafted, accepted."""
    return {"tokens": [t.tokens for t in tallies], "forwards": [t.forwards for t in tallies],
            "seconds": [t.seconds for t in tallies], "drafted": [t.drafted for t in tallies],
            "accepted": [t.accepted for t in tallies]}


def prompt_runs(entry: dict, baseline: dict) -> PromptRuns:
    """paired.PromptRuns of a bench entry with per-prompt totals, against `baseline`'s (plain decoding)."""
    p, b = entry["per_prompt"], baseline["per_prompt"]
    return PromptRuns(tokens=list(p["tokens"]), forwards=list(p["forwards"]), seconds=list(p["seconds"]),
                      drafted=list(p["drafted"]), accepted=list(p["accepted"]), base_tokens=list(b["tokens"]),
                      base_seconds=list(b["seconds"]))


def add_intervals(results: list[dict], reference: str = "autoregressive", *, draws: int = bootstrap.DRAWS,
                  level: float = bootstrap.LEVEL, seed: int = 0) -> dict | None:
    """Bootstrap intervals over the prompts for the entries of one run (each with `per_prompt`, the same
    prompts): adds to every entry `tau_ci`, `speedup_ci`, `acceptance`, `acceptance_ci` ([lo, hi], None
    where undefined) and, for every contender but `reference` and plain decoding, `paired`: {"vs":
    reference, tau|speedup|acceptance: {"delta", "ci"}}. The statistics are paired.compare_sets':
    ratios of sums, one set of resampled prompts for every contender, so speedups and differences are
    paired. Returns what `BenchReport.intervals` records, or None (and adds nothing) with fewer than 2
    prompts, where a resample can only repeat the one prompt."""
    names = [r["name"] for r in results]
    if "autoregressive" not in names or any("per_prompt" not in r for r in results):
        return None
    base = results[names.index("autoregressive")]
    prompts = len(base["per_prompt"]["tokens"])
    if prompts < 2:
        return None
    ref = names.index(reference) if reference in names else names.index("autoregressive")
    rows, _ = paired.compare_sets([[prompt_runs(r, base)] for r in results], ref, draws=draws, level=level,
                                       seed=seed)
    for entry, row in zip(results, rows):
        entry |= {"tau_ci": row["tau_ci"], "speedup_ci": row["speedup_ci"], "acceptance": row["acceptance"],
                  "acceptance_ci": row["acceptance_ci"]}
        if entry is not results[ref] and entry is not base:
            entry["paired"] = {"vs": names[ref], **row["paired"]}
    return {"level": level, "draws": draws, "over": "prompts", "prompts": prompts, "reference": names[ref]}


def _entry(c: Contender, t: Tally, baseline: Tally, short: bool = False) -> dict:
    tps, base = t.tokens_per_s, baseline.tokens_per_s
    entry = {"name": c.name}
    if c.kind == "draft" and not short:
        entry["layers"] = list(c.draft.aux_layers)
        entry["decoding"] = c.decoding
    entry |= {"tau": t.tau, "acceptance_by_position": t.acceptance_by_position(), "tokens_per_s": tps,
              "speedup": tps / base if tps and base else None, "lossless": t.lossless, "mismatched": t.mismatched}
    if c.kind == "draft" and not short:
        entry["spec_decode"] = t.spec_decode()
    if c.kind == "draft" and c.lookup_tokens:
        entry["lookup"] = {"steps": t.lookup_steps, "draft_steps": t.drafted_at[0] if t.drafted_at else 0,
                           "drafted": t.lookup_drafted, "accepted": t.lookup_accepted,
                           "sizes": {str(n): c for n, c in sorted(t.lookup_sizes.items())}}
    if short:
        del entry["name"]
    return entry


def _decode(model, c: Contender, ids: list[int], max_new_tokens: int, eos_token_id, pad_token_id):
    """Our decoders yield StepEvents; an HF peer yields one (tokens, target forwards, seconds)."""
    if c.kind == "autoregressive":
        yield from specdec.autoregressive(model, ids, max_new_tokens, eos_token_id=eos_token_id)
    elif c.kind == "draft":
        yield from specdec.speculative(model, c.draft, ids, max_new_tokens, k=c.k, tree=c.tree,
                                       lookup=c.lookup_tokens, eos_token_id=eos_token_id)
    else:
        yield _hf_generate(model, ids, max_new_tokens, eos_token_id, pad_token_id, c.lookup_tokens,
                           assistant=c.draft if c.kind == "hf-assisted" else None)


def _hf_generate(model, ids, max_new_tokens, eos_token_id, pad_token_id, lookup_tokens: int, assistant=None):
    """transformers generate, plain greedy (with prompt lookup when lookup_tokens > 0; with `assistant` as its
    assistant_model when given), counting the target's forwards (the assistant's are its own module's: not counted).

    generate fills unset options from `model.generation_config` (a repetition penalty, say), so that
    config is swapped for a bare one for the call, and the assistant's too: the peer decodes exactly greedily,
    like ours (the assistant keeps transformers' defaults for how many tokens it drafts: 20, then its heuristic).
    """
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                              eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                              prompt_lookup_num_tokens=lookup_tokens or None)
    x = torch.tensor([ids], device=model.device)
    forwards = []
    hook = model.register_forward_hook(lambda *_: forwards.append(1))
    saved, model.generation_config = model.generation_config, GenerationConfig()
    if assistant is not None:
        saved_assistant, assistant.generation_config = assistant.generation_config, GenerationConfig()
    try:
        quietness.sync(model.device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(x, attention_mask=torch.ones_like(x), generation_config=config,
                                 **({"assistant_model": assistant} if assistant is not None else {}))
        quietness.sync(model.device)
        seconds = time.perf_counter() - t0
    finally:
        model.generation_config = saved
        if assistant is not None:
            assistant.generation_config = saved_assistant
        hook.remove()
    return out[0, len(ids):].tolist(), len(forwards), seconds


def check_assistant(target, assistant) -> None:
    """An assistant model drafts in token ids, so its tokenizer must be the target's (the same vocabulary, ids and
    special tokens; one LayerScopeError line otherwise, before anything is decoded)."""
    tv, av = target.tokenizer.get_vocab(), assistant.tokenizer.get_vocab()
    if tv != av:
        differ = len(set(tv.items()) ^ set(av.items()))
        raise LayerScopeError(f"--assistant {assistant.spec} has another tokenizer than the target {target.spec} "
                              f"({len(av):,} against {len(tv):,} tokens, {differ:,} entries differ)",
                              "Give a small model of the target's own family and tokenizer (e.g. qwen2.5-coder-0.5b "
                              "for qwen2.5-coder-1.5b)")
    if stop_tokens(target)[0] != stop_tokens(assistant)[0] and assistant.tokenizer.eos_token_id != target.tokenizer.eos_token_id:
        raise LayerScopeError(f"--assistant {assistant.spec} ends its answers with another token than the target "
                              f"{target.spec}", "Give a small model of the target's own family and chat template")


def format_table(report: BenchReport) -> str:
    """The report as plain-text tables: overall, then per category."""
    depth = max((len(r["acceptance_by_position"]) for r in report.results), default=0)
    pred = report.cost_curve is not None
    head = ["contender", "layers", "tau", *(["break-even tau"] if pred else []), *[f"acc@{i + 1}" for i in range(depth)],
            "tok/s", "speedup", *(["predicted"] if pred else []), "lossless"]
    rows = []
    for r in report.results:
        acc = [f"{a:.2f}" for a in r["acceptance_by_position"]] + [""] * (depth - len(r["acceptance_by_position"]))
        rows.append([r["name"], ",".join(map(str, r.get("layers", []))) or "-", fmt.interval(r["tau"], r.get("tau_ci"), "tau"),
                     *([_f(r.get("break_even_tau"))] if pred else []), *acc, _f(r["tokens_per_s"], 1),
                     fmt.interval(r["speedup"], r.get("speedup_ci"), "speedup"),
                     *([_f(r.get("predicted_speedup")) + ("x" if r.get("predicted_speedup") else "")] if pred else []),
                     lossless_text(r, report.prompts)])
    lines = [f"{report.prompts} prompts, {report.max_new_tokens} new tokens max, device {report.device}"
             + (f", target in {report.dtype}" if report.dtype else "")
             + (f" ({report.dtype_why.partition(': ')[2]})" if report.dtype_why.partition(': ')[2] else "")
             + (f"; forwards of at least {report.row_align} row(s), each attending alone: token-exact"
                if report.row_align else ""),
             fmt.table(head, rows, left=2)]
    lines += [x for x in (quietness.line(report.machine), _curve_line(report)) if x]
    lines += [auto_note(r) for r in report.results if r.get("chosen")]
    lines += [f"{r['name']}: {r['verdict']}" for r in report.results if r.get("verdict") and not r.get("chosen")]
    lines += [lookup_note(r) for r in report.results if r.get("lookup")]
    lines += [lookup_auto_note(r) for r in report.results if r.get("lookup_auto")]
    lines += spec_decode_lines(report)
    if report.intervals:
        lines.append(interval_note(report.intervals))
        vs_reference = [r for r in report.results if r.get("paired")]
        if vs_reference:
            head = ["contender", f"tau - {report.intervals['reference']}", f"speedup - {report.intervals['reference']}"]
            rows = [[r["name"], fmt.interval(r["paired"]["tau"]["delta"], r["paired"]["tau"]["ci"], "delta"),
                     fmt.interval(r["paired"]["speedup"]["delta"], r["paired"]["speedup"]["ci"], "delta")] for r in vs_reference]
            lines += ["", fmt.table(head, rows, left=2)]
    cats = sorted({c for r in report.results for c in r["by_category"]})
    if len(cats) > 1:
        rows = []
        for cat in cats:
            for r in report.results:
                e = r["by_category"][cat]
                rows.append([cat, r["name"], _f(e["tau"]), _f(e["tokens_per_s"], 1),
                             _f(e["speedup"]) + ("x" if e["speedup"] else ""), "yes" if e["lossless"] else "NO"])
        lines += ["", fmt.table(["category", "contender", "tau", "tok/s", "speedup", "lossless"], rows, left=2)]
    return "\n".join(lines)


def lossless_text(entry: dict, prompts: int) -> str:
    """'yes', or 'NO (3 of 40 prompts differ from autoregressive)': how many prompts' outputs differ from those of
    the plain decoding the entry is held to (`compared_with`: transformers' peers to transformers' generate)."""
    if entry["lossless"]:
        return "yes"
    m, ref = entry.get("mismatched"), entry.get("compared_with")
    return f"NO ({m} of {prompts} prompts differ{f' from {ref}' if ref else ''})" if m else "NO"


def spec_decode_lines(report: BenchReport) -> list[str]:
    """The drafts' acceptance histograms under vLLM's metric names (Tally.spec_decode); [] without a draft."""
    rows = [[r["name"], str(m["num_drafts"]), str(m["num_draft_tokens"]), str(m["num_accepted_tokens"]),
             ",".join(map(str, m["num_accepted_tokens_per_pos"])), _f(m["mean_acceptance_length"])]
            for r in report.results if (m := r.get("spec_decode"))]
    if not rows:
        return []
    head = ["contender", "num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos",
            "mean_acceptance_length"]
    return ["", "vLLM's spec-decode metrics of the drafts' own steps (mean_acceptance_length = 1 + "
                "num_accepted_tokens / num_drafts, bonus token included):", fmt.table(head, rows, left=2)]


def _curve_line(report: BenchReport) -> str:
    """A line about the cost curve behind the predictions, only when it was measured busy."""
    if report.cost_curve is None or not report.cost_curve_machine or report.cost_curve_machine.get("quiet"):
        return ""
    return "cost curve: " + quietness.line(report.cost_curve_machine, "predicted speedups").removeprefix("machine: ")


def verdict(tau: float, break_even: float, decoding: str, measured: float | None = None, *,
            predicted: float | None = None, draft: Sequence[float] | None = None) -> str:
    """One line in words: does `decoding` pay here. `break_even`: its break-even tau (costmodel.break_even_tau; the
    benchmark passes it with the draft step the run measured, so it is tau / measured); `measured`: the run's
    speedup over plain decoding, which decides when it is given ("pays" only above 1x); `predicted`: the cost
    curve's own break-even tau, named with the reason when it said otherwise; `draft`: [the curve's, the run's] draft
    forward as a share of a one-token target forward. Two different numbers never print alike ("1.00 is below
    1.00"): they get the digits that tell them apart.

    "tau 1.540 is below the break-even tau 1.812 of chain k=4 measured in this run: it does not pay here (0.85x, ...);
    the cost curve's break-even tau 1.090 said it pays: ...", or without a measurement "tau 2.180 is above the
    break-even tau 1.330 of chain k=3: the cost curve predicts it pays on this machine (not measured)"."""
    t, b = _distinct(tau, break_even, digits=3)     # fmt.tau's digits, as Home and the app's tables show them
    side = "at" if t == b else "above" if tau > break_even else "below"
    if measured is None:
        pays = tau > break_even
        return (f"tau {t} is {side} the break-even tau {b} of {decoding}: the cost curve predicts it "
                + ("pays on this machine" if pays else "loses to plain decoding on this machine")
                + " (not measured)")
    pays = measured > 1.0
    m = _distinct(measured, 1.0)[0]
    said = f"it pays here ({m}x)" if pays else f"it does not pay here ({m}x, plain decoding is faster)"
    if (tau > break_even) != pays:       # a break-even other than this run's: the measurement is what happened
        return (f"tau {t} is {side} the break-even tau {b} of {decoding}, yet {said}: a step cost "
                f"{'less' if pays else 'more'} in this run than that break-even assumes, and the run is what happened")
    here = " measured in this run" if predicted is not None else ""
    line = f"tau {t} is {side} the break-even tau {b} of {decoding}{here}: {said}"
    if predicted is not None and (tau > predicted) != pays:
        p = _distinct(predicted, break_even, digits=3)[0]
        share = ""
        if draft and len(draft) == 2:
            curve_share, run_share = _distinct(draft[0], draft[1], digits=3)
            share = (f" (a draft forward and the step's upkeep: {run_share} of a one-token target forward here, "
                     f"{curve_share} on the curve)")
        cause = ("the curve was timed on a quieter machine or is stale, or it leaves out the decoder's per-step "
                 "upkeep" if not pays else "the curve was timed on a busy machine, or is stale")
        line += (f"; the cost curve's break-even tau {p} said it {'pays' if tau > predicted else 'loses'}: a step "
                 f"cost {b} plain steps here against {p} on the curve{share}: {cause}")
    return line


def _distinct(a: float, b: float, digits: int = 2) -> tuple[str, str]:
    """a and b with `digits` decimals, or more (up to 6) where that many would print two different numbers alike;
    alike at 6 they are equal as far as any timing tells."""
    for d in range(digits, 7):
        x, y = f"{a:.{d}f}", f"{b:.{d}f}"
        if x != y or a == b:
            return x, y
    return x, y


def auto_note(entry: dict) -> str:
    """What an `auto` contender chose and predicted, beside what it measured: "low auto chain k=2: chose
    K=2; the calibration predicted 1.08x, measured 1.02x (1.05x predicted from its measured tau)"; or, when
    nothing was predicted to pay, why it decoded plainly."""
    chosen = entry.get("chosen") or {}
    if chosen.get("plain"):
        cal = entry["calibrated"]
        return (f"{entry['name']}: no depth or tree pays on this machine: the best, {cal['decoding']}, was predicted "
                f"{_f(cal['speedup'])}x (calibrated tau {_f(cal['tau'])} below its break-even tau "
                f"{_f(cal['break_even_tau'])}), so auto decoded plainly (--auto-even-if-slower runs it anyway)")
    what = f"K={chosen['k']}" if "k" in chosen else \
        "tree " + " ".join(f"{k}={v}" for k, v in (chosen.get("tree") or {}).items())
    predicted = (entry.get("calibrated") or {}).get("speedup")
    measured = entry.get("speedup")
    lost = ": the pick lost to plain decoding in this run" if measured is not None and measured < 1.0 else ""
    return (f"{entry['name']}: chose {what}; the calibration predicted {_f(predicted)}x, measured "
            f"{_f(measured)}x ({_f(entry.get('predicted_speedup'))}x predicted from its measured tau){lost}")


def lookup_note(entry: dict) -> str:
    """How often prompt lookup took a step from the draft: "d chain k=1 + lookup 4: lookup proposed 120 of
    700 steps, 310 of its 400 tokens accepted (0.78); acc@ columns are the draft's own steps"."""
    lk = entry["lookup"]
    steps = lk["steps"] + lk["draft_steps"]
    rate = f" ({lk['accepted'] / lk['drafted']:.2f})" if lk["drafted"] else ""
    return (f"{entry['name']}: prompt lookup proposed {lk['steps']} of {steps} steps, {lk['accepted']} of its "
            f"{lk['drafted']} tokens accepted{rate}; the acc@ columns count the draft's own steps")


def lookup_auto_note(entry: dict) -> str:
    """What `--lookup auto` chose for a chain and why, in one line: "d auto chain k=2 + lookup 4..16: --lookup auto
    chose lookup 4..16 (adaptive) for chain k=2: predicted 1.62x against 1.31x without lookup (lookup proposed
    38% of the calibration's steps, 5.10 tokens each); measured 1.55x", or, on the chain alone, why no lookup runs."""
    a = entry["lookup_auto"]
    best, alone = a["best"], a["alone"]
    shape = draft_label(a["k"], TreeSpec(**a["tree"]) if a.get("tree") else None)
    seen = (f"lookup proposed {best['lookup_share']:.0%} of the calibration's steps"
            + (f", {best['lookup_tau']:.2f} tokens each" if best.get("lookup_tau") else ""))
    if a["chosen"] is None:
        return (f"{entry['name']}: --lookup auto chose no lookup for {shape}: the best span, {best['label']}, "
                f"was predicted {_f(best['speedup'])}x, not above {_f(alone['speedup'])}x without lookup ({seen})")
    kind = " (adaptive)" if a["chosen"]["cap"] > a["chosen"]["start"] else ""
    return (f"{entry['name']}: --lookup auto chose {best['label']}{kind} for {shape}: predicted "
            f"{_f(best['speedup'])}x against {_f(alone['speedup'])}x without lookup ({seen}); measured "
            f"{_f(entry.get('speedup'))}x")


def _f(x, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def interval_note(intervals: dict) -> str:
    """One line saying what the intervals in brackets are."""
    return (f"[lo, hi]: {intervals['level']:.0%} bootstrap intervals over the {intervals['prompts']} prompts "
            f"({intervals['draws']} resamples; speedup paired with autoregressive, differences paired with "
            f"{intervals['reference']})")
