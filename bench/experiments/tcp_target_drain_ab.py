"""A/B of Worker.drain against UCX 1.22's purge of a TCP target's queued
answers (docs/reliability.md, "a TCP target that closes after its peer
failed it"): runs tests/transport/tcp_teardown_child.py in this process,
with the drain (``on``) or without it (``off``: Worker.drain does nothing,
as before). Prints, on stderr at exit, how many worker closes had to wait
for a flush (``on``) -- each one a close that would have destroyed the
worker with requests queued.

    python bench/experiments/tcp_target_drain_ab.py on|off ROUNDS SEED thread 1

Run it many times beside a busy loop and count segfaults (rc -11) and
UCX's "was not returned to mpool" lines: bench/experiments/tcp_target_drain_ab.sh.
"""

from __future__ import annotations

import atexit
import logging
import pathlib
import runpy
import sys

HERE = pathlib.Path(__file__).resolve().parent
CHILD = HERE.parent.parent / "tests" / "transport" / "tcp_teardown_child.py"

arm = sys.argv.pop(1)
if arm not in ("on", "off"):
    raise SystemExit("usage: tcp_target_drain_ab.py on|off ROUNDS SEED PROGRESS LANES")
from rdma_kv.transport import ucx  # noqa: E402

counts = {"drains": 0, "waited": 0, "gave_up": 0}
if arm == "off":
    ucx.Worker.drain = lambda self: True  # type: ignore[method-assign]
else:
    real = ucx.Worker.drain

    def counted(self: ucx.Worker) -> bool:
        counts["drains"] += 1
        ok = real(self)
        counts["gave_up"] += not ok
        return ok
    ucx.Worker.drain = counted  # type: ignore[method-assign]

    class Waited(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("worker drained"):
                counts["waited"] += 1
    ucx.log.addHandler(Waited())
    ucx.log.setLevel(logging.DEBUG)
atexit.register(lambda: print(f"drain-stats arm={arm} {counts}", file=sys.stderr, flush=True))
sys.path.insert(0, str(CHILD.parent))
sys.argv[0] = str(CHILD)
runpy.run_path(str(CHILD), run_name="__main__")
