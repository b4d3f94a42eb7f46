"""The drafts that ship inside the package: `--draft builtin` for the default model.

A new user should see speculative decoding pay before training anything, so the package carries one trained
EAGLE-3 draft for SmolLM2-135M reading the default layer set [2, 15, 27] (bfloat16, no embedding: it shares
the target's). It is an ordinary draft directory (layerscope/draft/checkpoint.py) plus TRAINED.md, the command
that trained it and its learning curve, written by `ship` (scripts/ship_draft.py).

    SHIPPED                          model alias -> folder under layerscope/data/drafts/
    builtin_path(model)              the shipped draft for `model` (DraftError when none ships)
    resolve(spec, model, store)      'builtin' | a draft directory | a store key or its prefix (drafts/<key>) -> a
                                     directory
    ship(src, model, command, root)  write the draft at `src` into the package in bfloat16
"""

from __future__ import annotations

import re
from pathlib import Path

from layerscope.draft.checkpoint import load_draft, read_meta, save_draft
from layerscope.draft.init_from import weights_sha256
from layerscope.draft.training.loss import simulated_acc_len
from layerscope.errors import DraftError
from layerscope.store import ENTRY_NAME_RE
from layerscope.target.aliases import DEFAULT_MODEL

MIN_PREFIX = 4
KEY_PREFIX_RE = re.compile(r"[0-9a-f]{4,24}")       # a stored draft's key or a prefix of it (4 hex at least)
SHORT_PREFIX_RE = re.compile(r"[0-9a-f]{1,3}")      # hex too short to be taken as a prefix (preflight.draft_dir says so)

BUILTIN = "builtin"
ROOT = Path(__file__).resolve().parent.parent / "data" / "drafts"
SHIPPED = {DEFAULT_MODEL: "smollm2-135m-2-15-27", "qwen2.5-coder-1.5b": "qwen2.5-coder-1.5b-20-24-27"}
SHIP_DTYPE = "bfloat16"


def builtin_path(model: str | None = None, root: Path | None = None) -> Path:
    """The shipped draft directory for `model` (None: the default model) under `root` (default ROOT)."""
    model = model or DEFAULT_MODEL
    if model not in SHIPPED:
        raise DraftError(f"--draft builtin: no draft ships for {model} (the package carries one for "
                         f"{', '.join(SHIPPED)} only)",
                         f"Train one with `layerscope train-draft --model {model} --layers ...`, or use --model {DEFAULT_MODEL}")
    path = Path(root or ROOT) / SHIPPED[model]
    if not (path / "model.safetensors").is_file():
        raise DraftError(f"--draft builtin: the shipped draft for {model} is missing from {path}",
                         "Reinstall LayerScope (`pip install .` carries layerscope/data/drafts/), or train one with "
                         "`layerscope train-draft`")
    return path


def is_builtin(spec) -> bool:
    return str(spec).strip().lower() == BUILTIN


def resolve(spec, model: str | None = None, store=None) -> Path:
    """A draft directory from 'builtin' (the draft shipped for `model`), a directory, or the key of a draft in
    `store` (drafts/<key>). Anything else is returned as a Path for the caller's checks to name."""
    if is_builtin(spec):
        return builtin_path(model)
    path = Path(str(spec)).expanduser()
    if path.is_dir() or store is None:
        return path
    if not ENTRY_NAME_RE.fullmatch(str(spec)):   # not a name the store could hold (a path, a glob): the caller names it
        return path
    key = str(spec)
    candidate = Path(store.path("drafts", key))
    if not (candidate.is_dir() or candidate.is_symlink()) and KEY_PREFIX_RE.fullmatch(key):
        matches = sorted(p.name for p in store.entry_names("drafts") if p.name.startswith(key))   # a key's prefix,
        if len(matches) > 1:                                                                   # as captures take it
            shown = ", ".join(matches[:10]) + (f" and {len(matches) - 10} more" if len(matches) > 10 else "")
            raise DraftError(f"The prefix {key!r} matches {len(matches)} stored drafts: {shown}",
                             f"Type more characters of the key (the folders of {Path(store.root) / 'drafts'})")
        if matches:
            key, candidate = matches[0], Path(store.path("drafts", matches[0]))
    if candidate.is_dir() or candidate.is_symlink():   # the store's path rule, as in every listing and open
        problem = store.entry_problem("drafts", key)
        if problem is not None:
            raise DraftError(f"The stored draft {key} cannot be used: {problem}",
                             f"Remove the link {candidate}, or move the draft itself into {candidate.parent}")
        return candidate
    return path


def ship(src, model: str, command: str, *, root: Path | None = None, target=None) -> Path:
    """Copy the trained draft at `src` into the package as the builtin draft for `model`, in bfloat16, with
    TRAINED.md (the command, budget, tokens seen, held-out agreement and learning curve). `target` (a
    LoadedModel of `model`) checks that the draft fits it first. Returns the shipped directory."""
    if model not in SHIPPED:
        raise DraftError(f"No builtin slot for {model}", f"Ship drafts for {', '.join(SHIPPED)}")
    src = Path(src)
    meta = read_meta(src)
    head = load_draft(src, target)
    layers = [int(x) for x in meta.get("layers") or head.aux_layers]
    written = {"format", "saved", "dtype", "aux_layers", "draft_vocab_size", "fc_norm", "serving_notes"}   # save_draft's own
    shipped = {"from": str(src.name), "command": command, "dtype": SHIP_DTYPE}
    start = continued_from(meta, Path(root or ROOT) / SHIPPED[model])     # read before the slot is replaced
    if start is not None:
        shipped["continued_from"] = start
    record = {**{k: v for k, v in meta.items() if k not in written}, "shipped": shipped}
    out = save_draft(Path(root or ROOT) / SHIPPED[model], head.cpu(), record, target=target, dtype=SHIP_DTYPE)
    (out / "TRAINED.md").write_text(trained_md(model, layers, record, command))
    out.chmod(0o755)                       # staged folders are private (mkdtemp); a shipped one is read by everyone
    for f in out.iterdir():
        f.chmod(0o644)
    return out


def continued_from(meta: dict, slot: Path) -> dict | None:
    """Where a continued draft (trained with --init-from) started, so that its history outlives the starting
    draft: the starting weights' sha256, tokens seen and agreement (from `meta`'s init_from), and, when a draft
    with those weights is found (at the recorded path, else in `slot`, the shipped draft this one replaces),
    its shipping command, the tokens of its own run and its learning curve. None for a fresh draft."""
    start = meta.get("init_from")
    if not isinstance(start, dict):
        return None
    out = {"sha256": start.get("sha256"), "tokens_seen": start.get("tokens_seen"),
           "val_accuracy": start.get("val_accuracy"), "command": None, "run_tokens": None, "curve": None}
    for place in (start.get("path"), slot):
        if place and (Path(place) / "model.safetensors").is_file() and weights_sha256(place) == start.get("sha256"):
            found = read_meta(place)
            out.update(command=(found.get("shipped") or {}).get("command"), run_tokens=found.get("tokens_seen"),
                       curve=found.get("curve"))
            break
    return out


def trained_md(model: str, layers: list[int], meta: dict, command: str) -> str:
    """What a user reads about the shipped draft: how it was trained and how well it agrees with the target."""
    acc = meta.get("val_accuracy") or []
    start = (meta.get("shipped") or {}).get("continued_from")
    before = int(start["tokens_seen"] or 0) if start else 0           # tokens the starting draft had seen
    curve = [(int(t) + before, by_step) for t, by_step in meta.get("curve") or []]   # [tokens, [acc per step]]
    if start and start.get("curve") and start.get("run_tokens") is not None:        # the starting draft's own run
        curve = [(int(t) + before - int(start["run_tokens"]), by_step) for t, by_step in start["curve"]] + curve
    rows = "\n".join(f"| {tokens:,} | {float(by_step[0]):.3f} |" for tokens, by_step in curve)
    online = meta.get("online") or {}
    seen = f"- tokens seen: {int(meta.get('tokens_seen') or 0):,} in {float(meta.get('seconds') or 0) / 60:.0f} min of training"
    if start:
        seen += f", continuing a draft that had seen {before:,} ({before + int(meta.get('tokens_seen') or 0):,} in all)"
    lines = [
        f"# The builtin draft for {model}: layers {layers}",
        "",
        "Trained by LayerScope with:",
        "",
        "```",
        command,
        "```",
        "",
        f"- data: {online.get('conversations', '?')} {online.get('prompts', '')} conversations, "
        f"{online.get('responses', '')} answers, {online.get('data_tokens', 0):,} tokens",
        seen,
        "- held-out agreement with the target's greedy token per draft position: "
        + ", ".join(f"{a:.3f}" for a in acc),
        f"- simulated_acc_len (SpecForge's Σ∏ of that agreement: draft tokens per verification, no bonus token, "
        f"not τ): {simulated_acc_len(acc):.3f}",
        f"- saved in {SHIP_DTYPE} without the embedding (it uses the target's)",
        "",
    ]
    if start:
        agreement = ", ".join(f"{a:.3f}" for a in start.get("val_accuracy") or [])
        lines += ["It continued (`--init-from`) the draft whose weights have sha256 "
                  f"`{start['sha256']}` (held-out agreement {agreement or 'not recorded'} after {before:,} tokens), "
                  + ("trained with:" if start.get("command") else "whose command was not recorded."), ""]
        if start.get("command"):
            lines += ["```", start["command"], "```", ""]
    lines += [
        "Learning curve (held-out agreement at the first draft position"
        + (", tokens seen in all, the starting draft's run first" if start else "") + "):",
        "",
        "| tokens seen | agreement |",
        "|---:|---:|",
        rows,
        "",
    ]
    return "\n".join(lines)
