"""``python -m rdma_kv <command> ...``: the same as ``rdma-kv <command> ...``
(for an environment whose scripts are not on PATH, or a source tree run
with ``PYTHONPATH=src``, as on the GPU node of deploy.md section 10)."""

import sys

from rdma_kv.cli import main

sys.exit(main(sys.argv[1:]))
