"""The one owner of Redis key names. Every key of a cell shares the hash tag ``{cell}``, so every
Lua script touches one slot (Redis Cluster ready); nobody else formats a key string."""

from __future__ import annotations

from dataclasses import dataclass

from schemas.errors import InvalidRequestError

INBOX_GROUP = "workers"  # consumer group name on every inbox stream
MAX_NAME_LENGTH = 200  # a caller-chosen name inside a key (results stream, consumer group)
DEFAULT_CELL = "0"  # the cell of a worker given none, and of a session id that names none
ANY_CELL = "*"  # "every cell": a client, gateway or ops command not tied to one cell
CELL_MARK = "@"  # a session id names its cell after the last "@": "<id>@<cell>"


def key_part_problem(part: str, *, max_length: int | None = None) -> str | None:
    """Why ``part`` cannot go into a key name, or None. Braces would change the hash tag (the key
    would leave the cell's slot) and colons would make two keys look like one."""
    if not part or any(c in part for c in "{}: \n"):
        return "no braces, colons or spaces"
    if not part.isprintable():  # NUL, other control characters: unreadable in logs and tools
        return "no control characters"
    if max_length is not None and len(part) > max_length:
        return f"at most {max_length} characters"
    return None


def cell_problem(cell: str) -> str | None:
    """Why ``cell`` cannot name a cell, or None: a key part that holds no ``@`` (session ids name
    their cell after the last ``@``) and is not ``*`` (which means every cell)."""
    problem = key_part_problem(cell)
    if problem is None and CELL_MARK in cell:
        problem = f"no {CELL_MARK!r} (session ids name their cell after it)"
    if problem is None and cell == ANY_CELL:
        problem = f"{ANY_CELL!r} means every cell, not one"
    return problem


def check_session_id(session_id: object) -> str:
    """A caller-chosen session id (it goes into key names and every inbox entry). An ``@`` in it
    must be followed by a cell name: ``<id>@<cell>``."""
    if not isinstance(session_id, str):
        raise InvalidRequestError(f"invalid session id: a string is needed, got {type(session_id).__name__}")
    problem = key_part_problem(session_id, max_length=MAX_NAME_LENGTH)
    if problem is None and CELL_MARK in session_id:
        head, _, cell = session_id.rpartition(CELL_MARK)
        problem = "an empty id before the cell" if not head else cell_problem(cell)
        problem = None if problem is None else f"<id>@<cell> with {problem}"
    if problem is not None:
        raise InvalidRequestError(f"invalid session id {session_id[:MAX_NAME_LENGTH]!r}: {problem}")
    return session_id


def cell_named_by(session_id: str) -> str | None:
    """The cell a (checked) session id names after its last ``@``, or None when it names none."""
    head, mark, cell = session_id.rpartition(CELL_MARK)
    return cell if mark and head else None


def session_id_in(session_id: str, cell: str) -> str:
    """``session_id`` naming ``cell`` (unchanged when it already names a cell)."""
    return session_id if cell_named_by(session_id) is not None else f"{session_id}{CELL_MARK}{cell}"


@dataclass(frozen=True)
class DeploymentKeys:
    """The few keys of a deployment that belong to no cell. Each is read and written only by
    single-key commands, never inside a cell's script, so on a Redis Cluster it may live in any
    slot."""

    prefix: str = "rf"

    @property
    def cells(self) -> str:
        """ZSET cell -> the newest heartbeat (ms, Redis clock) of any of its workers."""
        return f"{self.prefix}:cells"

    @property
    def arq_queue(self) -> str:
        """arq queue of a supervisor that serves every cell."""
        return f"{self.prefix}:arq"

    def gateway_open(self, key_digest: str) -> str:
        """SET of the open sessions a gateway of every cell created for one API key."""
        return f"{self.prefix}:gateway:open:{key_digest}"

    def pass_claim(self, name: str) -> str:
        """STRING (SET NX PX): which supervisor of every cell runs this period's ``name`` pass on a
        Redis Cluster (the per-cell claim is :meth:`CellKeys.pass_claim`)."""
        return f"{self.prefix}:pass:{_pass_name(name)}"


def _pass_name(name: str) -> str:
    if not name.isalnum():
        raise ValueError(f"a pass name is letters and digits, got {name!r}")
    return name


def check_stream_name(name: str) -> None:
    """A results stream or consumer group name a trainer chose (it goes into a key name)."""
    problem = key_part_problem(name, max_length=MAX_NAME_LENGTH)
    if problem is not None:
        raise InvalidRequestError(f"invalid results stream name {name!r}: {problem}")


@dataclass(frozen=True)
class CellKeys:
    prefix: str = "rf"
    cell: str = "0"

    def __post_init__(self) -> None:
        for part, problem in ((self.prefix, key_part_problem(self.prefix)), (self.cell, cell_problem(self.cell))):
            if problem is not None:
                raise ValueError(f"invalid key part {part!r}: {problem}")

    @property
    def base(self) -> str:
        return f"{self.prefix}:{{{self.cell}}}"

    @property
    def workers(self) -> str:
        """ZSET worker id -> last heartbeat (ms, Redis clock)."""
        return f"{self.base}:workers"

    @property
    def capacity(self) -> str:
        """HASH worker id -> max sessions over all its pools; and, where the engine splits its
        capacity by model, ``capacity_split_field(worker, pool)`` -> that pool's cap."""
        return f"{self.base}:capacity"

    @property
    def owned(self) -> str:
        """HASH worker id -> sessions it owns over all its pools (what its capacity counts)."""
        return f"{self.base}:owned"

    @property
    def pressure(self) -> str:
        """HASH worker id -> engine pressure in [0, 1] (running steps, KV cache or memory use),
        refreshed by each heartbeat; placement adds it to the session share."""
        return f"{self.base}:pressure"

    def worker(self, worker_id: str) -> str:
        """HASH of one worker's description; expires unless heartbeats refresh it."""
        return f"{self.base}:worker:{worker_id}"

    def pool(self, mode: str, model: str) -> str:
        """ZSET worker id -> sessions owned, for workers serving (mode, model)."""
        return f"{self.base}:pool:{mode}:{model}"

    @staticmethod
    def capacity_split_field(worker_id: str, pool: str) -> str:
        """The capacity hash's field for one worker's cap in one pool (a field, not a key: the Lua
        scripts join the same two strings, ``worker .. '@' .. pool key``)."""
        return f"{worker_id}@{pool}"

    @property
    def pool_index(self) -> str:
        """SET of every pool key ever registered (so a dead worker can be removed from all)."""
        return f"{self.base}:pools"

    def inbox(self, worker_id: str) -> str:
        """STREAM of step and control jobs for the sessions one worker owns."""
        return f"{self.base}:inbox:{worker_id}"

    def session(self, session_id: str) -> str:
        return f"{self.base}:session:{session_id}"

    def log(self, session_id: str) -> str:
        """HASH of committed step records of one session (results, inputs per retention)."""
        return f"{self.base}:log:{session_id}"

    def result_blob(self, session_id: str, step_id: int) -> str:
        """STRING: a committed step's large result, outside the log hash (broker/redis/blobs.py).
        prelude.lua's result_blob builds the same name from the log key (fork, reset, close)."""
        return f"{self.log(session_id)}:blob:{step_id}"

    def staged_result(self, session_id: str, step_id: int, worker_id: str, epoch: int) -> str:
        """STRING: a large result a worker wrote just before its commit; one per (step, worker,
        epoch), so a fenced worker's staging never touches anyone else's."""
        return f"{self.log(session_id)}:stage:{step_id}:{worker_id}:{epoch}"

    def staged_input(self, session_id: str, token: str) -> str:
        """STRING: a large step payload a trainer wrote just before its enqueue (broker/redis/inputs.py);
        ``token`` is new per call, so a retry never overwrites an input already queued."""
        return f"{self.log(session_id)}:instage:{token}"

    def input_blob(self, session_id: str, job_id: str) -> str:
        """STRING: the staged payload of one queued step job; lives as long as its inbox entry.
        Every script gets it in KEYS (retire.lua too: Scripts.retire reads the inbox first)."""
        return f"{self.log(session_id)}:in:{job_id}"

    def record_blob(self, session_id: str, step_id: int) -> str:
        """STRING: the staged input of a committed step's record, kept and dropped with the record.
        prelude.lua's record_blob builds the same name from the log key (retention, reset, close, fork)."""
        return f"{self.log(session_id)}:inrec:{step_id}"

    def reply(self, consumer: str) -> str:
        """STREAM of results for one trainer/consumer."""
        return f"{self.base}:reply:{consumer}"

    def in_place_reader(self, consumer: str) -> str:
        """STRING (SET PX): stands while the consumer's reply reader reads large results in place, where
        the session's log keeps them (broker/redis/blobs.py); prelude.lua's in_place_reader builds the
        same name from the reply stream's key."""
        return f"{self.reply(consumer)}:in_place"

    @staticmethod
    def in_place_marker(blob: str) -> str:
        """HASH named after a log's result blob (:meth:`result_blob`): its field names the reply blob of
        the blob's unread in-place reply (broker/redis/blobs.py); prelude.lua's in_place_marker builds
        the same name."""
        return f"{blob}:reader"

    def staged_reply(self, consumer: str, job_id: str, worker_id: str) -> str:
        """STRING: a large stateless result a worker wrote just before report.lua publishes it."""
        return f"{self.reply(consumer)}:stage:{job_id}:{worker_id}"

    def reply_blob(self, consumer: str, job_id: str) -> str:
        """STRING: the large result of one reply entry (the entry holds a reference to it)."""
        return f"{self.reply(consumer)}:blob:{job_id}"

    def handled(self, consumer: str, group: str) -> str:
        """HASH of "session:step" a consumer group has handled (duplicates are recognised here)."""
        return f"{self.base}:handled:{consumer}:{group}"

    @property
    def control(self) -> str:
        """STREAM of control messages every worker reads (weight updates)."""
        return f"{self.base}:control"

    @property
    def announced(self) -> str:
        """HASH model -> the highest policy version announced on the control stream (only ever
        raised): what max_staleness and admission compare against (broker/ops/weights.py)."""
        return f"{self.base}:announced"

    def admission(self, name: str) -> str:
        """HASH model -> trajectories admitted under one producer's admission bound (create.lua)."""
        return f"{self.base}:admission:{name}"

    @property
    def dead(self) -> str:
        """STREAM of dead-lettered jobs."""
        return f"{self.base}:dead"

    @property
    def stats(self) -> str:
        """STREAM of per-interval step summaries from every worker and of failovers, capped
        (XADD MAXLEN ~): the dashboard reads its last minutes (broker.ops.cell_stats)."""
        return f"{self.base}:stats"

    @property
    def supervisor_lock(self) -> str:
        """STRING lock so that one supervisor at a time runs a reaping pass."""
        return f"{self.base}:lock:reap"

    @property
    def write_probe(self) -> str:
        """STRING (SET PX, 1 s): ``status --check`` writes it to learn whether Redis takes writes
        in the cell's slot (broker/ops/status.py)."""
        return f"{self.base}:probe:write"

    def pass_claim(self, name: str) -> str:
        """STRING (SET NX PX, one period long): which supervisor runs this period's ``name`` pass
        (reap, trim) where no arq schedules them, on a Redis Cluster (broker/ops/pass_loop.py)."""
        return f"{self.base}:pass:{_pass_name(name)}"

    @property
    def arq_queue(self) -> str:
        """arq queue of the cell's control-plane jobs (supervisor cron, replays)."""
        return f"{self.base}:arq"

    @property
    def sessions(self) -> str:
        """HASH session id -> owner of every live session (failover finds a worker's sessions here)."""
        return f"{self.base}:sessions"

    @property
    def trainer_caps(self) -> str:
        """HASH trainer -> cap on its open sessions in this cell, set by an operator (``rollout-fleet
        trainers set-cap``); field ``*``: the cap of every trainer without its own. No field: no cap."""
        return f"{self.base}:trainer_caps"

    @property
    def trainer_open(self) -> str:
        """HASH trainer -> its open sessions in this cell: +1 in create.lua, -1 when apply_control.lua
        applies the close (as the owned hash is kept); a field that reaches 0 is removed."""
        return f"{self.base}:trainer_open"

    def gateway_open(self, key_digest: str) -> str:
        """SET of the open sessions the gateway created for one API key (by the key's digest)."""
        return f"{self.base}:gateway:open:{key_digest}"
