"""Request bodies, read under a size cap: an oversized body is refused before it is buffered."""

from __future__ import annotations

from aiohttp import web

from services.gateway.openai_schema import ApiError

READ_CHUNK_BYTES = 64 * 1024


async def read_body(request: web.Request, limit: int) -> bytes:
    """The whole body, or ApiError 413 as soon as it is known to exceed `limit` bytes."""
    if request.content_length is not None and request.content_length > limit:
        raise _too_large(limit, f"{request.content_length} bytes")
    body = bytearray()
    async for chunk in request.content.iter_chunked(READ_CHUNK_BYTES):
        body += chunk
        if len(body) > limit:  # chunked uploads announce no length
            raise _too_large(limit, "more")
    return bytes(body)


def _too_large(limit: int, size: str) -> ApiError:
    return ApiError(
        413, f"The request body ({size}) is larger than the {limit} bytes allowed (gateway.max_body_bytes).",
        code="request_too_large",
    )
