"""A minimal prefill -> decode router for the 1P1D examples (compose, k8s).

For each OpenAI completion / chat-completion request:

1. send it to a prefill engine with ``kv_transfer_params =
   {"do_remote_decode": true}``, ``max_tokens = 1`` and no streaming;
2. take the ``kv_transfer_params`` of that response (the producer's lease
   and block ids, rdma-kv's ``docs/rdma-connector.md``) and send the
   original request to a decode engine with them, streaming or not as the
   client asked, relaying the answer.

This is the NixlConnector router convention, so vLLM's own P/D proxies
work as well; this one exists so the image is self-contained. Round-robin
over the engines given; no retries, no health checks: a sketch for the
examples, not a production router.

    python router.py --prefill http://p0:8100 --decode http://d0:8200 --port 8000

Uses fastapi, httpx and uvicorn (dependencies of vLLM).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse


def build_app(prefill: list[str], decode: list[str], timeout_s: float = 600.0) -> FastAPI:
    prefill_rr, decode_rr = itertools.cycle(prefill), itertools.cycle(decode)
    client = httpx.AsyncClient(timeout=timeout_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await client.aclose()

    app = FastAPI(title="rdma-kv 1P1D router", lifespan=lifespan)

    async def route(path: str, request: Request) -> Response:
        body: dict[str, Any] = await request.json()
        request_id = request.headers.get("x-request-id") or str(uuid.uuid4())
        headers = {"x-request-id": request_id}
        first = dict(body, max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
        first.pop("max_completion_tokens", None)
        first.pop("stream_options", None)
        r = await client.post(f"{next(prefill_rr)}{path}", json=first, headers=headers)
        if r.status_code != 200:
            return JSONResponse(r.json() if r.headers.get("content-type", "").startswith("application/json")
                                else {"error": r.text}, status_code=r.status_code)
        params = r.json().get("kv_transfer_params")
        second = dict(body, kv_transfer_params=params) if params else dict(body)
        url = f"{next(decode_rr)}{path}"
        if not body.get("stream"):
            d = await client.post(url, json=second, headers=headers)
            return Response(d.content, status_code=d.status_code, media_type=d.headers.get("content-type"))

        async def relay():
            async with client.stream("POST", url, json=second, headers=headers) as d:
                async for chunk in d.aiter_bytes():
                    yield chunk

        return StreamingResponse(relay(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await route("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await route("/v1/chat/completions", request)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", action="append", required=True, help="prefill engine base URL (repeatable)")
    ap.add_argument("--decode", action="append", required=True, help="decode engine base URL (repeatable)")
    ap.add_argument("--host", default="0.0.0.0")
    ap.add_argument("--port", type=int, default=8000)
    args = ap.parse_args()
    uvicorn.run(build_app(args.prefill, args.decode), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
