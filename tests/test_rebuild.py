"""Step-record digests: records written by earlier releases (blake2b-16, no ``digest_kind``) keep
their digest whatever the codec's framing, so a new owner checks its replay of them; new records
use xxh3-128 and say so."""

from __future__ import annotations

import numpy as np
import pytest

from broker import FleetClient
from schemas.codec import decode
from schemas.errors import ContextLost
from schemas.messages import Mode
from tests.support import WorkerPool, until, world_step
from workers.engines.null import NullEngine
from workers.rebuild import BLAKE2B_16, DIGEST_KIND, XXH3_128, output_digest, record_digest_kind, step_record

# output_digest of OUTPUT as the previous release (blake2b-16 over plain msgpack, no frame) computed it.
PREVIOUS_RELEASE_DIGEST = "e7d66c89e031c1859ecb94c770a7e66d"


def _output() -> dict[str, object]:
    return {"video_latent": np.arange(24, dtype=np.float32).reshape(1, 2, 3, 4), "token_ids": [5, 6, 7],
            "meta": {"steps": 3, "name": "w", "state": np.arange(3, dtype=np.int16)}, "logprobs": [-0.5, -1.25]}


def test_a_legacy_digest_of_an_output_is_the_previous_releases() -> None:
    assert output_digest(_output(), BLAKE2B_16).hex() == PREVIOUS_RELEASE_DIGEST


# output_digest of _layouts() as ec71c4f computed it (every array copied to C
# order and hashed as bytes, every other value through encode_plain's encoder): a digest is of the
# values, not of how they are laid out or how the digest reaches them.
LAYOUT_DIGESTS = {XXH3_128: "a8130edb8da26bc84e48ef99f6dbc186", BLAKE2B_16: "93a388cda62fcab15eb083b070945957"}


def _layouts() -> dict[str, object]:
    grid = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    read_only = np.arange(4, dtype=np.int16)
    read_only.flags.writeable = False
    return {"strided": grid[:, ::2, :], "fortran": np.asfortranarray(grid), "big_endian": np.arange(6, dtype=">i4"),
            "scalar": np.array(5, dtype=np.int64), "empty": np.zeros((0, 3), np.float16), "read_only": read_only,
            "flags": np.array([True, False]), "context": 7, "name": "w", "none": None, "raw": b"\x00\x01"}


@pytest.mark.parametrize("kind", [XXH3_128, BLAKE2B_16])
def test_a_digest_is_the_same_for_every_layout_of_an_array_as_before(kind: str) -> None:
    assert output_digest(_layouts(), kind).hex() == LAYOUT_DIGESTS[kind]
    for _ in range(2):  # the second time from the array heads kept after the first
        assert output_digest(_layouts(), kind).hex() == LAYOUT_DIGESTS[kind]


@pytest.mark.parametrize("kind", [XXH3_128, BLAKE2B_16])
def test_digest_sees_a_change_in_a_nested_array(kind: str) -> None:
    changed = _output()
    changed["meta"] = {"steps": 3, "name": "w", "state": np.array([0, 1, 3], dtype=np.int16)}
    assert output_digest(changed, kind) != output_digest(_output(), kind)
    assert len(output_digest(_output(), kind)) == 16


def test_new_records_name_their_digest_and_old_ones_read_as_blake2b() -> None:
    record = decode(step_record(b"payload", _output(), version=0, context_length=1, mode=Mode.WORLD_MODEL_ENV))
    assert record["digest_kind"] == DIGEST_KIND == XXH3_128
    assert record["digest"] == output_digest(_output(), XXH3_128) != output_digest(_output(), BLAKE2B_16)
    del record["digest_kind"]
    assert record_digest_kind(record) == BLAKE2B_16


def test_a_digest_of_an_unknown_kind_is_a_lost_context_not_a_crash() -> None:
    with pytest.raises(ContextLost, match="unknown kind 'sha3-512'"):
        output_digest(_output(), "sha3-512")


async def test_rebuilds_leave_no_growing_list_on_the_executor(fleet: FleetClient, workers: WorkerPool) -> None:
    """A long-lived worker rebuilds contexts without end: what it keeps of them is counts and the
    rebuild histogram, never one list entry per rebuild."""
    running = await workers.add(NullEngine())
    session = await fleet.create_session(model="null-world", mode="world_model_env")
    assert (await session.step(0, **world_step(0))).ok
    executor, rebuilds = running.worker.executor, 8

    async def idle() -> bool:  # the reply can come before the worker applied its commit
        return running.worker._active == 0

    for step in range(1, rebuilds + 1):
        await until(idle, "the worker done with the last step")
        running.worker._sessions[session.session_id].engine_ready = False  # as after a takeover
        assert (await session.step(step, **world_step(step))).ok
    assert executor.rebuilt_steps == sum(range(1, rebuilds + 1))  # each rebuild replayed steps 0..step-1
    histogram = executor.metrics.fleet.context_rebuild_seconds.collect()[0]
    assert [s.value for s in histogram.samples if s.name.endswith("_count")] == [rebuilds]
    assert not [name for name, value in vars(executor).items() if isinstance(value, list) and len(value) >= rebuilds]
