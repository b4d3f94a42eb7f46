"""A server killed mid-job, for tests/test_worker.py: a JobManager (process mode, records in ROOT/jobs) runs a long
capture of the tiny model for session OWNER in a worker process; once the capture decodes, this prints "running"
and waits to be killed.

    python tests/server_child.py ROOT OWNER
"""

import sys
import time

from layerscope.store import Store
from layerscope.ui import tasks
from layerscope.ui.jobs import JobManager


def main(root: str, owner: str) -> None:
    store = Store(root)
    manager = JobManager(mode="process", records=store.root / "jobs")
    job = manager.submit(owner, "capture", tasks.capture_job(model="tiny-llama", prompts="builtin", limit=60,
                                                             max_new_tokens=64, batch_size=1, seed=5, store=store),
                         title="Capture of tiny-llama")
    while not job.view().metrics.get("conversations_total"):       # the worker has the model and decodes
        assert job.view().running, job.view().error
        time.sleep(0.1)
    print("running", flush=True)
    time.sleep(600)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
