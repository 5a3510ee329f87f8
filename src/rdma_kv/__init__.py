"""rdma-kv: zero-copy KV-cache transfer over one-sided UCX reads.

Importing this package is cheap and side-effect free: it loads no UCX
library, probes no hardware, sets no environment variable and never imports
vLLM. The transport loads UCX on first use; ``rdma_kv.vllm`` is the only
module that imports vLLM.
"""

import logging

from rdma_kv.errors import RdmaKVError

__version__ = "0.1.0"
__all__ = ["RdmaKVError", "__version__"]

logging.getLogger(__name__).addHandler(logging.NullHandler())
