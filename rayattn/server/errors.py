"""OpenAI-style error responses: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from rayattn.compat import client_error_types
from rayattn.engine import wire

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          408: "timeout", 409: "invalid_request_error",
          413: "invalid_request_error", 422: "invalid_request_error",
          429: "rate_limit_error", 500: "internal_error", 503: "service_unavailable",
          504: "timeout"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 retry_after: int | None = None, code: str | int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.retry_after = (
            status, message, param, retry_after)
        self.code = code if code is not None else status

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code}}

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        headers = dict(headers or {})
        if self.retry_after:
            headers["Retry-After"] = str(self.retry_after)
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return JSONResponse(self.body(), status_code=self.status, headers=headers or None)


def from_validation(err: ValidationError) -> APIError:
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"])
    msg = first["msg"]
    if first["type"] == "extra_forbidden":
        msg = "unknown parameter"
    if not where:  # a whole-body check (vLLM's model validators name their parameter)
        return APIError(400, msg.removeprefix("Value error, "),
                        param=getattr(first.get("ctx", {}).get("error"), "parameter", None))
    detail = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}"
                       for e in err.errors()[:5])
    return APIError(400, f"{where}: {msg} ({detail})", param=where)


def error_response(err: object) -> APIError:
    """vLLM's ErrorResponse (its validation, rendering) as an APIError with its status."""
    info = getattr(err, "error", None)
    status = int(getattr(info, "code", 400) or 400)
    return APIError(status if 400 <= status < 600 else 400,
                    str(getattr(info, "message", err)), param=getattr(info, "param", None))


def client_error(e: BaseException, param: str | None = None) -> APIError:
    """An exception vLLM raises about the request itself (VLLMValidationError, ValueError)
    as a 400 with vLLM's message and the parameter it names."""
    return APIError(400, str(e)[:1000] or type(e).__name__,
                    param=getattr(e, "parameter", None) or param)


class EngineFailure(Exception):
    """A replica failed (its actor or engine died) while serving a request, and no retry
    was left or output had already reached the client."""

    def __init__(self, replica: str, cause: BaseException, started: bool,
                 retryable: bool = True) -> None:
        # Only the cause's type: Ray's messages name actor ids, addresses and pids, which
        # are the operator's (the router logs them), not the client's.
        super().__init__(f"{type(cause).__name__}")
        self.replica, self.cause, self.started = replica, cause, started
        self.retryable = retryable


def failed_request(e: BaseException | None, timeout_s: float) -> APIError:
    """The one mapping from how a request to the engines ended without an answer to the
    client's error: a failed replica 503, the router's deadline 504, an engine that ended
    the request without output 503 (`e` None or StopAsyncIteration). Other APIErrors
    (no replica, admission) pass through."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, EngineFailure):
        # After output has reached the client the answer is an error event in its stream.
        where = " mid-stream" if e.started else ""
        if not e.retryable:
            return APIError(503, f"the engine crashed while running this request{where} "
                                 f"({e}); it was not sent to another engine, since it may "
                                 "be what crashed it", code="engine_crashed")
        return APIError(503, f"engine failure{where}: {e}", retry_after=2)
    if isinstance(e, TimeoutError):
        return APIError(504, f"request exceeded {timeout_s}s")
    return APIError(503, "the engine ended the request without output", retry_after=2)


def engine_raised(e: BaseException) -> APIError:
    """An exception an engine raised about the request itself (not a dead replica): vLLM's
    validation is the client's 400; anything else a 500 naming only its type."""
    # Ray's RayTaskError carries the engine's own exception as `cause`.
    cause = getattr(e, "cause", None) or e
    if isinstance(cause, wire.EngineRaised):  # the direct transport's account of it
        r = cause.raised
        if r.client_error:
            return APIError(400, f"engine rejected the request: {r.message[:500]}",
                            param=r.parameter)
        return APIError(500, f"engine error: {r.type}")
    if isinstance(cause, client_error_types()):
        return APIError(400, f"engine rejected the request: {str(cause)[:500]}",
                        param=getattr(cause, "parameter", None))
    return APIError(500, f"engine error: {type(e).__name__}")


PROMPT_FIELD = {"chat": "messages", "completion": "prompt", "responses": "input"}
"""The body field that holds each kind of request's prompt (named in errors about it)."""
