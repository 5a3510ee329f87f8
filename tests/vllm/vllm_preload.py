"""Imported once by ``engine_proc``'s fork server, whose children are the
vLLM engines and OpenAI servers of the tests: vLLM's test environment
(``tiny_model.vllm_env``, part of which vLLM and its libraries read when
imported), then vLLM itself and its OpenAI server, about 10 s of CPU that
no child pays again. Imports vLLM: nothing else may import this module."""

import importlib

from tiny_model import apply_vllm_env

apply_vllm_env()

# What `python -m vllm.entrypoints.openai.api_server` runs (that module
# itself is left to the server child, which runs it as __main__).
importlib.import_module("vllm.entrypoints.launchers.api_server.entry")
importlib.import_module("vllm.entrypoints.llm")
