"""The coding prompts of issue 50's benchmark, as one prompt file: the builtin set's coding prompts and held-out
ShareGPT conversations of kind code (prompts/kinds.py), first user turn each.

    .venv/bin/python benchmarks/code_prompts.py docs/study-qwen15/bench-code.jsonl --sharegpt 40

Held out means the 5 % of ShareGPT records no training draws from (prompts/sets.py, split "heldout"), so no draft
trained on `--prompts sharegpt` has seen them. The file is what `layerscope bench --prompts FILE` reads
(categories "coding" and "sharegpt-code"); `bench --max-prompt-tokens` leaves out the ones too long for the
target, so write more than the 40 the issue asks for. Same arguments, same file: the draws are seeded.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from layerscope.prompts.kinds import parse_weights
from layerscope.prompts.sets import load_prompts


def code_prompts(sharegpt: int, seed: int = 0) -> list[dict]:
    """[{category, prompt}]: every builtin coding prompt, then `sharegpt` held-out ShareGPT code conversations."""
    builtin = [p for p in load_prompts("builtin").prompts if p.category == "coding"]
    held_out = load_prompts("sharegpt-heldout", limit=sharegpt, seed=seed,
                            kind_weights=parse_weights("code=1,*=0")).prompts
    return ([{"category": "coding", "prompt": p.text} for p in builtin]
            + [{"category": "sharegpt-code", "prompt": p.text} for p in held_out])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--sharegpt", type=int, default=40, help="held-out ShareGPT code conversations (default 40)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    rows = code_prompts(a.sharegpt, a.seed)
    a.out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    print(f"{len(rows)} prompts ({sum(r['category'] == 'coding' for r in rows)} builtin coding) in {a.out}")


if __name__ == "__main__":
    main()
