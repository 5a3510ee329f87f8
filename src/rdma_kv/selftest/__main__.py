"""``python -m rdma_kv.selftest [options]``: the same as ``rdma-kv selftest``."""

import sys

from rdma_kv.cli import main

sys.exit(main(["selftest", *sys.argv[1:]]))
