"""schemathesis against the OpenAPI schema of the REST mirror, in-process over WSGI: no server error.

Every operation of ``/api/schema/`` is fuzzed with schema-conforming and non-conforming
inputs, with and without the operator credential, over a registry that holds a provider,
a published-looking shard map and an open proposal. The only check is
``not_a_server_error``: the API must answer 4xx for bad input, never 5xx.
"""
from __future__ import annotations

import pytest
import schemathesis
from django.core import signals
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections
from hypothesis import HealthCheck, settings as hsettings
from nacl.signing import SigningKey
from schemathesis.checks import not_a_server_error

from registry import governance
from registry.heartbeat import ingest
from registry.operator import operator_token
from tests.conftest import signed_heartbeat


@pytest.fixture
def api_schema(db, settings):
    """The schema served by the app, with a small registry behind it and throttles relaxed."""
    settings.TENZRO = {**settings.TENZRO, "API_READ_RATE": "100000/min", "API_WRITE_RATE": "100000/min"}
    # Like Django's test client: keep the test transaction's connection across requests.
    signals.request_started.disconnect(close_old_connections)
    signals.request_finished.disconnect(close_old_connections)
    ingest(signed_heartbeat(SigningKey(b"\x01" * 32), [{"model_id": "qwen3-30b-a3b", "layer": 0, "experts": "0-7"}]))
    governance.create_proposal("raise min", {"min_replication": 3}, "operator")
    try:
        yield schemathesis.openapi.from_wsgi("/api/schema/", get_wsgi_application())
    finally:
        signals.request_started.connect(close_old_connections)
        signals.request_finished.connect(close_old_connections)


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@hsettings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_server_error(case):
    """Anonymous calls: 2xx/4xx only."""
    case.call_and_validate(checks=[not_a_server_error])


@schema.parametrize()
@hsettings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_server_error_as_operator(case):
    """Calls with the operator credential reach the management paths: still 2xx/4xx only."""
    case.call_and_validate(checks=[not_a_server_error], headers={"Authorization": f"Bearer {operator_token()}"})
