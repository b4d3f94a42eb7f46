"""Continuing drafts: a training run that starts from drafts already trained instead of fresh heads.

    start = starting_point(paths, sets, target, draft_vocab, fc_norm, ff)   one stored draft per layer set, by layers
    build_drafters(..., start=start.heads) with start.d2t, start.t2d       (draft/training/fit.py)
    key_part(paths)                                                the weights' sha256, for the run's store key
    strategy_label(given, start, i)                                the new draft's strategy label
    vocab_of(paths)                                                the drafts' vocabulary size: the run's default

TrainOptions.init_from names the drafts (`train-draft --init-from DRAFT`, repeatable; `builtin` is the shipped
one). Every set of the run needs exactly one of them reading its layers, and they must share one draft
vocabulary (d2t), which the run keeps: a continued draft predicts the same tokens. The run's fc_norm must be the
drafts' own (a continued draft keeps its shape; a mismatch is refused, naming the option). The learning-rate schedule
starts again (warm-up, then cosine over the new budget): a warm restart, so the budget is what is added.
Held out: what the starting drafts held out (draft/training/online.py continued_held_out), so the new learning curve
never scores conversations they trained on. The new draft's layerscope.json records where it started (init_from: path, sha256, tokens it had seen) and
tokens_seen_total = those tokens + the new run's, and keeps the starting draft's strategy label (which
rule chose its layers) unless the run names one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from layerscope.draft.checkpoint import load_draft, read_config, read_meta
from layerscope.draft.model import DraftHead
from layerscope.errors import DraftError
from layerscope.store import file_sha256


@dataclass
class StartingPoint:
    heads: list[DraftHead]          # one per layer set, in the sets' order
    d2t: torch.Tensor               # [V] int64: the shared draft vocabulary
    t2d: torch.Tensor               # [vocab] bool
    records: list[dict]             # per set: path, sha256, tokens_seen, val_accuracy (what it started from),
                                    # and for an online draft its held-out ids and options (draft/training/online.py);
                                    # strategy: the label of the set it read (a continued draft keeps it)

    def summary(self, i: int) -> dict:
        """What the i-th set's new draft records of where it started (its layerscope.json init_from)."""
        return {k: self.records[i][k] for k in ("path", "sha256", "tokens_seen", "val_accuracy")}


def strategy_label(given: str | None, start: StartingPoint | None, i: int) -> str | None:
    """The strategy label the i-th set's new draft records: the run's own when it names one, else the starting
    draft's (a continued draft reads the layers its start's rule chose), else None."""
    if given is not None or start is None:
        return given
    return start.records[i].get("strategy")


def weights_sha256(path) -> str:
    """The sha256 of the draft directory's weights file (store.file_sha256)."""
    return file_sha256(Path(path) / "model.safetensors")


def key_part(paths) -> dict:
    """What a continued run's store key adds to its options: the starting weights' sha256 (not where they
    lie); {} for a fresh run, so its key is the one it had before init_from existed."""
    return {"init": [weights_sha256(p) for p in paths]} if paths else {}


def vocab_of(paths) -> int | None:
    """The draft vocabulary size of the first starting draft (its config.json's draft_vocab_size), which a continued
    run keeps, so it is the run's draft_vocab unless one is given; None without paths, or when the config has none."""
    if not paths:
        return None
    size = read_config(paths[0]).get("draft_vocab_size")
    return size if isinstance(size, int) and not isinstance(size, bool) else None


def starting_point(paths, sets: list[list[int]], target, draft_vocab: int, fc_norm: bool = False,
                   intermediate: int | None = None) -> StartingPoint | None:
    """The drafts `paths` loaded against `target` (a LoadedModel) and matched to `sets`, or None for no paths.
    fc_norm: the run's (TrainOptions.fc_norm), which every starting draft must have too; intermediate: the run's MLP
    width when given (TrainOptions.draft_intermediate), which every starting draft must have."""
    if not paths:
        return None
    by_layers: dict[tuple, tuple[Path, DraftHead]] = {}
    for p in paths:
        head = load_draft(p, target)            # another target's draft, or a damaged one, fails here
        layers = tuple(head.config.aux_layers)
        if layers in by_layers:
            raise DraftError(f"Two --init-from drafts read layers {list(layers)} ({by_layers[layers][0]} and {p})",
                             "Give one starting draft per layer set")
        by_layers[layers] = (Path(p), head)
    wanted = [tuple(s) for s in sets]
    missing = [list(s) for s in wanted if s not in by_layers]
    unused = [list(s) for s in by_layers if s not in wanted]
    if missing or unused:
        raise DraftError(f"--init-from drafts read {[list(s) for s in by_layers]}, the run trains {[list(s) for s in wanted]}"
                         + (f" (no starting draft for {missing})" if missing else "")
                         + (f" ({unused} not trained)" if unused else ""),
                         "Give one --init-from draft per --layers set, reading the same layers")
    heads = [by_layers[s][1] for s in wanted]
    for s in wanted:
        path, head = by_layers[s]
        if head.config.fc_norm != bool(fc_norm):
            raise DraftError(f"The --init-from draft {path} was trained {'with' if head.config.fc_norm else 'without'} "
                             f"fc_norm and this run is {'with' if fc_norm else 'without'} it",
                             f"Pass {'--fc-norm' if head.config.fc_norm else '--no-fc-norm'} (a continued draft keeps "
                             "its fc_norm)")
        width = int(intermediate or getattr(target.model.config, "intermediate_size", 0) or 0)
        if head.config.intermediate_size != width:
            raise DraftError(f"The --init-from draft {path} has an MLP {head.config.intermediate_size} wide and this "
                             f"run's is {width} wide",
                             f"Pass --draft-intermediate {head.config.intermediate_size} (a continued draft keeps its "
                             "width)")
    d2t, t2d = heads[0].d2t.detach().cpu(), heads[0].t2d.detach().cpu()
    if any(not torch.equal(h.d2t.detach().cpu(), d2t) for h in heads[1:]):
        raise DraftError("The --init-from drafts have different draft vocabularies",
                         "Continue drafts that were trained in one run together, or continue each in its own run")
    vocab = int(target.model.get_input_embeddings().weight.shape[0])
    if len(d2t) != min(int(draft_vocab), vocab):         # a run's V is min(draft_vocab, the target's vocabulary)
        raise DraftError(f"The --init-from draft's vocabulary has {len(d2t)} tokens, not --draft-vocab {draft_vocab}",
                         f"Pass --draft-vocab {len(d2t)} (a continued draft keeps its vocabulary)")
    records = []
    for s in wanted:
        path, _ = by_layers[s]
        meta = read_meta(path)
        online = meta.get("online") if isinstance(meta.get("online"), dict) else None
        records.append({"path": str(path), "sha256": weights_sha256(path), "tokens_seen": meta.get("tokens_seen_total",
                        meta.get("tokens_seen")), "val_accuracy": meta.get("val_accuracy"),
                        "strategy": meta.get("strategy"),
                        "val_ids": online.get("val_ids") if online else None,
                        "online_options": meta.get("options") if online else None})
    return StartingPoint(heads, d2t, t2d, records)
