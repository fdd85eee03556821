"""Every error as OpenAI's error body, and the optional bearer-token check."""

from __future__ import annotations

import hmac
import logging

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from redis.exceptions import RedisError

from services.gateway.context import GATEWAY
from services.gateway.openai_schema import ApiError, error_body

logger = logging.getLogger(__name__)

# Probes and scrapes stay open, as in vLLM: orchestrators and Prometheus carry no API key.
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})
UNAVAILABLE_RETRY_AFTER_S = 1


def error_response(err: ApiError) -> web.Response:
    headers = err.headers
    if err.status == 503 and "Retry-After" not in headers:
        headers = headers | {"Retry-After": str(UNAVAILABLE_RETRY_AFTER_S)}  # every 503 is worth retrying
    return web.json_response(error_body(err), status=err.status, headers=headers)


@web.middleware
async def openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as err:
        if err.status == 429:
            request.app[GATEWAY].metrics.requests_rejected.inc()
        logger.info("%s %s -> %d: %s", request.method, request.path, err.status, err.message)
        return error_response(err)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(ApiError(exc.status, f"{exc.reason}: {request.method} {request.path}", _http_type(exc)))
    except RedisError as e:  # refused by Redis itself (out of memory, ACL) rather than unreachable
        logger.error("%s %s: Redis error: %s", request.method, request.path, e)
        return error_response(ApiError(503, f"The request queue (Redis) refused the request: {e}", "server_error"))
    except Exception:
        logger.exception("%s %s failed", request.method, request.path)
        return error_response(ApiError(500, "Internal server error.", "server_error"))


def _http_type(exc: web.HTTPException) -> str:
    return "not_found_error" if exc.status == 404 else "invalid_request_error"


def api_key_auth(api_keys: list[str]) -> Middleware:
    keys = [key.encode() for key in api_keys]

    @web.middleware
    async def check_api_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path not in OPEN_PATHS and not _has_valid_key(request.headers.get("Authorization", ""), keys):
            raise ApiError(
                401, "Missing or incorrect API key: send 'Authorization: Bearer <key>'.",
                code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"},
            )
        return await handler(request)

    return check_api_key


def _has_valid_key(authorization: str, keys: list[bytes]) -> bool:
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return False
    given = token.strip().encode()
    # compare with every key: the time taken does not depend on which one matched
    matches = [hmac.compare_digest(given, key) for key in keys]
    return any(matches)
