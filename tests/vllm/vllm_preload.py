"""Imported once by ``engine_proc``'s fork server, whose children are the
vLLM engines of the tests: vLLM's test environment (``tiny_model.vllm_env``,
part of which vLLM and its libraries read when imported), then vLLM itself,
about 10 s of CPU that no child pays again. Imports vLLM: nothing else may
import this module."""

from tiny_model import apply_vllm_env

apply_vllm_env()

import vllm.entrypoints.llm  # noqa: E402,F401
