"""The side channel's protocol version, and what each version changed.

Both ends of a side-channel connection must speak the same version
(``wire``'s messages each carry it); this module keeps the number and its
history, which the messages' own docstrings refer to by number.

Imports nothing.
"""

PROTOCOL_VERSION = 15
"""The side channel's version: both ends must speak the same one. A peer of
another version is refused with a message naming both versions (a version-1
producer answers HELLO with ``error``, which the client reports as a version
mismatch). Each version, and what changed under it without a new number
(fields added with a default, which an older peer of the same version
refuses as unknown: ``forbid_unknown_fields``):

1. First release (2026-11-22). HANDSHAKE ``{version, engine_id, tp_rank,
   compat}`` answered ``handshake_ok{version, engine_id, tp_rank, compat,
   compat_hash, agent_metadata, geometry}``; RENEW, CONFIRM (with
   ``release``) and RELEASE of ``[epoch, generation, request_id]`` answered
   HELD, PENDING or GONE. ``CompatInfo`` named ``num_kv_heads`` and
   ``tp_size``.
2. (2026-11-22) Every connection opens with HELLO -> CHALLENGE and, when
   the producer has a shared secret, AUTH -> AUTH_OK (``auth``); a peer's
   geometry is capped (``MAX_BLOCKS_PER_LAYER``, ``MAX_SLOTS``). Later under
   2: ``CompatInfo`` gained ``kv_layout`` and ``attention_backend``.
3. (2026-11-24) A lease names its grant ``token`` and the consumer's
   ``claim``; CLAIMED and UNKNOWN answers.
4. (2026-11-24) A lease call names the consumer rank making it (``reader``)
   and how many consumer ranks read this producer rank under the lease
   (``readers``): the lease ends when all of them released. Later under 4
   (heterogeneous tensor parallel, hybrid models): HANDSHAKE and its reply
   name a ``RankInfo`` (``tp_rank, tp_size, num_kv_heads``) instead of
   ``tp_rank``; ``CompatInfo`` names ``total_kv_heads`` instead of
   ``num_kv_heads`` and drops ``tp_size``, and gained ``layer_groups``; a
   geometry layer gained ``head_nbytes`` and ``group``.
5. (2026-11-25) A lease call carries the lease's ``binding``
   (``params.lease_binding``: engine, TP size, token count and block ids of
   every group), which the grant token covers; FORGED answers a genuine
   token presented with other block ids. Later under 5 (sleep mode): the
   handshake reply names the producer's KV-cache ``registration`` (default
   1), and the binding covers it.
6. (2026-11-26) Push mode (``mode: "push"``): ``CompatInfo`` names the
   ``transfer_mode`` (a pull engine and a push engine refuse each other at
   the handshake); PUSH_HELLO (the decode's agent metadata and geometry),
   PUSH (a lease, the decode's allocation ``token`` and both sides' block
   ids: the producer writes those blocks) and PUSH_QUERY (state, or abort)
   answered ``push{state, detail, writes_end_within_s}``.
7. (2026-11-26) PIN at post: RENEW names ``pin``; a HELD answer to a pin
   also holds the lease against expiry, reclaim and sleep for the reply's
   ``pinned_s`` (the shortest granted among the HELD ones) from the
   producer's answer. A consumer that pins when it posts its reads, and
   whose reads land within ``pinned_s`` of sending the pin, trusts them
   without a CONFIRM and releases the lease with a RELEASE it does not
   wait for; otherwise it CONFIRMs as before.
8. (2026-11-27) No new field; what a PUSH_QUERY answer means changed, and
   the decode's safety rests on it: an ``abort`` for a token the producer
   never took is remembered (ABORTED), so a PUSH of that token arriving
   later writes nothing, and the decode gives up a PUSH that got no answer
   only on that; a plain query's UNKNOWN means "not taken yet" (the decode
   sends the PUSH again). A version-7 producer would write such a late PUSH.
9. (2026-11-29) PUSH_HELLO, PUSH and PUSH_REG name the decode worker's
   ``incarnation`` (8 random bytes drawn when the worker starts): the
   producer knows a decode rank by engine id, rank and incarnation, so two
   decode engines given one ``engine_id`` each get their own writes (under
   version 8 the producer wrote both decodes' pushes into one of them).
10. (2026-11-29) ``CompatInfo`` names the model (``model_id``; compared
    only when both sides name one) and an fp8 cache's k/v scales
    (``kv_cache_scales``): two models of one shape, or one model under
    other fp8 scales, refuse each other at the handshake (under version 9
    each read the other's KV). A new number, not a field added under 9: a
    version-9 peer would not compare them, and the safety of a load rests
    on both ends comparing (the consumer checks the producer's reply too).
11. (2026-11-30) The prompt binds both legs. The params carry
    ``remote_prompt_digest`` (``params.prompt_digest``: BLAKE2b of the
    prompt's token ids) and the lease's ``binding`` covers it, so the
    decode refuses params of another prompt of the same length, and
    params whose digest was edited answer FORGED. PUSH_REG names the
    decode's ``prompt_digest``: the producer writes a registration only
    the KV of a prefill of that digest (REFUSED otherwise, nothing
    written). A new number: a version-10 producer's params name no digest
    and its lease bindings differ, and a version-10 producer would write
    a registration from any prefill under its transfer id. Later under
    11 (2026-12-01): the digest covers the request's ``extra_keys`` too
    (the LoRA adapter, images, cache salt, prompt embeddings), a text
    prompt's unchanged; a peer from before digests such a request by its
    token ids alone, so its loads are refused (computed locally), never
    wrong.
12. (2026-12-02) Held words (``heldwords``): the handshake reply names
    the producer rank's ``words`` (``[base_address, nbytes]``: 16 bytes
    per block, in the memory its agent metadata registers), each naming
    the live lease that holds the block. A consumer reads its blocks'
    words after its data and trusts the data without a PIN or CONFIRM
    when every word names its lease. A new number: a version-11 consumer
    refuses the field (``forbid_unknown_fields``), and a version-11
    producer writes no words.
13. (2026-12-03) PUSH_HELLO names the decode's ``link``: the transport
    peer (one per handshake) under which the decode imported this
    producer rank. The decode introduces itself once per link, and the
    producer imports the decode afresh when the link is new. UCX pairs the
    producer's endpoint to the decode with the decode's endpoint to the
    producer by the order in which each side made them, and the decode's
    fence (a forced close of its endpoint) stops the producer's writes
    only through that pairing: under version 12 a decode that dialled the
    producer again (after an idle prune) skipped the hello, the producer
    kept writing on its first endpoint, and a fence of the new one let an
    abandoned write land in blocks already handed back. A new number: a
    version-12 producer refuses the field, and would not import afresh.
14. (2026-12-03) PUSH_HELLO names the link's ``ordinal``: the number the
    decode's endpoint for the link has among those its worker made to the
    producer rank's worker. The producer imports the decode with that
    number (``Agent.add_peer(..., ordinal=)``: endpoints it never made,
    links of the decode's it never imported, are made and closed first),
    and refuses a hello whose number it passed already (a stale one). An
    introduction whose answer was lost left the decode not knowing
    whether the producer had imported it; when it had not, the two
    counts stayed one apart and every later fence missed. PUSH and
    PUSH_REG name the ``link`` they are sent on, and the producer writes
    them only over its import for that link. The handshake reply and every
    push answer name the ``life`` of the producer's transport (8 random
    bytes per worker start and per wake; empty asleep): an abort of a PUSH
    that got no answer, answered "never taken" by another life than the
    one the decode dialled, is fenced. Both sides'
    imports are ``paired`` (one endpoint, the transport's own worker)
    since the same day, without a new number. A new number: a version-13
    producer refuses the field.
15. (2026-12-03) PUSH_HELLO names the ``life`` of the producer's
    transport that answered the link's handshake; a pusher of another life
    (the producer slept and woke in between) refuses it before importing
    anything. Its ``ordinal`` counts the decode's endpoints to that life's
    worker: imported by the new worker, the decode's record there held a
    number of the old worker's, and the decode's next dials (its first
    endpoints to the new worker) were refused "out of date" until they
    passed it. A new number: a version-14 producer refuses the field.
"""
