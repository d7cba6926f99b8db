"""The live dashboard: ``GET /dashboard`` (the page), ``GET /dashboard/data`` (its JSON, refreshed
every two seconds) and ``POST /dashboard/replay/{entry_id}`` (re-enqueue a dead letter through
:mod:`broker.ops.replay`, as ``rollout-fleet replay run`` does).

Mounted by the gateway, or served alone by ``rollout-fleet dashboard`` (:func:`create_dashboard_app`,
whose ``/`` redirects to the page).
With API keys set, these routes need a key like every other route (see :mod:`broker.gateway.guards`);
a browser may give it once as ``/dashboard?key=KEY``, which the page turns into a cookie
(HttpOnly, SameSite=Strict, path /dashboard) and removes from the address bar.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse
from redis.exceptions import RedisError
from starlette.types import ASGIApp, Receive, Scope, Send

from broker.gateway.dashboard_page import render_page
from broker.gateway.errors import error_response
from broker.gateway.guards import DASHBOARD_COOKIE, DASHBOARD_KEY_PARAM, DASHBOARD_PATH, BearerAuth
from broker.gateway.settings import GatewaySettings
from broker.ops.dashboard_data import DashboardSource
from broker.ops.fleet_dashboard import FleetDashboardSource
from broker.redis.config import CellConfig
from broker.redis.connect import open_redis
from broker.redis.scripts import Scripts

ENTRY_ID = re.compile(r"\d{1,20}-\d{1,20}")  # a stream entry id; anything else is refused (400)
DATA_TIMEOUT_S = 5.0  # a refresh or replay that Redis does not answer in this long answers 503
router = APIRouter(prefix="/dashboard")


Source = DashboardSource | FleetDashboardSource  # one cell's, or every cell's (--cell '*')


def _source(request: Request) -> Source:
    """The app's source: the standalone app sets one; in the gateway it rides on the fleet client."""
    state = request.app.state
    source: Source | None = getattr(state, "dashboard", None)
    if source is None:
        fleet = state.gateway.fleet
        source = state.dashboard = DashboardSource(fleet.scripts, fleet.lease_ms) if fleet.cell is not None \
            else FleetDashboardSource(fleet.redis, fleet.config)
    return source


async def _bounded(work: Awaitable[dict[str, Any]]) -> dict[str, Any] | Response:
    """The work's answer, or a 503 saying why when Redis does not answer within DATA_TIMEOUT_S."""
    try:
        async with asyncio.timeout(DATA_TIMEOUT_S):
            return await work
    except (RedisError, OSError, TimeoutError) as exc:
        # The error type only: the message may name the Redis address and its user.
        return error_response(503, f"redis does not answer ({type(exc).__name__})")


@router.get("", response_class=HTMLResponse, include_in_schema=False)
async def dashboard_page(request: Request) -> Response:
    source = _source(request)
    snapshot = await _bounded(source.snapshot())
    if isinstance(snapshot, Response):
        return snapshot
    page = HTMLResponse(render_page(source.label, snapshot))
    key = request.query_params.get(DASHBOARD_KEY_PARAM)
    if key:  # the guard accepted it: keep it for the page's own requests
        page.set_cookie(DASHBOARD_COOKIE, key, httponly=True, samesite="strict", path="/dashboard")
    return page


@router.get("/data", include_in_schema=False)
async def dashboard_data(request: Request) -> Response:
    snapshot = await _bounded(_source(request).snapshot())
    return snapshot if isinstance(snapshot, Response) else JSONResponse(snapshot)


@router.post("/replay/{entry_id}", include_in_schema=False)
async def dashboard_replay(entry_id: str, request: Request) -> Response:
    if not ENTRY_ID.fullmatch(entry_id):
        return error_response(400, f"not a dead-letter entry id: {entry_id[:64]!r}", param="entry_id")
    outcome = await _bounded(_source(request).replay(entry_id))
    return outcome if isinstance(outcome, Response) else JSONResponse(outcome)


class RootToPage:
    """``GET /`` of the standalone dashboard answers a redirect to the page, its query (``?key=``)
    kept. It runs before the key check: the redirect shows nothing, and the page asks for a key."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == "/" and scope["method"] in ("GET", "HEAD"):
            query = bytes(scope.get("query_string", b"")).decode("latin-1")
            page = DASHBOARD_PATH + (f"?{query}" if query else "")
            await RedirectResponse(page, status_code=307)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def create_dashboard_app(config: CellConfig, settings: GatewaySettings | None = None) -> FastAPI:
    """The dashboard alone, without a gateway: its own Redis connection to the cell."""
    settings = settings or GatewaySettings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        redis = open_redis(config.redis_url, decode_responses=False)
        try:
            app.state.dashboard = FleetDashboardSource(redis, config) if config.any_cell else \
                DashboardSource(Scripts(redis, config.keys), config.lease_ms)
            yield
        finally:
            await redis.aclose()

    app = FastAPI(title="Rollout Fleet dashboard", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.include_router(router)
    app.add_middleware(BearerAuth, api_keys=settings.api_keys)
    app.add_middleware(RootToPage)  # added last: the outermost, ahead of the key check
    return app


def serve_dashboard(config: CellConfig, host: str = "127.0.0.1", port: int = 8080, *,
                    settings: GatewaySettings | None = None) -> None:
    """Run the standalone dashboard in the foreground (uvicorn) until interrupted."""
    uvicorn.run(create_dashboard_app(config, settings), host=host, port=port, log_level="info")
