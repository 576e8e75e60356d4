"""Collectives: every op x dtype x size, uneven all_to_all, subgroups, async, p2p, barrier, timeout.

All checks run in one multi-rank session of real processes (chipset.conformance._world);
each test here reports one check's verdict over every rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from chipset.conformance._collective_checks import CHECK_IDS, WORLD
from chipset.conformance._world import run_world

if TYPE_CHECKING:
    from chipset.loader import Backend


@pytest.fixture(scope="module")
def session(request, backend_name, caps, backend: Backend):
    if not caps.multi_process:
        pytest.skip("backend does not declare capability multi_process")
    world = WORLD
    if not caps.ranks_share_device:
        # One rank per device, as real collective engines require.
        world = min(WORLD, backend.device.device_count())
        if world < 2:
            pytest.skip(
                f"needs 2 devices for a multi-rank session (ranks cannot share a device on this backend), "
                f"found {backend.device.device_count()}"
            )
    # Only the checks this run selected (``-k``) are run by the ranks.
    selected = [i.callspec.params["check"] for i in request.session.items
                if i.originalname == "test_collective" and hasattr(i, "callspec")]
    return run_world(backend_name, world, only=selected)


@pytest.mark.parametrize("check", CHECK_IDS)
def test_collective(session, check):
    outcome, reason = session.verdict(check)
    if outcome == "skipped":
        pytest.skip(reason)
    if outcome == "failed":
        pytest.fail(reason, pytrace=False)
