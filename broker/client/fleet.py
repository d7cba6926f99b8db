"""The trainer client: create sessions, submit steps (pipelined), reset, close, status.

    async with FleetClient("redis://127.0.0.1:6379/0") as fleet:
        s = await fleet.create_session(model="reference-world", mode="world_model_env")
        r = await s.step(0, observation=obs, action=act)
"""

from __future__ import annotations

from dataclasses import dataclass

from redis.asyncio import Redis

from broker.client.admission_wait import admitted
from broker.client.cells import placement_order
from broker.client.direct import DirectFetcher
from broker.client.link import Bounds, CellLink, decode_result, session_status
from broker.client.replies import ReplyReader
from broker.client.session import Session, new_id
from broker.redis.admission import Admission
from broker.redis.cells import known_cells, live_cells
from broker.redis.config import CellConfig
from broker.redis.connect import open_redis
from broker.redis.keys import CELL_MARK, DEFAULT_CELL, CellKeys, cell_named_by, check_session_id, session_id_in
from broker.redis.layouts import (
    DEFAULT_IDLE_TIMEOUT_S,
    ReplyEntry,
    idle_timeout_ms_of,
    max_staleness_of,
)
from broker.redis.refusals import RedisRefused
from broker.redis.script_replies import Created, Refused
from broker.redis.scripts import Scripts
from schemas.errors import (
    ErrorCode,
    FleetError,
    InvalidRequestError,
    RedisUnavailableError,
    error_for,
)
from schemas.limits import DEFAULT_LIMITS, Limits
from schemas.messages import Mode, SessionStatus, StepResult, parse_mode
from schemas.sharing import DEFAULT_PRIORITY, Priority, as_priority, as_trainer
from schemas.wire_fields import as_result_window, as_retention

# The longest blocking read a results consumer may ask for (every wait has a bound).
MAX_BLOCK_MS = 30_000
DEFAULT_STEP_TIMEOUT_S = 300.0
DEFAULT_SESSION_CHECK_S = 2.0


def _positive_or_none(name: str, value: float | None) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{name} must be a positive number of seconds or None, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class CreateOptions:
    """A new session's options as create.lua takes them (checked by create_session)."""

    retention: str
    result_window: int
    idle_timeout_ms: int
    max_staleness: int | None
    admission: Admission | None
    priority: str
    trainer: str


def _default_trainer(client_id: str) -> str:
    """The trainer of a client given none: its client id where that is a trainer name."""
    try:
        return as_trainer(client_id)
    except InvalidRequestError:
        return "default"


def _refusal(refused: Refused, cells: list[str], pool: str, trainer: str) -> FleetError:
    """The error of a create every cell tried refused (the last refusal's code)."""
    if len(cells) == 1:
        return error_for(refused.code, refused.message)
    if refused.code is ErrorCode.TRAINER_CAP_REACHED:
        return error_for(refused.code, f"trainer {trainer} is at its cap, or the cell is full, in every one of the "
                         f"cells {', '.join(cells)}; last: {refused.message}")
    return error_for(refused.code, f"no live worker with free capacity serves {pool} in any of the cells "
                     f"{', '.join(cells)}")


class FleetClient:
    """Async client of one cell, or of every cell. Use as ``async with FleetClient(url) as fleet``.

    ``url``, ``prefix``, ``cell`` and ``lease_ms`` override the matching values of ``config``
    (default: ``CellConfig()``, cell ``"0"``); None keeps the config's value. ``cell="*"``
    (:data:`ANY_CELL`): a client of every cell — new sessions go to the live cell with the most
    free capacity, and every other call routes by the cell the session id names. A client given
    one cell stays in it and refuses ids naming another. ``step_timeout`` bounds every step and
    reset called without a ``timeout`` (None: no bound); while waiting, the client checks every
    ``session_check_s`` that the session still exists and fails the wait with
    ``session_not_found`` once it is gone. ``trainer`` names whose open sessions this client's new
    sessions count in (an operator may cap them per cell: ``rollout-fleet trainers set-cap``);
    default: the client id, or ``default`` for a client id that is no trainer name.
    ``direct_results``: fetch a large result from the worker that committed it when that worker
    serves results (``--serve-results``, schemas/results_wire.py), one hop instead of two through Redis;
    it is read from Redis whenever the worker cannot answer."""

    def __init__(
        self,
        url: str | None = None,
        *,
        prefix: str | None = None,
        cell: str | None = None,
        limits: Limits = DEFAULT_LIMITS,
        client_id: str | None = None,
        lease_ms: int | None = None,
        reply_ttl_ms: int = 3_600_000,
        reconnect_s: float = 60.0,
        config: CellConfig | None = None,
        step_timeout: float | None = DEFAULT_STEP_TIMEOUT_S,
        session_check_s: float = DEFAULT_SESSION_CHECK_S,
        trainer: str | None = None,
        direct_results: bool = True,
    ) -> None:
        self.config = (config or CellConfig()).with_overrides(redis_url=url, prefix=prefix, cell=cell,
                                                              lease_ms=lease_ms)
        self.url = self.config.redis_url
        # The one cell this client stays in; None: every cell (cell="*").
        self.cell: str | None = None if self.config.any_cell else self.config.cell
        self.limits = limits
        self.client_id = client_id or f"client-{new_id()[:12]}"
        self.trainer = as_trainer(trainer) if trainer is not None else _default_trainer(self.client_id)
        self.lease_ms = self.config.lease_ms
        self.reply_ttl_ms = reply_ttl_ms
        self.reconnect_s = reconnect_s
        # A step (or reset) called without a timeout waits this long at most; None: no bound.
        self.step_timeout = _positive_or_none("step_timeout", step_timeout)
        # While waiting, how often to check that the session still exists (broker/client/link.py).
        self.session_check_s = _positive_or_none("session_check_s", session_check_s) or DEFAULT_SESSION_CHECK_S
        # Large results fetched from the worker that committed them when it serves them
        # (broker/client/direct.py), else read from Redis; False: always from Redis.
        self.direct_results = direct_results
        self._redis: Redis | None = None
        self._links: dict[str, CellLink] = {}

    async def __aenter__(self) -> FleetClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def connect(self) -> None:
        if self._redis is not None:
            return
        self._redis = open_redis(self.url, decode_responses=False)
        await self._redis.ping()
        if self.cell is not None:
            self.link(self.cell)  # a client of one cell reads its reply stream from the start

    async def aclose(self) -> None:
        links, self._links = list(self._links.values()), {}
        for link in links:
            await link.replies.stop()
            await link.scripts.cancel_pending()
        if self._redis is not None:
            await self._redis.aclose()
        self._redis = None

    # ------------------------------------------------------------------ plumbing

    @property
    def redis(self) -> Redis:
        if self._redis is None:
            raise RuntimeError("FleetClient is not connected: use `async with FleetClient(...)`")
        return self._redis

    def link(self, cell: str) -> CellLink:
        """This client's keys, scripts and reply reader in ``cell`` (made on first use)."""
        found = self._links.get(cell)
        if found is None:
            keys = CellKeys(self.config.prefix, cell)
            found = CellLink(self.redis, keys, Scripts(self.redis, keys),
                             ReplyReader(self.redis, keys.reply(self.client_id),
                                         in_place=keys.in_place_reader(self.client_id),
                                         direct=DirectFetcher(self.redis, keys) if self.direct_results else None),
                             self.client_id, self.limits,
                             Bounds(self.step_timeout, self.session_check_s, self.reconnect_s))
            found.replies.start()
            self._links[cell] = found
        return found

    def _home(self) -> CellLink:
        if self.cell is None:
            raise RuntimeError("a FleetClient of every cell (cell='*') has no one cell: use link(cell) or "
                               "the cell a session id names (cell_of)")
        return self.link(self.cell)

    @property
    def keys(self) -> CellKeys:
        """The keys of the one cell this client stays in (not for a client of every cell)."""
        if self.cell is None:
            return self._home().keys  # raises: which cell's keys would be a guess
        return CellKeys(self.config.prefix, self.cell)

    @property
    def scripts(self) -> Scripts:
        return self._home().scripts

    @property
    def replies(self) -> ReplyReader:
        return self._home().replies

    def cell_of(self, session_id: str) -> str:
        """The cell a session id routes to: the one it names after ``@``; an id naming none is in
        this client's cell, or for a client of every cell in :data:`DEFAULT_CELL`. A client of one
        cell refuses an id naming another (InvalidRequestError)."""
        named = cell_named_by(check_session_id(session_id))
        if self.cell is None:
            return DEFAULT_CELL if named is None else named
        if named is not None and named != self.cell:
            raise InvalidRequestError(f"session {session_id!r} is in cell {named!r}; this client stays in cell "
                                      f"{self.cell!r}")
        return self.cell

    def link_for(self, session_id: str) -> CellLink:
        """The link of the cell ``session_id`` routes to (what a Session of it holds)."""
        return self.link(self.cell_of(session_id))

    def keys_of(self, session_id: str) -> CellKeys:
        """The keys of the cell ``session_id`` routes to (no link made: reading a session of a cell
        this client never uses costs no reader)."""
        return CellKeys(self.config.prefix, self.cell_of(session_id))

    async def live_cells(self) -> list[str]:
        """The cells this client works in: its own, or every cell with a live worker."""
        if self.cell is not None:
            return [self.cell]
        return await live_cells(self.redis, self.config.prefix, lease_ms=self.lease_ms)

    # ------------------------------------------------------------------ sessions

    async def create_session(
        self,
        model: str,
        mode: str | Mode,
        *,
        session_id: str | None = None,
        retention: str = "full",
        result_window: int = 4,
        idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
        max_staleness: int | None = None,
        admission: Admission | None = None,
        priority: str | Priority = DEFAULT_PRIORITY,
        trainer: str | None = None,
    ) -> Session:
        """Place a new session on the least loaded live worker serving (model, mode) — for a client
        of every cell, in the live cell with the most free capacity for it (the next one when that
        cell has just filled up).

        Generated ids are ``<32 hex>@<cell>``. A caller-chosen ``session_id`` naming a cell
        (``<id>@<cell>``) goes to that cell; one naming none goes to this client's cell unchanged,
        or, for a client of every cell, gets ``@<cell>`` appended (the returned Session's id).
        ``result_window`` is how many of the latest committed results stay stored for idempotent
        retries of a lost reply. ``idle_timeout_s``: the owner closes the session (freeing its
        capacity) after that long without a step, reset or close. ``max_staleness``: once the
        version announced for the model passes the version the trajectory's first step ran on by
        more than this, steps answer ``stale_policy`` (None: no bound). ``admission``: count the
        session against a producer's bound (client of one cell only; docs/async_rl.md). Raises
        CapacityExhaustedError, AdmissionClosedError or InvalidRequestError. ``priority``:
        ``interactive`` steps run before ``bulk`` ones (the default) on a busy worker. ``trainer``
        (default: the client's) is whose open sessions it counts in: TrainerCapReachedError when
        the trainer is at its cap in every cell tried.
        """
        mode = parse_mode(mode)
        if not isinstance(model, str) or not model:
            raise InvalidRequestError("model must be a non-empty string")
        as_retention(retention)
        as_result_window(result_window)
        options = CreateOptions(retention, result_window, idle_timeout_ms_of(idle_timeout_s),
                                max_staleness_of(max_staleness), admission, as_priority(priority).value,
                                self.trainer if trainer is None else as_trainer(trainer))
        if admission is not None:
            if not isinstance(admission, Admission):
                raise InvalidRequestError(f"admission must be an Admission, got {type(admission).__name__}")
            if self.cell is None:
                raise InvalidRequestError("admission counts in one cell: use a client of one cell")
            return await admitted(self.redis, self.keys, admission, model,
                                  lambda: self._create(session_id, mode, model, options))
        return await self._create(session_id, mode, model, options)

    async def _create(self, session_id: str | None, mode: Mode, model: str, options: CreateOptions) -> Session:
        cells = await self._cells_for(session_id, mode, model)
        refused: Refused | None = None
        for cell in cells:
            sid = f"{new_id()}{CELL_MARK}{cell}" if session_id is None else self._chosen_id(session_id, cell)
            try:
                reply = await self.link(cell).scripts.create(
                    sid, mode.value, model, lease_ms=self.lease_ms, retention=options.retention,
                    result_window=options.result_window, idle_timeout_ms=options.idle_timeout_ms,
                    max_staleness=options.max_staleness, admission=options.admission,
                    priority=options.priority, trainer=options.trainer)
            except RedisRefused as exc:  # nothing was written: the caller may create again later
                raise RedisUnavailableError(f"cannot create a session now: {exc}") from exc
            if isinstance(reply, Created):
                return Session(self, sid, model=model, mode=mode, owner=reply.owner)
            if reply.code not in (ErrorCode.CAPACITY_EXHAUSTED, ErrorCode.TRAINER_CAP_REACHED):
                raise error_for(reply.code, reply.message)
            refused = reply  # caps and capacity are per cell: the next cell may have room
        if refused is None:
            raise InvalidRequestError(f"unknown model or mode: no live worker in any cell serves model {model} "
                                      f"in mode {mode.value}")
        raise _refusal(refused, cells, f"model {model} in mode {mode.value}", options.trainer)

    def _chosen_id(self, session_id: str, cell: str) -> str:
        """The id as it will be stored (checked again: ``@<cell>`` may take it past the length limit)."""
        return session_id if self.cell is not None else check_session_id(session_id_in(session_id, cell))

    async def _cells_for(self, session_id: str | None, mode: Mode, model: str) -> list[str]:
        """The cells a new session may go to, in the order to try them."""
        if session_id is not None:
            named = cell_named_by(check_session_id(session_id))
            if self.cell is not None or named is not None:
                cell = self.cell_of(session_id)
                if self.cell is None and cell not in await known_cells(self.redis, self.config.prefix):
                    raise InvalidRequestError(f"session id {session_id!r} names cell {cell!r}, which has no workers")
                return [cell]
        if self.cell is not None:
            return [self.cell]
        live = await self.live_cells()
        if not live:
            raise error_for(ErrorCode.CAPACITY_EXHAUSTED, f"no cell of {self.config.prefix!r} has a live worker")
        return await placement_order(self.redis, self.config.prefix, live, mode=mode.value, model=model,
                                     lease_ms=self.lease_ms)

    async def attach(self, session_id: str) -> Session:
        """A handle on an existing session (for example one created by another process)."""
        st = await self.status(session_id)
        return Session(self, session_id, model=st.model, mode=st.mode, owner=st.owner)

    async def status(self, session_id: str) -> SessionStatus:
        return await session_status(self.redis, self.keys_of(session_id), session_id)

    def decode_result(self, reply: ReplyEntry, started: float) -> StepResult:
        """A reply entry as a StepResult, with the current committed id and the client's timing."""
        return decode_result(reply, started, self.limits)
