"""A tiny random-weight Llama and a local tokenizer for tests that run vLLM.

Nothing is downloaded: the weights are random (seeded), the tokenizer is a
word-level ``tokenizers`` model built from a fixed vocabulary, and both are
written with ``save_pretrained`` so that ``vllm.LLM(model=path)`` loads them
with ``HF_HUB_OFFLINE=1``. Also the knobs that make vLLM's CPU build run in
seconds on 2 cores (``vllm_env``, ``llm_kwargs``), a vLLM child's own
temporary directory (``PrivateTmp``) and greedy-generation helpers
(``make_llm``, ``greedy``, ``generate_greedy``).

Imports torch, transformers and tokenizers only inside ``build_tiny_llama``
and vLLM only inside the generation helpers, so importing this module is
free.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "BLOCK_SIZE",
    "CPU_HEAD_SIZES",
    "KV_CACHE_MEMORY_BYTES",
    "MAX_MODEL_LEN",
    "PROMPTS",
    "PrivateTmp",
    "UNSET_ENV",
    "apply_vllm_env",
    "build_tiny_llama",
    "generate_greedy",
    "greedy",
    "make_llm",
    "shutdown_llm",
    "llm_kwargs",
    "vllm_env",
]

BLOCK_SIZE = 32
"""vLLM 0.32's CPU attention declares block sizes ``MultipleOf(32)``."""

CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""``CPUAttentionBackend.get_supported_head_sizes()`` in vLLM 0.32: a head
of 16 (hidden 64 / 4 heads) is rejected by the kernel at the first step."""

MAX_MODEL_LEN = 256
KV_CACHE_MEMORY_BYTES = 16 << 20
"""16 MiB of KV cache: for the default tiny model (2 layers x 2 KV heads x
head 32, fp32, block 32) a block is 16 KiB per layer, so 512 blocks, plenty
for a few short prompts. Passed as ``kv_cache_memory_bytes``; the CPU
platform's legacy ``VLLM_CPU_KVCACHE_SPACE`` (whole GiB only) overrides it
when set, so ``apply_vllm_env`` removes it (see ``UNSET_ENV``)."""

# Prompts of 7, 37 and 71 tokens (BOS + one token per word): shorter than a
# block, one block plus 5, two blocks plus 7 (block 32).
PROMPTS: tuple[str, ...] = (
    "the cat sat on the mat",
    " ".join(["a quick brown fox jumps over the lazy dog"] * 4),
    " ".join(["to be or not to be that is the question"] * 7),
)

_CORPUS = """
the cat sat on the mat and the dog sat on the log
a quick brown fox jumps over the lazy dog
to be or not to be that is the question
whether tis nobler in the mind to suffer the slings and arrows
of outrageous fortune or to take arms against a sea of troubles
all the world is a stage and all the men and women merely players
they have their exits and their entrances
one two three four five six seven eight nine ten
red green blue yellow black white orange purple
hello world prefill decode cache block token layer head
"""

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")


def _words(text: str) -> list[str]:
    return text.split()


def _build_tokenizer(vocab_size: int, max_len: int = MAX_MODEL_LEN) -> Any:
    """A word-level tokenizer over ``_CORPUS`` plus filler words, exactly
    ``vocab_size`` entries, with BOS prepended by its post-processor."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, decoders
    from transformers import PreTrainedTokenizerFast

    vocab: dict[str, int] = {}
    for word in (*SPECIAL_TOKENS, *_words(_CORPUS)):
        vocab.setdefault(word, len(vocab))
    if len(vocab) > vocab_size:
        raise ValueError(f"vocab={vocab_size} is smaller than the {len(vocab)} built-in words")
    filler = 0
    while len(vocab) < vocab_size:
        vocab.setdefault(f"w{filler}", len(vocab))
        filler += 1

    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    bos_id = vocab["<s>"]
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=max_len,
    )


def build_tiny_llama(
    path: str | os.PathLike[str],
    *,
    num_layers: int = 2,
    hidden: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 512,
    seed: int = 0,
    layer_types: Sequence[str] | None = None,
    sliding_window: int | None = None,
    max_len: int = MAX_MODEL_LEN,
) -> str:
    """Write a random-weight fp32 Llama and its tokenizer into ``path``.

    Deterministic for a given ``seed`` and shape. Returns ``str(path)``.
    Skips the work when ``path`` already holds a model with the same
    parameters (the saved ``tiny_llama.json`` matches).

    ``layer_types`` (one of ``"sliding_attention"``, ``"full_attention"``
    per layer) and ``sliding_window`` make a hybrid model: vLLM gives the
    sliding layers a ``SlidingWindowSpec`` and, with its hybrid KV-cache
    manager, a KV-cache group of their own. The weights do not depend on
    them (HF's Llama ignores both; vLLM's reads them from config.json).
    """
    out = Path(path)
    params: dict[str, Any] = dict(
        num_layers=num_layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
        vocab=vocab, seed=seed,
    )
    if max_len != MAX_MODEL_LEN:  # (benchmarks: long prompts) the marker of older dirs stays valid
        params["max_len"] = max_len
    hybrid: dict[str, Any] = {}
    if layer_types is not None:
        if len(layer_types) != num_layers:
            raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
        if sliding_window is None:
            raise ValueError("layer_types with sliding layers needs sliding_window")
        hybrid = dict(layer_types=list(layer_types), sliding_window=sliding_window)
        params.update(hybrid)
    marker = out / "tiny_llama.json"
    if marker.exists() and json.loads(marker.read_text()) == params:
        return str(out)
    if hidden % heads or heads % kv_heads:
        raise ValueError(f"hidden % heads and heads % kv_heads must be 0, got {params}")
    if hidden // heads not in CPU_HEAD_SIZES:
        raise ValueError(
            f"head_dim = hidden / heads = {hidden // heads}; vLLM's CPU attention "
            f"supports only {CPU_HEAD_SIZES} (0.32 fails at the first step otherwise)"
        )

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = _build_tokenizer(vocab, max_len)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_len,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
        **hybrid,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    # Random init gives near-uniform logits; a wider spread lets each greedy
    # token win by a clear margin rather than by float noise, so two runs
    # that should agree (plain vs P/D) do not diverge on rounding alone.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    marker.write_text(json.dumps(params))
    return str(out)


def vllm_env(*, multiprocessing: bool = False) -> dict[str, str]:
    """Environment for running vLLM's CPU build on a shared 2-core machine.

    ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps engine core and worker in the
    calling process (about half the start-up time). Apply it before
    ``import vllm`` (vLLM reads some of these lazily, some at import).
    """
    return {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocessing else "0",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "OMP_NUM_THREADS": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "TOKENIZERS_PARALLELISM": "false",
    }


UNSET_ENV = ("VLLM_CPU_KVCACHE_SPACE",)
"""Variables to remove: the CPU platform turns VLLM_CPU_KVCACHE_SPACE (whole
GiB) into kv_cache_memory_bytes, overriding ours, and an empty value is not
"unset" to vLLM (``int('')`` fails when the engine caches its env)."""


def apply_vllm_env(environ: Any = os.environ, *, multiprocessing: bool = False) -> None:
    """``vllm_env`` applied to ``environ`` (set, and ``UNSET_ENV`` removed)."""
    environ.update(vllm_env(multiprocessing=multiprocessing))
    for key in UNSET_ENV:
        environ.pop(key, None)


class PrivateTmp:
    """A directory of one vLLM child's own for its temporary files.

    vLLM binds its ZMQ IPC sockets at ``ipc://$VLLM_RPC_BASE_PATH/<uuid4>``
    (``vllm.utils.network_utils.get_open_zmq_ipc_path``; the variable
    defaults to ``tempfile.gettempdir()``, that is ``$TMPDIR`` or /tmp) and
    unlinks them only on a clean exit: an engine killed by a test leaves
    them behind, thousands over a run. ``env`` points both variables here;
    the owner calls ``remove()`` once the child is gone, SIGKILLed or not.
    Made directly under the system's temporary directory with a short
    name, never in a pytest ``tmp_path``: a socket's path must fit
    ``sun_path`` (107 bytes) with the 36-character uuid."""

    def __init__(self, name: str) -> None:
        self.path = tempfile.mkdtemp(prefix=f"vllm-tmp-{name[:16]}-")

    @property
    def env(self) -> dict[str, str]:
        return {"TMPDIR": self.path, "VLLM_RPC_BASE_PATH": self.path}

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def llm_kwargs(model_path: str, **overrides: Any) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM`` that fit the tiny model on CPU."""
    kwargs: dict[str, Any] = dict(
        model=model_path,
        tokenizer=model_path,
        dtype="float32",
        block_size=BLOCK_SIZE,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=8,
        max_num_batched_tokens=MAX_MODEL_LEN,
        kv_cache_memory_bytes=KV_CACHE_MEMORY_BYTES,
        enforce_eager=True,
        seed=0,
        enable_prefix_caching=False,
    )
    kwargs.update(overrides)
    return kwargs


def make_llm(
    model_path: str,
    *,
    kv_transfer_config: Mapping[str, Any] | None = None,
    **llm_overrides: Any,
) -> Any:
    """A ``vllm.LLM`` for the tiny model (``llm_kwargs``), with a connector
    when ``kv_transfer_config`` is given. Set the environment first."""
    from vllm import LLM

    kwargs = llm_kwargs(model_path, **llm_overrides)
    if kv_transfer_config is not None:
        kwargs["kv_transfer_config"] = dict(kv_transfer_config)
    return LLM(**kwargs)


def greedy(
    llm: Any,
    prompts: Sequence[str] = PROMPTS,
    *,
    max_tokens: int = 8,
    kv_transfer_params: Sequence[Mapping[str, Any] | None] | None = None,
) -> list[dict[str, Any]]:
    """Greedy generation on ``llm``, all prompts submitted together; one dict
    per prompt with ``request_id``, ``prompt_token_ids``, ``token_ids``,
    ``text``, ``finish_reason`` and ``kv_transfer_params`` (what the
    connector's ``request_finished`` returned, or None).

    ``kv_transfer_params[i]`` goes to prompt ``i`` the way vLLM 0.32 reads
    it: ``SamplingParams(extra_args={"kv_transfer_params": ...})``.
    ``ignore_eos`` keeps every output ``max_tokens`` long.
    """
    from vllm import SamplingParams

    params = []
    for i in range(len(prompts)):
        extra = None
        if kv_transfer_params is not None and kv_transfer_params[i] is not None:
            extra = {"kv_transfer_params": dict(kv_transfer_params[i])}
        params.append(SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                     ignore_eos=True, extra_args=extra))
    outputs = llm.generate(list(prompts), params, use_tqdm=False)
    return [
        {
            "request_id": o.request_id,
            "prompt_token_ids": list(o.prompt_token_ids),
            "token_ids": list(o.outputs[0].token_ids),
            "text": o.outputs[0].text,
            "finish_reason": o.outputs[0].finish_reason,
            "kv_transfer_params": o.kv_transfer_params,
        }
        for o in outputs
    ]


def shutdown_llm(llm: Any) -> None:
    """Stop the engine now (scheduler and worker connectors get
    ``shutdown()``), rather than whenever the garbage collector runs."""
    llm.llm_engine.engine_core.shutdown()


def generate_greedy(
    model_path: str,
    prompts: Sequence[str] = PROMPTS,
    *,
    max_tokens: int = 8,
    kv_transfer_config: Mapping[str, Any] | None = None,
    kv_transfer_params: Sequence[Mapping[str, Any] | None] | None = None,
    **llm_overrides: Any,
) -> list[dict[str, Any]]:
    """``make_llm`` + ``greedy`` + ``shutdown_llm``: one engine, one batch."""
    llm = make_llm(model_path, kv_transfer_config=kv_transfer_config, **llm_overrides)
    try:
        return greedy(llm, prompts, max_tokens=max_tokens,
                      kv_transfer_params=kv_transfer_params)
    finally:
        shutdown_llm(llm)
