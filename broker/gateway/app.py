"""The vLLM-Omni RL rollout HTTP API in front of the fleet (FastAPI).

Routes, bodies, status codes and error codes are the reference's (``/v1/realtime/sessions``):
a step error comes back as a ``RolloutStepResponse`` with ``error`` — HTTP 404
``session_not_found``, 410 ``session_closed``, 400 ``invalid_request`` / ``step_already_committed``
/ ``step_out_of_order``, 413 ``payload_too_large``, 504 ``timeout`` when no result came within the
step timeout (60 s by default: an HTTP client never waits for ever), 503 ``capacity_exhausted``
when the session lost its worker and no live worker has room for it, and HTTP 200 for the others
(``inference_error``, ``context_lost``); control routes answer 404 / 410 as vLLM's
``{"error": {...}}`` body, and a malformed body is a 400 of the same shape. A request Redis does not
answer is a 503 of that shape with ``Retry-After: 1`` (send it again), never a 500.

The gateway is the boundary for untrusted clients (see :mod:`broker.gateway.guards`): with API keys
set, every route but ``GET /health`` needs ``Authorization: Bearer <key>`` (401), a session is
stepped, reset, closed or read only with the key that created it (403), each key holds at most
``max_sessions_per_key`` open sessions (429; so does a create over the cap an operator set on the
gateway's trainer, ``trainer_cap_reached``); a body over ``max_body_bytes`` is refused before it is
read (413), and images are size-checked from their headers (413) and decoded in worker threads.

Differences a client can only gain from: a re-sent, already committed step returns its stored
result (header ``X-Rollout-Duplicate: true``) while it is in the session's result window (with
``upstream_errors`` set, ``--upstream-errors``, it is upstream's 400 ``step_already_committed``),
images may also be base64 PNG/JPEG/.npy (upstream takes nested lists only), and
``Accept: application/msgpack`` returns the fleet's ``StepResult`` as plain msgpack (latents as
raw ndarray bytes in ext type 1, :func:`schemas.codec.encode_plain`) instead of base64 JSON.
Differences the fleet's contracts impose: an image must be HxWx3 in [0, 255] and travels as uint8,
and step ids are within [0, 2**63). The engines tier's ``tests/engines/test_gateway_conformance.py``
compares the gateway with vLLM-Omni's own server call by call and lists each difference with its
reason.

    rollout-fleet gateway --redis-url redis://127.0.0.1:6379/0 --port 8000 --api-key "$KEY"
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from http import HTTPStatus
from typing import Any

import uvicorn
from fastapi import APIRouter, FastAPI, HTTPException, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.exceptions import ResponseError
from starlette.exceptions import HTTPException as StarletteHTTPException

from broker.client import FleetClient, Session
from broker.gateway.convert import fleet_action, fleet_observation, http_status, step_response
from broker.gateway.dashboard import router as dashboard_router
from broker.gateway.errors import error_response, validation_message, validation_param
from broker.gateway.guards import CALLER_STATE, BearerAuth, BodyLimit
from broker.gateway.health import health_problem
from broker.gateway.models import (
    CloseSessionResponse,
    CreateSessionRequest,
    CreateSessionResponse,
    ErrorResponse,
    HealthResponse,
    ResetSessionResponse,
    RolloutStepRequest,
    RolloutStepResponse,
    SessionStatusResponse,
)
from broker.gateway.settings import DEFAULT_MODEL, GatewaySettings
from broker.gateway.step_metrics import GatewayMetrics
from broker.gateway.tenancy import Tenancy
from broker.gateway.upstream import as_upstream_duplicate, as_upstream_refusal, served_model, with_session_values
from broker.redis.backoff import REDIS_ERRORS
from broker.redis.config import CellConfig
from broker.redis.memory_policy import warn_if_evicting
from broker.redis.refusals import RedisRefused, refusal_of
from schemas.codec import encode_plain
from schemas.errors import (
    CapacityExhaustedError,
    ErrorCode,
    FleetError,
    InvalidRequestError,
    RedisUnavailableError,
    SessionClosedError,
    SessionNotFoundError,
    TrainerCapReachedError,
)
from schemas.limits import DEFAULT_LIMITS, MAX_STEP_ID, Limits
from schemas.messages import StepResult

logger = logging.getLogger(__name__)

MSGPACK = "application/msgpack"
DUPLICATE_HEADER = "X-Rollout-Duplicate"
_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 401, 403, 404, 410, 413, 504)
}
router = APIRouter()


class Gateway:
    """One app's state: the fleet client, handles of the sessions it has seen (LRU), who owns them."""

    def __init__(self, fleet: FleetClient, *, model_default: str, settings: GatewaySettings,
                 limits: Limits, max_handles: int = 4096) -> None:
        self.fleet, self.model_default, self.limits = fleet, model_default, limits
        self.step_timeout = settings.step_timeout_s
        self.upstream_errors = settings.upstream_errors
        self.tenancy = Tenancy(fleet, settings.max_sessions_per_key)
        self.max_handles = max_handles
        self._handles: OrderedDict[str, Session] = OrderedDict()
        self._decodes = asyncio.Semaphore(settings.decode_threads)
        self.metrics = GatewayMetrics()

    def remember(self, session: Session) -> Session:
        self._handles[session.session_id] = session
        self._handles.move_to_end(session.session_id)
        while len(self._handles) > self.max_handles:
            self._handles.popitem(last=False)
        return session

    def forget(self, session_id: str) -> None:
        self._handles.pop(session_id, None)

    async def session(self, session_id: str) -> Session:
        """A handle on the session; raises SessionNotFoundError."""
        handle = self._handles.get(session_id)
        if handle is not None:
            self._handles.move_to_end(session_id)
            return handle
        return self.remember(await self.fleet.attach(session_id))

    async def observation(self, body: RolloutStepRequest) -> dict[str, Any]:
        """The body's observation, its images decoded in a thread: a large picture takes a second
        to decode, and on the event loop that second would stall every other client."""
        async with self._decodes:
            return await asyncio.to_thread(fleet_observation, body.observation, self.limits)

    async def step(self, session_id: str, body: RolloutStepRequest) -> StepResult:
        try:
            session = await self.session(session_id)
        except FleetError as exc:
            return StepResult.failure(session_id, body.step_id, exc.code, exc.message)
        try:
            observation = await self.observation(body)
            action = fleet_action(body.action)
        except FleetError as exc:  # refused before Redis: answered as the serving layer orders its checks
            return await as_upstream_refusal(
                self.fleet, StepResult.failure(session_id, body.step_id, exc.code, exc.message),
                body.step_id, body.use_session_context)
        with self.metrics.step(session.model) as answered:
            answered(await session.step(body.step_id, observation=observation, action=action,
                                        use_session_context=body.use_session_context, timeout=self.step_timeout))
        return await self._as_served(body, answered.result)

    async def _as_served(self, body: RolloutStepRequest, result: StepResult) -> StepResult:
        """The result as the serving layer reports it: a stateless step's context length is the
        session's (its throwaway context is gone), a step the client refused before Redis (the
        fleet's step schema) is answered as the serving layer orders its checks, a closed or unknown
        session's step reports -1 and 0, and with --upstream-errors a re-sent committed step
        is refused rather than answered from the stored result."""
        if result.duplicate and self.upstream_errors:
            return await as_upstream_duplicate(self.fleet, result)
        if _gone(result):  # the serving layer has no session to read values from: -1 and 0
            return dataclasses.replace(result, committed_step_id=-1, context_length=0)
        if _refused_input(result):
            return await as_upstream_refusal(self.fleet, result, body.step_id, body.use_session_context)
        if result.ok and not body.use_session_context:
            return await with_session_values(self.fleet, result)
        return result


def _gone(result: StepResult) -> bool:
    return result.error is not None and result.error.code in (ErrorCode.SESSION_CLOSED, ErrorCode.SESSION_NOT_FOUND)


def _refused_input(result: StepResult) -> bool:
    return result.error is not None and result.error.code in (ErrorCode.INVALID_REQUEST, ErrorCode.PAYLOAD_TOO_LARGE)


def _gateway(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    return gateway


def _caller(request: Request) -> str | None:
    """The caller's key digest (set by BearerAuth); None on an open gateway."""
    caller: str | None = getattr(request.state, CALLER_STATE, None)
    return caller


async def _owned(request: Request, session_id: str) -> Gateway:
    """The gateway, once the caller is known to own the session (403 otherwise)."""
    gateway = _gateway(request)
    await gateway.tenancy.check(_caller(request), session_id)
    return gateway


def _not_found(session_id: str) -> HTTPException:
    return HTTPException(status_code=404, detail=f"Session {session_id!r} not found.")


def _closed(session_id: str) -> HTTPException:
    return HTTPException(status_code=410, detail=f"Session {session_id!r} is closed.")


def _step_reply(request: Request, result: StepResult) -> Response:
    headers = {DUPLICATE_HEADER: "true"} if result.duplicate else None
    accept = request.headers.get("accept", "")
    if MSGPACK in accept or "application/x-msgpack" in accept:
        if not 0 <= result.step_id <= MAX_STEP_ID:  # a refused id past the fleet's range: -1, as the client says
            result = dataclasses.replace(result, step_id=-1)
        # Plain msgpack, not the fleet's frame: the content type promises msgpack to any client.
        return Response(encode_plain(result.to_wire()), status_code=http_status(result), media_type=MSGPACK,
                        headers=headers)
    return JSONResponse(step_response(result).model_dump(), status_code=http_status(result), headers=headers)


# --------------------------------------------------------------------------- routes


@router.post("/v1/realtime/sessions", response_model=CreateSessionResponse,
             responses={**_ERRORS, 429: {"model": ErrorResponse}, 503: {"model": ErrorResponse}})
async def create_rollout_session(body: CreateSessionRequest, request: Request) -> CreateSessionResponse:
    """Create a world_model_env session on the least loaded worker serving the model."""
    gateway = _gateway(request)
    try:
        model = served_model(body.model, gateway.model_default)
        session = await gateway.tenancy.create(_caller(request), lambda: gateway.fleet.create_session(model, body.mode))
    except InvalidRequestError as exc:
        raise HTTPException(status_code=400, detail=exc.message) from exc
    except (CapacityExhaustedError, RedisUnavailableError) as exc:  # no room, or Redis refusing writes
        raise HTTPException(status_code=503, detail=exc.message) from exc
    except TrainerCapReachedError as exc:  # the gateway's own trainer is at its cap in the cell
        raise HTTPException(status_code=429, detail=exc.message) from exc
    gateway.remember(session)
    return CreateSessionResponse(session_id=session.session_id, mode=session.mode.value, created_at=time.time())


@router.post("/v1/realtime/sessions/{session_id}/step", response_model=RolloutStepResponse,
             responses={**_ERRORS, 200: {"content": {MSGPACK: {}}}})
async def rollout_step(session_id: str, body: RolloutStepRequest, request: Request) -> Response:
    """Run one step. Errors come back in the body's ``error`` (see the module docs for statuses)."""
    gateway = await _owned(request, session_id)
    return _step_reply(request, await gateway.step(session_id, body))


@router.post("/v1/realtime/sessions/{session_id}/reset", response_model=ResetSessionResponse, responses=_ERRORS)
async def reset_rollout_session(session_id: str, request: Request) -> ResetSessionResponse:
    """Reset after the queued steps: committed_step_id goes back to -1, the context is dropped."""
    gateway = await _owned(request, session_id)
    try:
        session = await gateway.session(session_id)
        committed = await session.reset(timeout=gateway.step_timeout)
    except SessionNotFoundError as exc:
        raise _not_found(session_id) from exc
    except SessionClosedError as exc:
        raise _closed(session_id) from exc
    except TimeoutError as exc:
        raise HTTPException(status_code=504, detail=f"Session {session_id!r}: reset not applied in time.") from exc
    return ResetSessionResponse(session_id=session_id, committed_step_id=committed)


@router.post("/v1/realtime/sessions/{session_id}/close", response_model=CloseSessionResponse, responses=_ERRORS)
async def close_rollout_session(session_id: str, request: Request) -> CloseSessionResponse:
    """Close the session; closing twice is fine."""
    gateway = await _owned(request, session_id)
    try:
        session = await gateway.session(session_id)
        await session.close()
    except SessionNotFoundError as exc:
        raise _not_found(session_id) from exc
    gateway.forget(session_id)
    await gateway.tenancy.release(_caller(request), session_id)
    return CloseSessionResponse(session_id=session_id, closed=True)


@router.get("/v1/realtime/sessions/{session_id}/status", response_model=SessionStatusResponse, responses=_ERRORS)
async def rollout_session_status(session_id: str, request: Request) -> SessionStatusResponse:
    """The session's committed step, context length and whether it is closed."""
    gateway = await _owned(request, session_id)
    try:
        status = await gateway.fleet.status(session_id)
    except SessionNotFoundError as exc:
        raise _not_found(session_id) from exc
    return SessionStatusResponse(session_id=session_id, committed_step_id=status.committed_step_id,
                                 context_length=status.context_length, closed=status.closed)


@router.get("/health", response_model=HealthResponse, responses={503: {"model": ErrorResponse}})
async def health(request: Request) -> Response:
    """200 when Redis answers and a live worker serves the default model; 503 with the reason."""
    gateway = _gateway(request)
    problem, live = await health_problem(gateway.fleet, gateway.model_default)
    if problem is not None:
        return error_response(503, problem)
    return JSONResponse(HealthResponse(status="ok", model=gateway.model_default, live_workers=live).model_dump())


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    """Prometheus metrics of this gateway; like every route but /health, it needs the API key."""
    body, content_type = _gateway(request).metrics.fleet.exposition()
    return Response(body, headers={"Content-Type": content_type})


# --------------------------------------------------------------------------- errors, app


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    return error_response(exc.status_code, str(exc.detail), headers=exc.headers)


async def _validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    errors = list(exc.errors())
    param = validation_param(errors[0].get("loc", ())) if errors else None
    return error_response(HTTPStatus.BAD_REQUEST, validation_message(errors), param=param)


async def _invalid_request(request: Request, exc: Exception) -> Response:
    """A session id the fleet refuses (malformed, or naming a cell this gateway is not in): 400."""
    assert isinstance(exc, InvalidRequestError)
    return error_response(HTTPStatus.BAD_REQUEST, exc.message)


async def _redis_unreachable(request: Request, exc: Exception) -> Response:
    """Redis did not answer a lookup of this request (a partition, a restart): 503, nothing changed,
    the request may be sent again (a step re-sent gets its stored result, or runs)."""
    logger.warning("redis unreachable on %s: %s", request.url.path, exc)
    return error_response(HTTPStatus.SERVICE_UNAVAILABLE, f"redis unreachable, try again: {type(exc).__name__}: {exc}",
                          headers={"Retry-After": "1"})


async def _internal_error(request: Request, exc: Exception) -> Response:
    logger.exception("unhandled gateway error on %s", request.url.path, exc_info=exc)
    return error_response(500, f"{type(exc).__name__}: {exc}")


async def _redis_error(request: Request, exc: Exception) -> Response:
    """A Redis that refuses writes (broker/redis/refusals.py) answers 503: nothing was written, try
    again; any other Redis error reply is a bug (500)."""
    reason = refusal_of(exc)
    if reason is None:
        return await _internal_error(request, exc)
    return error_response(503, f"redis refuses writes ({reason.value}); nothing was written, try again: {exc}")


def create_app(redis_url: str | None = None, prefix: str | None = None, cell: str | None = None,
               model_default: str = DEFAULT_MODEL, *, config: CellConfig | None = None,
               step_timeout: float | None = None, limits: Limits = DEFAULT_LIMITS,
               settings: GatewaySettings | None = None) -> FastAPI:
    """The gateway app; one FleetClient lives for the app's lifespan. ``redis_url``, ``prefix``
    and ``cell`` override ``config``'s, as for :class:`FleetClient`; ``step_timeout`` overrides
    ``settings.step_timeout_s``."""
    settings = settings or GatewaySettings()
    if step_timeout is not None:
        settings = dataclasses.replace(settings, step_timeout_s=step_timeout)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with FleetClient(redis_url, prefix=prefix, cell=cell, config=config, limits=limits) as fleet:
            app.state.gateway = Gateway(fleet, model_default=model_default, settings=settings, limits=limits)
            await warn_if_evicting(fleet.redis, "gateway")  # broker/redis/memory_policy.py
            yield

    app = FastAPI(title="Rollout Fleet gateway", version="1", lifespan=lifespan,
                  description="The vLLM-Omni RL rollout API (world_model_env) served by the fleet.")
    app.include_router(router)
    app.include_router(dashboard_router)  # /dashboard: broker/gateway/dashboard.py
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(InvalidRequestError, _invalid_request)
    for error in REDIS_ERRORS:  # before Exception's: an unreachable Redis is no internal error
        app.add_exception_handler(error, _redis_unreachable)
    app.add_exception_handler(Exception, _internal_error)
    app.add_exception_handler(ResponseError, _redis_error)  # OOM, MISCONF, ... raised by a plain command
    app.add_exception_handler(RedisRefused, _redis_error)  # ... and by a script call
    # The last added runs first: the key is checked before a byte of the body is read.
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(BearerAuth, api_keys=settings.api_keys)
    return app


def serve(config: CellConfig, host: str = "127.0.0.1", port: int = 8000, *,
          model_default: str = DEFAULT_MODEL, settings: GatewaySettings | None = None) -> None:
    """Run the gateway in the foreground (uvicorn) until interrupted."""
    app = create_app(model_default=model_default, config=config, settings=settings)
    uvicorn.run(app, host=host, port=port, log_level="info")
