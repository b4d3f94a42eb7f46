#!/bin/bash
# The long runs of issues 20 and 21 on SmolLM2-135M, resumable: run the same line again after an interruption
# (a kill, a reboot, the end of a session) and it continues from what the store holds.
#
#   benchmarks/long_run.sh default   # the default set [2,15,27] alone: the draft that ships as --draft builtin
#   benchmarks/long_run.sh continue  # the builtin draft trained on (--init-from builtin): 1.25M more tokens over
#                                    # 4,000 drawn ShareGPT prompts (the first 2,000's answers are reused; it holds
#                                    # out what the builtin held out); ship the result with scripts/ship_draft.py
#   benchmarks/long_run.sh continue-kinds  # issue 39.3: the builtin draft trained on again, 1.25M more tokens over
#                                    # 4,000 ShareGPT prompts drawn with more of the kinds it loses on
#                                    # (--kinds translation=10,summarization=5,math=5: about 8 % translation, 8 %
#                                    # summarization, 4 % maths instead of 1-2 % each); THREADS=1 on a shared machine.
#                                    # It answers only the prompts the kept unweighted answers lack (about 1,700,
#                                    # ~90 min on 2 cores, resumable per part); run `keep` before a session ends
#   benchmarks/long_run.sh ship      # after `continue` (SHIP_FROM=continue-kinds: after that one): ship its draft
#                                    # as --draft builtin (scripts/ship_draft.py), then the two benchmarks of the
#                                    # drafts issue (item 5), quiet, into docs/bench/
#   benchmarks/long_run.sh bench-builtin   # issue 39.4, the benchmark that counts: --draft builtin with --k auto
#                                    # --tree auto --lookup auto against plain decoding, HF generate and HF prompt
#                                    # lookup on 96 builtin and 40 held-out ShareGPT prompts, quiet, all cores, into
#                                    # docs/bench/builtin-<its run key>-{builtin,sharegpt-heldout}.{txt,json}
#   benchmarks/long_run.sh study     # the study itself: its capture, then `layerscope study --online`, which
#                                    # trains every proposed set (default rule, entropy/CKA strategies, last-k,
#                                    # single, two seeded random controls) for seeds 0 and 1, four sets per
#                                    # target pass, each pass benchmarked on 40 held-out prompts when it is done
#   benchmarks/long_run.sh keep      # copy the store's regenerated answers of $STUDY_DIR's model (MODEL to name
#                                    # another) into $STUDY_DIR/responses (commit them)
#   benchmarks/long_run.sh gemma3-study  # the same study on Gemma 3 270M (issue 38), at 200k tokens per draft with
#                                    # fc_norm (the budget at which the default set's held-out agreement passes 0.3:
#                                    # docs/results.md), kept in docs/study-gemma3 (STUDY_DIR); `keep` with
#                                    # STUDY_DIR=docs/study-gemma3 keeps its answers
#   benchmarks/long_run.sh smollm2-fc-norm   # issue 38.3 on SmolLM2: the study's default [2,15,27], best (probe
#                                    # [19,21,27]) and worst (single [29]) sets again, with fc_norm, seed 0, the
#                                    # study's recipe and benchmark, into docs/study-500k/outcomes-fc-norm
#   benchmarks/long_run.sh gemma3-no-fc-norm # issue 38.3 on Gemma 3: the study's default, best and worst sets
#                                    # (GEMMA3_SETS, as --layers arguments) without fc_norm, seed 0, into
#                                    # docs/study-gemma3/outcomes-no-fc-norm; either pair is then read with
#                                    # benchmarks/paired_outcomes.py (the Markdown table of issue 38.3)
#   benchmarks/long_run.sh qwen-stats    # issue 49.4: the statistics and the probe at depth 28 and 24: a capture of
#                                    # qwen2.5-coder-1.5b and of -0.5b (120 ShareGPT prompts, 64 new tokens each),
#                                    # analyze, every strategy's set (select --compare) and the probe's swap search,
#                                    # as JSON into docs/study-qwen15/stats/ (commit them)
#   benchmarks/long_run.sh qwen-study    # issue 50: one target pass of qwen2.5-coder-1.5b training the default rule
#                                    # [2,14,25], the probe's best set, aggregate entropy's set and a random control
#                                    # (fc_norm, the answers drawn mostly code: --train-kinds code=3; the drafts' MLP
#                                    # 1024 wide, DRAFT_INTERMEDIATE, so that one ships under 64 MiB in bf16: 63 MiB
#                                    # where the target's 8960 makes 133 MiB; trained in bf16 autocast, TRAIN_DTYPE:
#                                    # 2.4x a step here, benchmarks/train_dtype.py), benchmarked on
#                                    # 40 held-out ShareGPT prompts; outcomes and answers kept in docs/study-qwen15
#                                    # (`keep` with STUDY_DIR=docs/study-qwen15 MODEL=qwen2.5-coder-1.5b)
#   benchmarks/long_run.sh qwen-continue # issue 50: the shipped 1.5B draft (probe [20,24,27]) trained on
#                                    # (--init-from builtin): QWEN_TOKENS (default 1M) more tokens over half again as
#                                    # many conversations (--limit 1800 of the study's draw, code weighted 3x: 1,458
#                                    # fit against the shipped draft's 968, whose answers are the ones kept in
#                                    # docs/study-qwen15/responses; the 490 others are answered first, ~35 min on 2
#                                    # cores, resumable per part; `keep` keeps them). It holds out what the shipped
#                                    # draft held out; QWEN_DRAFT=<its draft key> benches it before qwen-ship.
#                                    # The third round (2026-12-07): QWEN_LIMIT=3000 QWEN_TOKENS=400k (the answers to
#                                    # all of them are kept in docs/study-qwen15/responses: only the training runs)
#                                    # The fourth round's answers (QWEN_LIMIT=3500: 408 more, 2026-12-07) are kept
#                                    # too: QWEN_LIMIT=3500 QWEN_TOKENS=1M trains on those of the 2,856 drawn that fit, the
#                                    # epoch after the first reading the feature cache
#   benchmarks/long_run.sh qwen-ship     # after qwen-continue: its draft shipped as the 1.5B's --draft builtin
#   benchmarks/long_run.sh qwen-bench    # issue 50's done-when: the 1.5B's draft (QWEN_DRAFT, default builtin) with
#                                    # --k/--tree/--lookup auto against plain decoding, HF generate and prompt lookup
#                                    # and the 0.5B as assistant_model, on 52 coding prompts (12 builtin, 40 held-out
#                                    # ShareGPT: docs/study-qwen15/bench-code.jsonl) x 64 tokens, into docs/bench/
#
# Keep the store outside the work tree (LAYERSCOPE_STORE, default $HOME/layerscope-store) so that it outlives
# it, and run this alone on the machine: a second torch process on 2 cores slows both several times.
# Logs: $LAYERSCOPE_STORE/logs/long-<mode>.log (progress) and .json (results). The regenerated answers
# (1,688 ShareGPT prompts, ~186k response tokens) are generated once into the store (about an hour on 2 cores)
# and shared by every seed and mode. Where each part stands: training checkpoints in runs/<key>/ (resumed
# from the newest), finished drafts in drafts/, each draft's benchmark cached in the store.
#
# The study takes ~6 hours of training on 2 cores, longer than a session, and a machine (its store) may not
# come back. What must outlive it is committed in $STUDY_DIR (default docs/study-500k of the work tree this
# runs from; point it at the tree you commit from): responses/ (the answers, copied into the store before a
# run: `keep` puts them there) and outcomes/ (`study --outcomes`: one small JSON per finished set and seed,
# its record and benchmark, read back instead of training again). So a run on a new machine trains only
# what no committed outcome holds.
set -euo pipefail
cd "$(dirname "$0")/.."
mode="${1:-default}"
export LAYERSCOPE_STORE="${LAYERSCOPE_STORE:-$HOME/layerscope-store}"
mkdir -p "$LAYERSCOPE_STORE/logs"
log="$LAYERSCOPE_STORE/logs/long-$mode"
case "$mode" in gemma3-*) default_dir=docs/study-gemma3 ;; qwen-*) default_dir=docs/study-qwen15 ;; *) default_dir=docs/study-500k ;; esac
study_dir="${STUDY_DIR:-$(pwd)/$default_dir}"
# --no-fc-norm: the builtin draft and the SmolLM2 study were trained before fc_norm became the default, and a continued
# draft keeps its norm (their keys and outcomes are those of runs without it)
data=(--model smollm2-135m --prompts sharegpt --limit 2000 --responses regenerate --max-prompt-tokens 256 --threads 2 --no-fc-norm)
continued=("${data[@]}")
continued[5]=4000                    # --limit: twice the distinct conversations
continued+=(--layers 2,15,27 --init-from builtin --tokens 1.25M)
by_kind=("${continued[@]}")
by_kind[11]="${THREADS:-2}"          # --threads
by_kind+=(--kinds translation=10,summarization=5,math=5)
# issue 50: the shipped 1.5B draft trained on, with the study's recipe (qwen-continue, qwen-ship)
qwen_continued=(--model qwen2.5-coder-1.5b --prompts sharegpt --kinds code=3 --responses regenerate
  --limit "${QWEN_LIMIT:-1800}" --max-prompt-tokens 256 --max-new-tokens 192 --layers 20,24,27 --init-from builtin
  --tokens "${QWEN_TOKENS:-1M}" --lr "${QWEN_LR:-0.0003}" --fc-norm --draft-intermediate 1024 --train-dtype bfloat16
  --threads "${THREADS:-2}")
# the answers kept in the repository go into the store first (never over what it holds)
copy_responses() {
  if [ -d "$study_dir/responses" ]; then
    mkdir -p "$LAYERSCOPE_STORE/responses" && cp -rn "$study_dir/responses/." "$LAYERSCOPE_STORE/responses/"
  fi
}
# a benchmark's table: `bench_table OUT bench-args...` prints into the store's logs and moves the table to OUT only
# when the bench ends well, so a tree being committed never holds a half-written table (or an emptied one)
bench_table() {
  local out="$1"; shift
  local tmp
  tmp="$LAYERSCOPE_STORE/logs/$(basename "$out").partial"
  .venv/bin/layerscope bench "$@" > "$tmp" 2>> "$log.log"
  mv "$tmp" "$out"
}
# the study's capture of one model: its statistics propose the sets and give the proxies (10-25 minutes, each
# machine; served from the store when it holds it). Prints its key.
study_capture() {
  .venv/bin/layerscope capture --model "$1" --prompts sharegpt --limit 240 --max-new-tokens 96 \
    --max-prompt-tokens 256 --batch-size 16 --json 2>> "$log.log" | .venv/bin/python -c 'import json,sys; print(json.load(sys.stdin)["key"])'
}
# the study of one model (`study`, `gemma3-study`): its training options after the model
run_study() {
  local model="$1"; shift
  copy_responses
  key=$(study_capture "$model")
  echo "study capture: $key" >> "$log.log"
  exec .venv/bin/layerscope study "$key" --strategies default,greedy,aggregate,entropy-topk,spread,random,last-k,single,probe \
    --random-sets 2 --online --train-prompts sharegpt --responses regenerate "$@" \
    --seeds 0,1 --sets-per-pass "${SETS_PER_PASS:-4}" --outcomes "$study_dir/outcomes" \
    --limit 40 --max-new-tokens 32 --wait-quiet 10m --json >> "$log.json" 2>> "$log.log"
}
# a few sets of a study trained again with one training option changed (issue 38.3): the study's capture and
# recipe otherwise, its answers reused, one seed, into an outcome folder of their own
run_sets() {
  local model="$1" outcomes="$2"; shift 2
  copy_responses
  key=$(study_capture "$model")
  echo "sets capture: $key" >> "$log.log"
  exec .venv/bin/layerscope study "$key" --online --train-prompts sharegpt --responses regenerate "$@" \
    --seeds 0 --outcomes "$study_dir/$outcomes" --limit 40 --max-new-tokens 32 --wait-quiet 10m \
    --json >> "$log.json" 2>> "$log.log"
}
# the newest draft a training mode made: the path in the last JSON document it printed into its log
newest_draft() {
  .venv/bin/python - "$LAYERSCOPE_STORE/logs/long-$1.json" <<'PY'
import json, sys
text, docs, i, dec = open(sys.argv[1]).read(), [], 0, json.JSONDecoder()
while text[i:].strip():
    i += len(text[i:]) - len(text[i:].lstrip())
    doc, i = dec.raw_decode(text, i)
    docs.append(doc)
print(docs[-1]["drafts"][0]["path"])
PY
}
# the shipped builtin draft's store key, 12 characters: what its benchmark tables in docs/bench are named by
shipped_key() {
  .venv/bin/python -c 'import json,glob; print(json.load(open(glob.glob("layerscope/data/drafts/smollm2-135m-*/layerscope.json")[0]))["shipped"]["from"][:12])'
}
case "$mode" in
  default)
    exec .venv/bin/layerscope train-draft "${data[@]}" --layers 2,15,27 --time 100m --json >> "$log.json" 2>> "$log.log" ;;
  continue)
    exec .venv/bin/layerscope train-draft "${continued[@]}" --json >> "$log.json" 2>> "$log.log" ;;
  continue-kinds)
    # the weighted draw takes the unweighted draw's answers kept in docs/study-500k/responses (its first 2,000 are
    # among the 4,000) and answers the rest; `keep` then keeps its own parts, so a new machine resumes from them
    copy_responses
    exec .venv/bin/layerscope train-draft "${by_kind[@]}" --json >> "$log.json" 2>> "$log.log" ;;
  ship)
    # run it from the work tree you commit from: it writes layerscope/data/drafts/ and docs/bench/ there.
    # The newest draft `continue` (or SHIP_FROM) made (the last JSON document it printed), shipped with the command
    # that made it
    from="${SHIP_FROM:-continue}"
    case "$from" in continue) made=("${continued[@]}") ;; continue-kinds) made=("${by_kind[@]}") ;;
      *) echo "SHIP_FROM is continue or continue-kinds, not $from" >&2; exit 2 ;; esac
    draft=$(newest_draft "$from")
    .venv/bin/python scripts/ship_draft.py "$draft" \
      --command "layerscope train-draft ${made[*]}   # benchmarks/long_run.sh $from" >> "$log.log" 2>&1
    # the benchmarks that count, each waiting for a quiet machine first (the tables say what else ran); `--lookup 4`
    # adds the chosen chain with prompt lookup first (a 5-token verify costs about what a 3-token one does here)
    # into docs/bench/builtin-<the shipped draft's key>-ship-*, as bench-builtin names its tables: an earlier draft's
    # stay where docs/results.md cites them (builtin-v2-*: the draft before the one continued by kind), and a rerun
    # for the same draft replaces its own
    v="builtin-$(shipped_key)-ship"
    for spec in "sharegpt-heldout 20 $v-sharegpt-heldout" "builtin 24 $v-builtin-prompts"; do
      read -r prompts limit name <<< "$spec"
      bench_table "docs/bench/$name.txt" --draft builtin --max-new-tokens 64 --k 1,2,3 --k auto --tree auto \
        --lookup 4 --wait-quiet 10m --prompts "$prompts" --limit "$limit" --save-json "docs/bench/$name.json"
    done ;;
  bench-builtin)
    key=$(shipped_key)
    for spec in "builtin 96" "sharegpt-heldout 40"; do
      read -r prompts limit <<< "$spec"
      bench_table "docs/bench/builtin-$key-$prompts.txt" --draft builtin --k auto --tree auto --lookup auto \
        --wait-quiet 10m --prompts "$prompts" --limit "$limit" --save-json "docs/bench/builtin-$key-$prompts.json"
    done ;;
  keep)
    # the answers of this study's model only (MODEL; by default the one STUDY_DIR's study runs): each folder's
    # about.json names its model; a folder from before about.json is kept only where STUDY_DIR already keeps it
    case "$study_dir" in *study-gemma3*) keep_model="${MODEL:-gemma3-270m}" ;; *study-qwen15*) keep_model="${MODEL:-qwen2.5-coder-1.5b}" ;;
      *) keep_model="${MODEL:-smollm2-135m}" ;; esac
    for d in "$LAYERSCOPE_STORE"/responses/*/; do      # finished parts only (a part being written is a dotfile)
      [ -d "$d" ] || continue
      name=$(basename "$d")
      if [ -f "$d/about.json" ]; then
        owner=$(.venv/bin/python -c 'import json,sys; print(json.load(open(sys.argv[1])).get("model", ""))' "$d/about.json")
      elif [ -d "$study_dir/responses/$name" ]; then
        owner="$keep_model"
      else
        echo "left $name: no about.json says whose answers these are (copy it by hand if it is $keep_model's)"; continue
      fi
      if [ "$owner" != "$keep_model" ]; then echo "left $name: $owner's answers, not $keep_model's"; continue; fi
      mkdir -p "$study_dir/responses/$name"
      cp -n "$d"part-*.json "$study_dir/responses/$name/"
      [ -f "$d/about.json" ] && cp -n "$d/about.json" "$study_dir/responses/$name/"
      echo "kept $name: $(ls "$study_dir/responses/$name" | grep -c '^part-') parts"
    done ;;
  study)
    run_study smollm2-135m --train-limit 2000 --tokens 500k --no-fc-norm ;;
  gemma3-study)
    # the training data of docs/results.md's first Gemma 3 drafts (their regenerated answers are reused)
    run_study gemma3-270m --train-limit 640 --train-max-prompt-tokens 1024 --train-max-new-tokens 64 \
      --val-conversations 32 --tokens 200k --fc-norm ;;
  smollm2-fc-norm)
    run_sets smollm2-135m outcomes-fc-norm --strategies default,single --layers 19,21,27 \
      --train-limit 2000 --tokens 500k --fc-norm ;;
  gemma3-no-fc-norm)
    # the sets: the default rule's and GEMMA3_SETS (default: seed 0's best, probe [13,15,17], and worst, random#1
    # [4,7,8], of the study's first eight sets)
    read -r -a sets <<< "${GEMMA3_SETS:---layers 13,15,17 --layers 4,7,8}"
    run_sets gemma3-270m outcomes-no-fc-norm --strategies default "${sets[@]}" --train-limit 640 \
      --train-max-prompt-tokens 1024 --train-max-new-tokens 64 --val-conversations 32 --tokens 200k --no-fc-norm ;;
  qwen-stats)
    mkdir -p "$study_dir/stats"
    for model in qwen2.5-coder-1.5b qwen2.5-coder-0.5b; do
      key=$(.venv/bin/layerscope capture --model "$model" --prompts sharegpt --limit 120 --max-new-tokens 64 \
        --max-prompt-tokens 256 --batch-size 16 --json 2>> "$log.log" | .venv/bin/python -c 'import json,sys; print(json.load(sys.stdin)["key"])')
      echo "$model stats capture: $key" >> "$log.log"
      # each step's peak resident memory goes to the log (GNU time); the probe's ridge maps over 28 layers of d=1536
      # take ~9.5 GB, over its 6 GB default
      for step in "analyze $key" "select $key --compare" "probe $key --search swap --k 3 --max-memory-gb 14"; do
        read -r -a argv <<< "$step"
        /usr/bin/time -f "$model ${argv[0]}: %e s, peak RSS %M KB" .venv/bin/layerscope "${argv[@]}" --json \
          > "$study_dir/stats/$model-${argv[0]}.json" 2>> "$log.log"
      done
      # the probe's score of every strategy's set (held-out agreement with intervals), beside its own search's best
      sets=$(.venv/bin/python -c 'import json,sys; print(" ".join("--layers " + ",".join(map(str, r["layers"])) for r in json.load(open(sys.argv[1]))))' \
        "$study_dir/stats/$model-select.json")
      /usr/bin/time -f "$model probe-sets: %e s, peak RSS %M KB" .venv/bin/layerscope probe "$key" $sets --max-memory-gb 14 \
        --json > "$study_dir/stats/$model-probe-sets.json" 2>> "$log.log"
    done ;;
  qwen-study)
    copy_responses
    key=$(.venv/bin/layerscope capture --model qwen2.5-coder-1.5b --prompts sharegpt --limit 120 --max-new-tokens 64 \
      --max-prompt-tokens 256 --batch-size 16 --json 2>> "$log.log" | .venv/bin/python -c 'import json,sys; print(json.load(sys.stdin)["key"])')
    echo "study capture: $key" >> "$log.log"
    exec .venv/bin/layerscope study "$key" --strategies default,aggregate,probe,random --random-sets 1 \
      --online --train-prompts sharegpt --train-kinds code=3 --responses regenerate --train-limit "${TRAIN_LIMIT:-1200}" \
      --train-max-prompt-tokens 256 --train-max-new-tokens 192 --tokens "${TOKENS:-1M}" --fc-norm --seeds 0 \
      --draft-intermediate "${DRAFT_INTERMEDIATE:-1024}" --train-dtype "${TRAIN_DTYPE:-bfloat16}" \
      --sets-per-pass 4 --outcomes "$study_dir/outcomes" --limit 40 --max-new-tokens 64 --wait-quiet 10m \
      --json >> "$log.json" 2>> "$log.log" ;;
  qwen-continue)
    # the study's recipe (docs/results.md, "Qwen2.5-Coder 1.5B"), its learning curve still rising at 1M tokens: more
    # answers and more tokens, from the shipped weights (a fresh optimizer and schedule over the added budget) at a
    # lower peak rate (QWEN_LR 3e-4): the study's 1e-3 took the held-out agreement at position 1 from 0.372 to 0.321
    # in the first 127k tokens (run 94c5a96919c7399c16827c42, stopped there)
    copy_responses
    exec .venv/bin/layerscope train-draft "${qwen_continued[@]}" --json >> "$log.json" 2>> "$log.log" ;;
  qwen-ship)
    # after qwen-continue: its draft shipped as the 1.5B's --draft builtin (replacing the slot of its layers), with
    # the command that made it; then `qwen-bench` measures it. Run it from the work tree you commit from
    .venv/bin/python scripts/ship_draft.py "$(newest_draft qwen-continue)" --model qwen2.5-coder-1.5b \
      --command "layerscope train-draft ${qwen_continued[*]}   # benchmarks/long_run.sh qwen-continue" >> "$log.log" 2>&1 ;;
  qwen-bench)
    # issue 50's done-when, quiet, all cores: QWEN_DRAFT (default builtin: the shipped one; a store key or folder to
    # measure a draft before shipping it) with --k auto --tree auto --lookup auto against plain decoding, HF
    # generate, HF prompt lookup and the 0.5B as assistant_model, on the 12 builtin coding prompts and 40 held-out
    # ShareGPT code conversations (docs/study-qwen15/bench-code.jsonl, benchmarks/code_prompts.py) x 64 tokens
    name="qwen15-$(echo "${QWEN_DRAFT:-builtin}" | tr -c 'A-Za-z0-9\n' '-' | cut -c1-24)-code"
    bench_table "docs/bench/$name.txt" --model qwen2.5-coder-1.5b --draft "${QWEN_DRAFT:-builtin}" \
      --assistant qwen2.5-coder-0.5b --k auto --tree auto --lookup auto --prompts docs/study-qwen15/bench-code.jsonl \
      --limit 52 --max-new-tokens 64 --max-prompt-tokens 256 --wait-quiet 10m --save-json "docs/bench/$name.json" ;;
  *) echo "usage: $0 default|continue|continue-kinds|ship|bench-builtin|study|keep|gemma3-study|smollm2-fc-norm|gemma3-no-fc-norm|qwen-stats|qwen-study|qwen-continue|qwen-ship|qwen-bench" >&2
     exit 2 ;;
esac
