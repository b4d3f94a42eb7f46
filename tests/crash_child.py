"""Fault injection for tests/reliability/test_faults.py: kill -9 a process at each rename point of a store write.

    python tests/crash_child.py capture ROOT   # ROOT/kill-<n>: a capture killed before its n-th rename
    python tests/crash_child.py session ROOT   # ROOT/kill-<n>: a session save killed before its n-th rename

Imports and loads once, then forks one child per kill point n = 1, 2, ...; the child counts os.replace
calls (every rename-into-place in the store goes through it) and sends itself SIGKILL just before
the n-th. The first n whose child finishes without reaching it is the run without a kill, and ends
the loop. Prints one JSON line per n: {"n", "killed"}.
"""

import json
import os
import signal
import sys
from pathlib import Path

from layerscope.capture.run import capture
from layerscope.prompts.sets import load_prompts
from layerscope.session.model import Session
from layerscope.session.storage import save
from layerscope.store import Store
from layerscope.target.load import load_model

CAPTURE = dict(limit=4, batch_size=2, max_new_tokens=3)


def kill_at(n: int) -> None:
    real, count = os.replace, [0]

    def replace(src, dst, *a, **kw):
        count[0] += 1
        if count[0] == n:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(src, dst, *a, **kw)
    os.replace = replace


def main(what: str, root: Path) -> None:
    model = load_model("tiny-llama") if what == "capture" else None
    prompts = load_prompts("builtin", limit=CAPTURE["limit"]) if what == "capture" else None
    for n in range(1, 50):
        store_root = root / f"kill-{n}"
        if what == "session":      # a saved first version that the killed save must not lose
            first = Session(id="0123456789ab", name="first", model="tiny-llama")
            save(first, Store(store_root))
        pid = os.fork()
        if pid == 0:
            kill_at(n)
            store = Store(store_root)
            if what == "capture":
                capture(model, prompts, store, **CAPTURE)
            else:
                second = Session(id="0123456789ab", name="second version", model="tiny-llama", notes="x" * 5000)
                save(second, store)
            store.close()
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        print(json.dumps({"n": n, "killed": killed, "status": status}), flush=True)
        if not killed:
            break


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
