"""One of two app servers on one store, for tests/reliability/test_concurrency.py: what a server does for a tab, through the
functions the app calls (storage.load and storage.save as ui.state does, a capture job in a JobManager, its result
applied as ui.apply.collect applies it).

    python tests/two_servers_child.py ROOT ROLE SID TOKEN SYNC     # ROLE: a or b; SYNC: a folder both can see

Both servers have session SID open in a tab (the same browser: its owner cookie is sent to both). Each starts the
same capture for a session of its own, saved under the name "from ROLE". Then server a's tab takes that capture too
and saves SID (ui.apply.collect); server b's tab, which has not run since it read SID, adds a layer set and saves
SID. Files in SYNC order the steps: ROLE.loaded, ROLE.waiting (its capture waits for the store's lock), a.saved.
Prints one JSON line: {"cached", "key", "own"}.
"""

import json
import sys
import time
from pathlib import Path

from layerscope.session import storage
from layerscope.session.model import Session, owner_hash
from layerscope.store import Store
from layerscope.ui import apply, tasks
from layerscope.ui.jobs import JobManager


def wait_file(path: Path, timeout: float = 300.0) -> None:
    t0 = time.time()
    while not path.exists():
        assert time.time() - t0 < timeout, f"timed out waiting for {path.name}"
        time.sleep(0.05)


def main(root: str, role: str, sid: str, token: str, sync: str) -> None:
    store, sync = Store(root), Path(sync)
    tab = storage.load(store, sid)                     # the tab this server shows, as it read SID
    (sync / f"{role}.loaded").touch()
    wait_file(sync / f"{'b' if role == 'a' else 'a'}.loaded")

    own = Session(owner=owner_hash(token), model="tiny-llama")
    manager = JobManager(mode="thread")
    job = manager.submit(own.id, "capture", tasks.capture_job(model="tiny-llama", prompts="builtin", limit=4,
                                                               max_new_tokens=4, batch_size=2, seed=0, store=store),
                         title="Capture of tiny-llama")
    while not job.wait(0.05):
        if job.view().message.startswith("waiting"):
            (sync / f"{role}.waiting").touch()
    assert job.view().finished_ok, (job.view().error, job.view().fix)
    apply.capture_result(own, job.result)
    storage.save(own, store, name=f"from {role}")

    if role == "a":
        apply.capture_result(tab, job.result)         # this server's tab takes the capture (collect) and saves SID
        storage.save(tab, store)
        (sync / "a.saved").touch()
    else:
        wait_file(sync / "a.saved")
        tab.add_layer_set("mine", [1, 2])              # a change in the other server's tab, not rerun since it read SID
        storage.save(tab, store)
    print(json.dumps({"cached": job.result["cached"], "key": job.result["key"], "own": own.id}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:6])
