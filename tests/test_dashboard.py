"""The live dashboard: the page and its routes over
real HTTP (gateway and standalone), the key as bearer, ?key= and cookie, and the page end to end in
headless Chromium (Debian's ``chromium``, driven by Playwright) against a live fleet."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from broker import FleetClient
from broker.gateway.dashboard import create_dashboard_app
from broker.gateway.settings import GatewaySettings
from broker.ops.replay import list_dead
from broker.redis.config import CellConfig
from broker.redis.embedded import RedisServer
from broker.redis.scripts import Scripts
from cli.args import build_parser, dashboard_settings
from tests.support import FAST, WorkerPool, cli_http_server, reap_until_moved, world_step
from tests.test_cell_stats import until
from tests.test_gateway import AppServer, GatewayServer
from workers.engines.base import EngineOutput, EngineRequest
from workers.engines.null import NullEngine

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
KEY = "dash-key"
BEARER = {"Authorization": f"Bearer {KEY}"}


class PoisonEngine(NullEngine):
    """A null engine whose steps of the sessions in ``poisoned`` fail (the others run)."""

    def __init__(self) -> None:
        super().__init__()
        self.poisoned: set[str] = set()

    async def run_batch(self, model: str, requests: Sequence[EngineRequest]) -> list[EngineOutput | BaseException]:
        outputs = await super().run_batch(model, requests)
        return [RuntimeError("device lost") if req.session_key in self.poisoned else out
                for req, out in zip(requests, outputs, strict=True)]


async def _dead_letter(fleet: FleetClient, engine: PoisonEngine) -> Any:
    """A session whose step 1 failed every attempt and was dead-lettered (step 0 committed)."""
    s = await fleet.create_session(model="null-world", mode="world_model_env")
    assert (await s.step(0, **world_step(0))).ok
    engine.poisoned.add(s.session_id)
    failed = await s.step(1, **world_step(1))
    assert failed.error is not None and "device lost" in failed.error.message
    engine.poisoned.discard(s.session_id)
    return s


@pytest.mark.asyncio
async def test_dashboard_routes_need_the_key_and_replay_a_dead_letter(
        redis_server: RedisServer, prefix: str, fleet: FleetClient, workers: WorkerPool) -> None:
    engine = PoisonEngine()
    running = await workers.add(engine, max_attempts=2, retry_backoff_ms=1, **FAST)
    s = await _dead_letter(fleet, engine)
    settings = GatewaySettings(api_keys=frozenset({KEY}))
    async with GatewayServer(redis_server.url, prefix, settings=settings) as server, \
            httpx.AsyncClient(base_url=server.url, timeout=30.0) as http:
        for path in ("/dashboard", "/dashboard/data", "/dashboard?key=wrong"):
            assert (await http.get(path)).status_code == 401, path
        assert (await http.post("/dashboard/replay/1-0")).status_code == 401
        page = await http.get("/dashboard", params={"key": KEY})
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        assert running.id in page.text and "rollout_fleet_key=" in page.headers["set-cookie"]
        assert "httponly" in page.headers["set-cookie"].lower()
        # The cookie the page set now answers the data route (httpx keeps it, as a browser does).
        data = (await http.get("/dashboard/data")).json()
        http.cookies.clear()
        assert (await http.get("/dashboard/data")).status_code == 401
        assert [w["worker_id"] for w in data["workers"]] == [running.id]
        assert data["workers"][0]["live"] and data["sessions"]["total"] == 1
        [dead] = data["dead_letters"]["shown"]
        assert (dead["session_id"], dead["step_id"], dead["code"]) == (s.session_id, 1, "inference_error")
        bad = await http.post("/dashboard/replay/not-an-id", headers=BEARER)
        assert bad.status_code == 400 and "entry id" in bad.json()["error"]["message"]
        outcome = (await http.post(f"/dashboard/replay/{dead['entry_id']}", headers=BEARER)).json()
        assert outcome["status"] == "queued"

        async def replayed() -> bool:
            return bool((await s.status()).committed_step_id == 1)
        await until(replayed, "the replayed step's commit")
        assert (await http.get("/dashboard/data", headers=BEARER)).json()["dead_letters"]["total"] == 0


@pytest.mark.asyncio
async def test_standalone_dashboard_verb(redis_server: RedisServer, prefix: str, fleet: FleetClient,
                                         workers: WorkerPool) -> None:
    args = build_parser({"ROLLOUT_FLEET_API_KEY": "a,b"}).parse_args(["dashboard", "--port", "9999"])
    assert args.port == 9999 and dashboard_settings(args).api_keys == {"a", "b"}
    running = await workers.add(NullEngine(), **FAST)
    app = create_dashboard_app(CellConfig(redis_url=redis_server.url, prefix=prefix))
    async with AppServer(app) as server, httpx.AsyncClient(base_url=server.url, timeout=30.0) as http:
        assert running.id in (await http.get("/dashboard")).text
        assert (await http.get("/dashboard/data")).json()["workers"][0]["worker_id"] == running.id


@pytest.mark.asyncio
async def test_the_dashboard_verb_serves_the_page_in_its_own_process(
        redis_server: RedisServer, prefix: str, workers: WorkerPool) -> None:
    """`rollout-fleet dashboard --port P` end to end: the verb, its keys from the environment, the page."""
    running = await workers.add(NullEngine(), **FAST)
    env = {"ROLLOUT_FLEET_REDIS_URL": redis_server.url, "ROLLOUT_FLEET_PREFIX": prefix, "ROLLOUT_FLEET_API_KEY": KEY}
    async with cli_http_server(["dashboard"], env, "/dashboard/data", lambda r: r.status_code == 401) as http:
        data = (await http.get("/dashboard/data", headers=BEARER)).json()
        assert [w["worker_id"] for w in data["workers"]] == [running.id]
        assert running.id in (await http.get("/dashboard", params={"key": KEY})).text


@pytest.mark.asyncio
async def test_without_redis_the_routes_answer_503_with_the_reason() -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        url = f"redis://127.0.0.1:{probe.getsockname()[1]}/0"
    app = create_dashboard_app(CellConfig(redis_url=url, prefix="nobody"))
    async with AppServer(app) as server, httpx.AsyncClient(base_url=server.url, timeout=30.0) as http:
        for method, path in (("GET", "/dashboard"), ("GET", "/dashboard/data"), ("POST", "/dashboard/replay/1-0")):
            r = await http.request(method, path)
            assert r.status_code == 503, path
            assert r.json()["error"]["message"].startswith("redis does not answer"), path


def test_the_verb_without_the_gateway_extra_says_what_to_install() -> None:
    hide_fastapi = ("import sys; sys.modules['fastapi'] = None; from cli.main import main; "
                    "sys.exit(main(['dashboard']))")
    done = subprocess.run([sys.executable, "-c", hide_fastapi], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)})
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip() == "dashboard: fastapi is missing: install rollout-fleet[gateway]"


async def _trainer(fleet: FleetClient, stop: asyncio.Event) -> None:
    """Steps two sessions until told to stop: the committed-step count keeps growing."""
    sessions = [await fleet.create_session(model="null-world", mode="world_model_env") for _ in range(2)]
    step = 0
    while not stop.is_set():
        for s in sessions:
            assert (await s.step(step, **world_step(step))).ok
        step += 1
        await asyncio.sleep(0.02)


def _artifact(name: str) -> Path:
    folder = Path(os.environ.get("ROLLOUT_FLEET_ARTIFACTS") or Path(__file__).parent / "artifacts")
    folder.mkdir(parents=True, exist_ok=True)
    return folder / name


@pytest.mark.slow  # ~10 s: a browser start and a live fleet
@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (apt-get install chromium)")
@pytest.mark.asyncio
async def test_the_page_in_headless_chromium(redis_server: RedisServer, prefix: str, fleet: FleetClient,
                                             workers: WorkerPool) -> None:
    async_api = pytest.importorskip("playwright.async_api", reason="pip install rollout-fleet[browser-tests]")
    engine = PoisonEngine()
    running = await workers.add(engine, max_attempts=2, retry_backoff_ms=1, **FAST)
    stop = asyncio.Event()
    trainer = asyncio.create_task(_trainer(fleet, stop))
    settings = GatewaySettings(api_keys=frozenset({KEY}))
    try:
        async with GatewayServer(redis_server.url, prefix, settings=settings) as server, \
                async_api.async_playwright() as pw:
            browser = await pw.chromium.launch(executable_path=CHROMIUM, headless=True)
            page = await browser.new_page(viewport={"width": 1280, "height": 900})
            await page.goto(f"{server.url}/dashboard?key={KEY}")
            await page.wait_for_selector(f"#workers td:text-is('{running.id}')", timeout=10_000)
            assert "key=" not in page.url  # the key went into a cookie
            first = int(await page.inner_text("#committed-window") or 0)
            # The script refreshes from /dashboard/data (with the cookie): the count grows.
            await page.wait_for_function(
                f"Number(document.getElementById('committed-window').textContent) > {first}", timeout=10_000)
            s = await _dead_letter(fleet, engine)
            button = page.locator("#dead button.replay")
            await button.wait_for(timeout=10_000)
            await button.click()
            await page.wait_for_function(
                "document.getElementById('replay-result').textContent.includes('queued')", timeout=10_000)

            async def replayed() -> bool:
                return bool((await s.status()).committed_step_id == 1)
            await until(replayed, "the replayed step's commit")
            assert await list_dead(Scripts(fleet.redis, fleet.keys)) == []
            # A worker that dies shows up among the failovers once a reaping pass retires it.
            victim = await workers.add(NullEngine(), **FAST)
            await workers.kill(victim)
            await reap_until_moved(Scripts(fleet.redis, fleet.keys), victim.id)
            await page.wait_for_selector(f"#failovers td:text-is('{victim.id}')", timeout=10_000)
            await _dead_letter(fleet, engine)  # one more, for the screenshot
            await page.locator("#dead button.replay").wait_for(timeout=10_000)
            await page.screenshot(path=str(_artifact("dashboard.png")), full_page=True)
            await browser.close()
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(trainer, 10)


@pytest.mark.asyncio
async def test_the_standalone_dashboards_root_redirects_to_the_page(redis_server: RedisServer, prefix: str,
                                                                    workers: WorkerPool) -> None:
    running = await workers.add(NullEngine(), **FAST)
    app = create_dashboard_app(CellConfig(redis_url=redis_server.url, prefix=prefix),
                               GatewaySettings(api_keys=frozenset({KEY})))
    async with AppServer(app) as server, httpx.AsyncClient(base_url=server.url, timeout=30.0) as http:
        bare = await http.get("/")
        assert bare.status_code == 307 and bare.headers["location"] == "/dashboard"
        assert (await http.get("/", follow_redirects=True)).status_code == 401  # the page still needs the key
        keyed = await http.get("/", params={"key": KEY})
        assert keyed.status_code == 307 and keyed.headers["location"] == f"/dashboard?key={KEY}"
        page = await http.get("/", params={"key": KEY}, follow_redirects=True)
        assert page.status_code == 200 and running.id in page.text
