"""Shared test helpers: fixture paths, signing helpers, and real-service detection."""
from __future__ import annotations

import os
import secrets
import socket
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from nacl.signing import SigningKey

from moe.identity import DOMAIN_HEARTBEAT, provider_id, sign_body

FIXTURES = Path(__file__).parent / "fixtures"
QWEN = FIXTURES / "qwen3_moe_tiny"
DEEPSEEK = FIXTURES / "deepseek_v3_tiny"
QWEN2 = FIXTURES / "qwen2_moe_tiny"  # written by tests/fixtures/make_hf_fixtures.py
MIXTRAL = FIXTURES / "mixtral_tiny"
QWEN2_TRAINED = FIXTURES / "qwen2_moe_trained"  # trained, H 256, with tokenizer.json (same script)

REDIS_URL = os.environ.get("TENZRO_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
PG_URL = os.environ.get("TENZRO_TEST_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres")
REQUIRE_SERVICES = os.environ.get("TENZRO_REQUIRE_SERVICES") == "1"


def _reachable(url: str) -> bool:
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname, parts.port), timeout=1):
            return True
    except OSError:
        return False


SERVICES_UP = _reachable(REDIS_URL) and _reachable(PG_URL)

# In CI (.ci/run sets TENZRO_REQUIRE_SERVICES=1) a missing service fails the run instead of skipping.
needs_services = pytest.mark.skipif(
    not SERVICES_UP and not REQUIRE_SERVICES,
    reason=f"Redis ({REDIS_URL}) and PostgreSQL ({PG_URL}) not reachable; .ci/run starts them")


def pytest_collection_modifyitems(config, items):
    """Run browser tests last: Playwright's sync API (session-scoped in pytest-playwright) keeps an
    event loop running in the main thread, which asyncio tests after it could not start."""
    items.sort(key=lambda item: item.get_closest_marker("browser") is not None)


def signed_heartbeat(key: SigningKey, holdings=(), ts_ms: int | None = None, **fields) -> dict:
    """A heartbeat message signed by ``key`` (fields override the body)."""
    body = {"provider": provider_id(key), "timestamp_ms": ts_ms or int(time.time() * 1000),
            "nonce": secrets.token_hex(16), "name": "test", "roles": ["ExpertHolder"], "http_endpoint": "",
            "iroh_endpoint_id": "", "moe_gpu": False, "holdings": list(holdings), **fields}
    return {"type": "heartbeat", "body": body, "signature": sign_body(key, DOMAIN_HEARTBEAT, body)}


def with_repeated_key(message: dict, key: str, first_value) -> str:
    """``message`` as JSON text whose ``body`` repeats ``key``: ``first_value`` first, then the
    signed value (which Python's ``json.loads`` keeps, other parsers may not)."""
    import json

    body = json.dumps(message["body"])
    return json.dumps({**message, "body": None}).replace(
        '"body": null', '"body": {' + json.dumps(key) + ": " + json.dumps(first_value) + ", " + body[1:])


def holding(model_id="m", layer=0, expert=0, residency="Warm", **kw) -> dict:
    """A holding dict for heartbeats."""
    return {"model_id": model_id, "layer": layer, "expert": expert, "residency": residency,
            "committed_tps": kw.get("committed_tps", 0), "blob_uri": kw.get("blob_uri", "")}


@pytest.fixture(autouse=True)
def _fresh_cache():
    """Each test starts with an empty Django cache: throttle and rate-limit windows from earlier
    tests (schemathesis sends hundreds of requests) must not leak into the next one."""
    from django.conf import settings

    if settings.configured:
        from django.core.cache import cache

        cache.clear()
    yield
