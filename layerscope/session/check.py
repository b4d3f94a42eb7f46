"""Whether the `session` object of a session.json and its tensors make a valid session; how a refusal reads.

`session_fields` checks the document against SCHEMA (schema.py), runs AnalysisOptions' own checks, and then
the rules that tie fields together: layer sets, picks and drafts inside the capture, tensors shaped by its
number of layers, compartments inside it. Anything else is refused with a `SessionError` naming the source
("upload.zip is not a valid LayerScope session: ...") and saying what to do.
"""

from __future__ import annotations

import torch

from layerscope import layerset
from layerscope.errors import LayerScopeError, SessionError
from layerscope.session.schema import MAX_LAYERS, SCHEMA, SESSION_FIELDS, problem, valid_id
from layerscope.stats.analysis import ARRAY_FIELDS, AnalysisOptions

ENTROPY_ARRAYS = ("entropy", "entropy_normalized", "entropy2", "entropy_prompt", "entropy_prompt_normalized")
CKA_ARRAYS = ("cka", "cka_debiased", "cka_bound")
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def refuse(source: str, what: str, fix: str = "Export the session again from LayerScope and import that file"):
    raise SessionError(f"{source} is not a valid LayerScope session: {what}", fix)


def require(cond: bool, source: str, what: str) -> None:
    if not cond:
        refuse(source, what)


def _layers_ok(layers, n: int | None) -> bool:
    """layerset.is_valid against a capture of n layers; a set may name up to the final state n (files written
    before sets were limited to 0..N-1 did), and at most index 10,000 when the capture is unknown."""
    return layerset.is_valid(layers, (n if n is not None else MAX_LAYERS) + 1)


def session_fields(body, arrays: dict[str, torch.Tensor], source: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(the Session's fields, its tensors as float32) of a valid `session` object (a dict); else a SessionError."""
    # the top level in plain words first (the schema refuses the same, less plainly), then every field by the schema
    extra = sorted(set(body) - set(SESSION_FIELDS))
    require(not extra, source, f"unknown fields {extra[:5]}")
    for key in ("capture", "analysis_options", "stats"):
        require(isinstance(body.get(key, {}), dict), source, f"field {key!r} must be an object")
    for key in ("layer_sets", "drafts", "bench_results", "study"):
        v = body.get(key, [])
        require(isinstance(v, list) and all(isinstance(x, dict) for x in v), source,
                f"field {key!r} must be a list of objects")
    require(valid_id(body.get("id")), source, "the session id must be 12 lowercase hex characters")
    found = problem(body, SCHEMA, "session")
    require(found is None, source, (found or "").removeprefix("session."))
    try:
        AnalysisOptions(**body.get("analysis_options", {})).validate()
    except LayerScopeError as e:
        refuse(source, f"analysis_options: {e.problem}")

    # layers named anywhere lie inside the capture
    n = body.get("capture", {}).get("num_layers")
    for s in body.get("layer_sets", []):
        require(_layers_ok(s["layers"], n), source,
                f"layer set {s['name']!r} must list distinct layers in 0..{n if n is not None else 'N'}")
    picks = body.get("manual_picks", [])
    require(all(0 <= x <= (n if n is not None else MAX_LAYERS) for x in picks), source,
            "manual_picks must be a list of layer indices")
    for i, d in enumerate(body.get("drafts", [])):
        require(_layers_ok(d["layers"], n), source, f"draft {i + 1} needs a path and its layers")

    # tensors: float, finite, shaped by the number of layers
    for k, t in arrays.items():
        require(k in ARRAY_FIELDS, source, f"unexpected tensor {k!r} in arrays.safetensors")
        require(t.dtype in FLOATS, source, f"tensor {k!r} must be floating point, not {t.dtype}")
        require(bool(torch.isfinite(t).all()), source, f"tensor {k!r} holds NaN or infinite values")
    if n is not None:
        for k in ENTROPY_ARRAYS:
            if k in arrays:
                require(tuple(arrays[k].shape) == (n + 1,), source, f"tensor {k!r} must have {n + 1} values (layers 0..{n})")
        for k in CKA_ARRAYS:
            if k in arrays:
                require(tuple(arrays[k].shape) == (n + 1, n + 1), source, f"tensor {k!r} must be {n + 1}×{n + 1}")
    if "token_entropy" in arrays:
        require(arrays["token_entropy"].dim() == 1, source, "tensor 'token_entropy' must be 1-D")
    # without a capture summary the tensors must still agree with each other (and with stats.num_layers)
    lengths = {tuple(t.shape) for k, t in arrays.items() if k != "token_entropy"}
    sizes = {dim for shape in lengths for dim in shape}
    require(len(sizes) <= 1 and all(len(shape) in (1, 2) for shape in lengths), source,
            "the statistics tensors disagree on the number of layers")
    stats = body.get("stats", {})
    if sizes:
        L = sizes.pop()
        require(stats.get("num_layers") in (None, L - 1), source,
                f"stats.num_layers is {stats.get('num_layers')}, the tensors hold layers 0..{L - 1}")
        require(n is None or n == L - 1, source, f"the tensors hold layers 0..{L - 1}, the capture 0..{n}")
    top = n if n is not None else stats.get("num_layers")
    blocks = [stats.get("compartments") or []] + list((stats.get("compartments_by_k") or {}).values())
    require(all(0 <= a <= b <= (top if top is not None else MAX_LAYERS) for block in blocks for a, b in block), source,
            "stats compartments must be [first, last] layer ranges inside the capture")

    kwargs = {k: body[k] for k in SESSION_FIELDS if k in body}
    kwargs["manual_picks"] = sorted(set(picks))
    return kwargs, {k: v.to(torch.float32) for k, v in arrays.items()}
