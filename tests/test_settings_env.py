"""A malformed data-plane environment variable stops the process at start-up with a message
naming it, instead of a bare ``float()`` traceback or being silently read as something else
(``TENZRO_DATA_TRANSPORT=quic`` ran the socket transport, ``TENZRO_COALESCE=OFF`` and ``=maybe``
left coalescing on, ``TENZRO_BATCH_DEADLINE=-1`` hedged every batch at once)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.cluster_util import ROOT


def _check(tmp_path, **env) -> subprocess.CompletedProcess:
    full = {**os.environ, "TENZRO_VAR_DIR": str(tmp_path), **env}
    return subprocess.run([sys.executable, "-c", "import tenzro_site.settings"], cwd=ROOT, env=full,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("name, value, says", [
    ("TENZRO_DATA_TRANSPORT", "quic", "must be one of ws, http, iroh, got 'quic'"),
    ("TENZRO_COALESCE", "maybe", "must be one of 1, 0, true, false, yes, no, on, off, got 'maybe'"),
    ("TENZRO_COALESCE", "OFF", "got 'OFF'"),
    ("TENZRO_BATCH_DEADLINE", "abc", "must be a number of seconds above 0, got 'abc'"),
    ("TENZRO_BATCH_DEADLINE", "-1", "above 0, got '-1'"),
    ("TENZRO_BATCH_TIMEOUT", "0", "above 0, got '0'"),
    ("TENZRO_BATCH_TIMEOUT", "nan", "got 'nan'"),
    ("TENZRO_FORWARD_QUEUE_WAIT", "inf", "seconds >= 0, got 'inf'"),
    ("TENZRO_VIEW_CACHE", "-0.5", ">= 0, got '-0.5'"),
    ("TENZRO_IROH_BIND", "nonsense", "must be HOST:PORT (port 0 = a free one), got 'nonsense'"),
    ("TENZRO_IROH_BIND", "127.0.0.1:70000", "got '127.0.0.1:70000'"),
    # Counts below their least meaningful value: 0 forward slots or prompts stall every request,
    # a negative budget or queue was read as "no limit" or "refuse all" depending on the caller.
    ("TENZRO_FORWARD_CONCURRENCY", "0", "an integer >= 1, got '0'"),
    ("TENZRO_GEN_MAX_PROMPTS", "-5", "an integer >= 1, got '-5'"),
    ("TENZRO_PREFILL_CHUNK", "0", ">= 1, got '0'"),
    ("TENZRO_KV_BUDGET_BYTES", "-1", ">= 1, got '-1'"),
    ("TENZRO_RPC_MAX_BATCH", "0", ">= 1, got '0'"),
    ("TENZRO_GEN_MICROBATCHES", "0", ">= 1, got '0'"),
    ("TENZRO_HEARTBEAT_INTERVAL", "0", ">= 1, got '0'"),
    ("TENZRO_FORWARD_QUEUE", "-1", ">= 0, got '-1'"),
    ("TENZRO_DB_POOL", "-1", ">= 0, got '-1'"),
    ("TENZRO_GEN_QUEUE", "x", "must be an integer, got 'x'"),
    ("DATABASE_URL", "bogus://x", "a dj-database-url URL such as postgres://user@host/db or sqlite:///path, got 'bogus://x'"),
    ("TENZRO_KV_HANDOFF", "x", "must be one of peer, site, got 'x'"),
    ("TENZRO_STREAM_ANSWERS", "perhaps", "must be one of 1, 0, true, false, yes, no, on, off, got 'perhaps'"),
])
def test_a_malformed_data_plane_variable_is_refused_naming_it(tmp_path, name, value, says):
    res = _check(tmp_path, **{name: value})
    assert res.returncode != 0
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith(f"RuntimeError: {name} must be ") and says in last


def test_the_documented_values_are_accepted(tmp_path):
    res = _check(tmp_path, TENZRO_DATA_TRANSPORT="iroh", TENZRO_COALESCE="off", TENZRO_BATCH_DEADLINE="0.5",
                 TENZRO_BATCH_TIMEOUT="30", TENZRO_FORWARD_QUEUE_WAIT="0", TENZRO_VIEW_CACHE="0",
                 TENZRO_IROH_BIND="[::1]:0", TENZRO_FORWARD_QUEUE="0", TENZRO_FORWARD_RATE="0",
                 TENZRO_DB_POOL="0", TENZRO_GEN_MICROBATCHES="1", TENZRO_KV_HANDOFF="site",
                 TENZRO_STREAM_ANSWERS="off", TENZRO_PLAN_SPLIT_THRESHOLD="0")
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("env, says", [
    ({"TENZRO_SITE_ID": "site0"}, "TENZRO_SITE_ID and TENZRO_SITE_IDS go together"),
    ({"TENZRO_SITE_IDS": "site0,site1"}, "TENZRO_SITE_ID and TENZRO_SITE_IDS go together"),
    ({"TENZRO_SITE_ID": "site2", "TENZRO_SITE_IDS": "site0,site1"}, "'site0,site1' must include TENZRO_SITE_ID 'site2'"),
    ({"TENZRO_SITE_ID": "a b", "TENZRO_SITE_IDS": "a b"}, "'a b' is not a server name"),
])
def test_site_ids_are_both_or_neither_server_names_holding_the_own(tmp_path, env, says):
    res = _check(tmp_path, **env)
    assert res.returncode != 0 and says in res.stderr.strip().splitlines()[-1]
    assert _check(tmp_path, TENZRO_SITE_ID="site1", TENZRO_SITE_IDS="site0, site1").returncode == 0
