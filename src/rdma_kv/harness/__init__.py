"""A small engine that drives KV connectors, and the ``rdma-kv demo``.

``engine`` holds the engine (and, in its docstring, how to embed rdma-kv in
an engine), ``blocks`` its block pool, ``kvfill`` the deterministic KV content, ``process`` an engine
in a child process (``forked``: what makes its fork a faithful child), ``demo`` the prefill -> decode demo. Imports torch.
"""
