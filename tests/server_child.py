"""A server killed mid-job, for tests/ui/test_worker.py: a JobManager (process mode, records in ROOT/jobs) runs a long
capture of the tiny model for session OWNER in a worker process; once the capture decodes, this prints "running"
and waits to be killed. With QUEUED (a second session's id) the manager runs one job at a time and a capture of
QUEUED waits behind the first one.

    python tests/server_child.py ROOT OWNER [QUEUED]
"""

import sys
import time

from layerscope.store import Store
from layerscope.ui import tasks
from layerscope.ui.jobs import JobManager


def main(root: str, owner: str, queued: str | None = None) -> None:
    store = Store(root)
    manager = JobManager(mode="process", records=store.root / "jobs", max_running=1)
    job = manager.submit(owner, "capture", tasks.capture_job(model="tiny-llama", prompts="builtin", limit=60,
                                                             max_new_tokens=64, batch_size=1, seed=5, store=store),
                         title="Capture of tiny-llama")
    if queued:
        manager.submit(queued, "capture", tasks.capture_job(model="tiny-llama", prompts="builtin", limit=2,
                                                            max_new_tokens=4, batch_size=1, seed=6, store=store),
                       title="Second capture of tiny-llama")
    while not job.view().metrics.get("conversations_total"):       # the worker has the model and decodes
        assert job.view().running, job.view().error
        time.sleep(0.1)
    print("running", flush=True)
    time.sleep(600)


if __name__ == "__main__":
    main(*sys.argv[1:4])
