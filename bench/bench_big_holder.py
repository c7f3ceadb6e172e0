"""Benchmark of a big holder's heartbeat: 100,000 holdings on one agent.

Size: the signed heartbeat message of ``SiteSession.heartbeat_message`` in the expanded form
(one object per expert, what agents sent before) and in the compact form at each
``committed_tps`` precision (exact, power of two, none), as a ratio to the socket's 1 MiB
cap (goal < 1). The holdings are the worst case for ranges: residency and committed_tps
vary from expert to expert; a holder of whole idle layers is shown too.

Ingest: ``registry.heartbeat.ingest`` of that compact heartbeat on the site, first (100,000
inserts) and repeated unchanged (the steady state every heartbeat interval), against a
baseline measured in the same run: signature verification plus parsing alone (no
database), so the ratio shows what the database costs. Throw-away SQLite file (or
``DATABASE_URL`` when set). Run: ``python bench/bench_big_holder.py``.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
_TMP = tempfile.mkdtemp(prefix="tenzro-bench-")
os.environ.setdefault("TENZRO_VAR_DIR", _TMP)
os.environ.setdefault("DATABASE_URL", f"sqlite:///{_TMP}/bench.sqlite3")
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tenzro_site.settings")

import django  # noqa: E402

django.setup()

from django.core.management import call_command  # noqa: E402
from django.db import connection  # noqa: E402
from nacl.signing import SigningKey  # noqa: E402

from moe import messages  # noqa: E402
from registry.heartbeat import ingest, parse_holdings  # noqa: E402
from moe.identity import DOMAIN_HEARTBEAT, provider_id, sign_body, verify_body  # noqa: E402
from registry.models import Holding, MoeModel  # noqa: E402

N, CAP = 100_000, 1 << 20
# Heartbeats may name only slots of a model the site knows (registry.heartbeat): a published
# model of 100 MoE layers × 1,000 experts holds the 100,000 (no catalog model has that many).
MODEL = "bench-big-holder"


def publish_shape() -> None:
    """The ``MoeModel`` row of ``MODEL`` in the throw-away database (no blobs: only its slots count)."""
    MoeModel.objects.update_or_create(model_id=MODEL, defaults=dict(
        family="qwen3_moe", num_experts=1000, top_k=8, hidden_size=2048, expert_d_ff=768,
        moe_layers=list(range(N // 1000))))


def holdings(worst: bool) -> list[dict]:
    """``N`` expanded holdings of 100 layers × 1,000 experts (varying residency and tps when ``worst``)."""
    return [{"model_id": MODEL, "layer": i // 1000, "expert": i % 1000,
             "residency": ("Warm" if (i * 7919) % 3 else "Cold") if worst else "Warm",
             "committed_tps": (i * 104729) % 5000 if worst else 0, "blob_uri": "tenzro://blob/" + "ab" * 32}
            for i in range(N)]


def message(key: SigningKey, entries: list[dict]) -> dict:
    body = {"provider": provider_id(key), "timestamp_ms": int(time.time() * 1000), "nonce": os.urandom(8).hex(),
            "holdings": entries}
    return messages.heartbeat(body, sign_body(key, DOMAIN_HEARTBEAT, body))


def main() -> None:
    key = SigningKey.generate()
    worst, idle = holdings(True), holdings(False)
    print(f"heartbeat of {N:,} holdings, bytes (ratio to the {CAP:,}-byte cap; goal < 1):")
    rows = [("expanded (before)", worst)] + [
        (f"compact, tps {name}", messages.compact_holdings(worst, p)) for p, name in enumerate(("exact", "pow2", "none"))]
    rows.append(("compact, whole idle layers", messages.compact_holdings(idle)))
    for name, entries in rows:
        size = len(json.dumps(message(key, entries)))
        print(f"  {name:<28} {size:>12,}  {size / CAP:8.3f}")

    call_command("migrate", verbosity=0)
    publish_shape()
    fitted = next(p for p in range(3) if len(json.dumps(message(key, messages.compact_holdings(worst, p)))) <= CAP)
    entries = messages.compact_holdings(worst, fitted)
    m = message(key, entries)
    t = time.perf_counter()
    verify_body(m["body"]["provider"], DOMAIN_HEARTBEAT, m["body"], m["signature"])
    parse_holdings(m["body"]["holdings"])
    base = time.perf_counter() - t
    times = []
    for _ in range(2):
        m = message(key, entries)
        t = time.perf_counter()
        ingest(m)
        times.append(time.perf_counter() - t)
        time.sleep(0.002)  # a strictly newer timestamp
    assert Holding.objects.filter(provider_id=provider_id(key)).count() == N
    print(f"ingest on {connection.vendor} (baseline: verify + parse, no database: {base:.3f} s):")
    print(f"  first (100,000 inserts)      {times[0]:8.3f} s  {times[0] / base:6.1f}x baseline")
    print(f"  repeated, unchanged          {times[1]:8.3f} s  {times[1] / base:6.1f}x baseline")
    Holding.objects.filter(provider_id=provider_id(key)).delete()  # DATABASE_URL may be a kept database
    MoeModel.objects.filter(model_id=MODEL).delete()


if __name__ == "__main__":
    main()
