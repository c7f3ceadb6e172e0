"""Holder outcomes of forwards recorded in the registry: reputation penalties and latency."""
from __future__ import annotations

import pytest

from registry.models import Provider
from registry.selectors import provider_infos
from registry.services import FAILURE_PENALTY, record_holder_outcomes

pytestmark = pytest.mark.django_db


def test_failures_cost_reputation_down_to_zero_and_successes_record_latency():
    a = Provider.objects.create(provider="a" * 64, reputation=12)
    b = Provider.objects.create(provider="b" * 64)
    record_holder_outcomes({a.provider: 1, "c" * 64: 3}, {b.provider: [10.0, 20.0]})
    a.refresh_from_db()
    b.refresh_from_db()
    assert a.reputation == 12 - FAILURE_PENALTY and a.batch_failures == 1
    assert b.batches_served == 2 and b.latency_ms_ewma == pytest.approx(0.8 * 10.0 + 0.2 * 20.0)
    record_holder_outcomes({a.provider: 5}, {})
    a.refresh_from_db()
    assert a.reputation == 0 and a.batch_failures == 6
    provider_infos()  # a floored reputation still builds planner rows
