#!/bin/bash
# The long training runs of issue 20 on SmolLM2-135M, resumable: run the same line again after an interruption
# (a kill, a reboot, the end of a session) and it continues from the newest checkpoint in the store.
#
#   benchmarks/long_run.sh default   # the default set [2,15,27] alone: the draft that ships as --draft builtin
#   benchmarks/long_run.sh study     # the default set and the study's other eight sets in one pass
#
# Keep the store outside the work tree (LAYERSCOPE_STORE, default $HOME/layerscope-store) so that it outlives
# it, and run this alone on the machine: a second torch process on 2 cores slows both several times.
# Log: $LAYERSCOPE_STORE/logs/long-<mode>.log. The regenerated answers (1,688 ShareGPT prompts, 185,768
# response tokens) are generated once into the store (about an hour on 2 cores) and shared by both modes.
set -euo pipefail
cd "$(dirname "$0")/.."
mode="${1:-default}"
export LAYERSCOPE_STORE="${LAYERSCOPE_STORE:-$HOME/layerscope-store}"
mkdir -p "$LAYERSCOPE_STORE/logs"
data=(--model smollm2-135m --prompts sharegpt --limit 2000 --responses regenerate --max-prompt-tokens 256 --threads 2)
case "$mode" in
  default) sets=(--layers 2,15,27); budget=(--time 100m) ;;
  # the study's sets for SmolLM2 (docs/results.md): default, entropy-topk, aggregate, greedy, spread, last-k,
  # single, two seeded random controls
  study) sets=(--layers 2,15,27 --layers 0,10,27 --layers 2,27,29 --layers 18,26,27 --layers 2,10,27
               --layers 27,28,29 --layers 29 --layers 13,14,23 --layers 4,6,25); budget=(--tokens 1M) ;;
  *) echo "usage: $0 default|study" >&2; exit 2 ;;
esac
exec .venv/bin/layerscope train-draft "${data[@]}" "${sets[@]}" "${budget[@]}" --json \
  >> "$LAYERSCOPE_STORE/logs/long-$mode.json" 2>> "$LAYERSCOPE_STORE/logs/long-$mode.log"
