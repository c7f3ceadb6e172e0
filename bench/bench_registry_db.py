"""Benchmark of the registry's database paths: heartbeat ingest and the shard map from rows.

Heartbeat: one provider's signed heartbeat with 1,000 holdings (8 layers × 125 experts),
verified and applied (signature, parse, atomic replace of the holdings set), in the
expanded form and in the compact form (8 range entries); goal ≤ 50 ms. Baseline measured
in the same run: signature verification + parsing alone (no database), so the ratio shows
what the database write costs. For scale, a whole Kimi K2 (60 × 385 = 23,100 slots) in
compact form is ingested too.

Shard map: Kimi-K2 size (61 layers × 385 slots, 3 replicas, 500 providers) loaded from the
database and serialized (``selectors.shard_map_json``, the ``tenzro_moeShardMap`` result);
goal ≤ 0.5 s. Cold (cache cleared: read 70k rows, build, serialize) and with an unchanged
registry (the per-process cache keyed on every input); the pure in-memory build is in
``bench_registry.py``.

Runs on a throw-away SQLite file (or ``DATABASE_URL`` when set). Prints one line per
measurement (best of several runs) with its ratio to the goal. Run:
``python bench/bench_registry_db.py``.
"""
from __future__ import annotations

import argparse
import hashlib
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
from nacl.signing import SigningKey  # noqa: E402

from moe.identity import DOMAIN_HEARTBEAT, canonical_json, provider_id, sign_body, verify_body  # noqa: E402
from registry.heartbeat import ingest, parse_holdings  # noqa: E402
from registry.models import Holding, Provider  # noqa: E402
from registry import selectors  # noqa: E402

LAYERS, PER_LAYER = 8, 125
KIMI, K_LAYERS, K_SLOTS, K_REPLICAS, K_PROVIDERS = "kimi-k2-instruct", 61, 385, 3, 500


def _message(key: SigningKey, holdings: list, ts: int) -> dict:
    body = {"provider": provider_id(key), "timestamp_ms": ts, "nonce": os.urandom(8).hex(), "name": "bench",
            "roles": ["ExpertHolder"], "http_endpoint": "", "iroh_endpoint_id": "", "moe_gpu": False,
            "holdings": holdings}
    return {"body": body, "signature": sign_body(key, DOMAIN_HEARTBEAT, body)}


def _expanded(shift: int) -> list:
    blob = "tenzro://blob/" + "ab" * 32
    return [{"model_id": "m", "layer": layer, "expert": (e + shift) % 256, "residency": "Warm", "committed_tps": 0,
             "blob_uri": blob} for layer in range(LAYERS) for e in range(PER_LAYER)]


def _compact(shift: int) -> list:  # the same 1,000 experts as _expanded(shift) when shift + 125 <= 256
    return [{"model_id": "m", "layer": layer, "experts": f"{shift}-{shift + PER_LAYER - 1}"} for layer in range(LAYERS)]



_LAST_TS = [0]


def _newer_ts() -> int:
    """The wall clock in ms, strictly above every timestamp used before (the site refuses replays)."""
    _LAST_TS[0] = max(int(time.time() * 1000), _LAST_TS[0] + 1)
    return _LAST_TS[0]


def _best_ingest(key: SigningKey, make, repeat: int) -> float:
    best = float("inf")
    for i in range(repeat):
        msg = _message(key, make(i), _newer_ts())
        t0 = time.perf_counter()
        ingest(msg)
        best = min(best, time.perf_counter() - t0)
    return best


def _best(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _load_kimi() -> None:
    """500 live providers, each Kimi slot on 3 of them (round-robin with a stride), mixed residency/tps."""
    from django.utils import timezone

    ids = [hashlib.sha256(f"provider-{i}".encode()).hexdigest() for i in range(K_PROVIDERS)]
    now = timezone.now()
    Provider.objects.bulk_create([
        Provider(provider=p, name=f"p{i}", roles=["ExpertHolder", "Router"] if i % 10 == 0 else ["ExpertHolder"],
                 moe_gpu=i % 4 == 0, http_endpoint=f"http://10.0.{i // 256}.{i % 256}:8545/rpc", connected=True,
                 last_heartbeat=now, reputation=(i * 37) % 1001) for i, p in enumerate(ids)])
    rows = []
    for layer in range(K_LAYERS):
        for expert in range(K_SLOTS):
            start = (layer * 7919 + expert * 104729) % K_PROVIDERS
            for r in range(K_REPLICAS):
                i = (start + r * 167) % K_PROVIDERS
                rows.append(Holding(provider_id=ids[i], model_id=KIMI, layer=layer, expert=expert,
                                    residency="Cold" if (layer + expert + r) % 5 == 0 else "Warm",
                                    committed_tps=1200 if i % 25 == 0 else (layer + expert) % 3 * 200,
                                    blob_uri="tenzro://blob/" + hashlib.blake2b(f"{layer}/{expert}".encode(),
                                                                                digest_size=32).hexdigest()))
    Holding.objects.bulk_create(rows, batch_size=5000)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmarks and print timings; exit code 0 (timings are informative). It takes no
    options: an unknown one is refused (exit 2) instead of silently ignored."""
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    call_command("migrate", verbosity=0)
    key = SigningKey(b"\x07" * 32)

    def line(name: str, seconds: float, goal: float | None, base: float | None = None) -> None:
        extra = f"  ratio to goal {seconds / goal:.2f}" if goal else ""
        extra += f"  ratio to baseline {seconds / base:.2f}" if base else ""
        print(f"{name:<52} {seconds * 1e3:9.2f} ms{extra}")

    sample = _message(key, _expanded(0), _newer_ts())
    compact = _message(key, _compact(0), _newer_ts())
    print(f"heartbeat body: expanded {len(canonical_json(sample['body']))} B, "
          f"compact {len(canonical_json(compact['body']))} B for {LAYERS * PER_LAYER} holdings")
    t_base = _best(lambda: (verify_body(sample["body"]["provider"], DOMAIN_HEARTBEAT, sample["body"],
                                        sample["signature"]), parse_holdings(sample["body"]["holdings"])), 20)
    # Steady state: the same 1,000 holdings again (the usual heartbeat); full replace: alternate
    # between two disjoint sets, so every heartbeat deletes 1,000 rows and inserts 1,000.
    t_exp_same = _best_ingest(key, lambda i: _expanded(0), 20)
    t_exp_swap = _best_ingest(key, lambda i: _expanded(128 * (i % 2)), 20)
    assert Holding.objects.filter(provider_id=provider_id(key)).count() == LAYERS * PER_LAYER
    t_cmp_same = _best_ingest(key, lambda i: _compact(0), 20)
    t_cmp_swap = _best_ingest(key, lambda i: _compact(128 * (i % 2)), 20)
    assert Holding.objects.filter(provider_id=provider_id(key)).count() == LAYERS * PER_LAYER
    t_whole = _best_ingest(key, lambda i: [{"model_id": KIMI, "layers": "1-60", "experts": "0-384"}], 3)
    Holding.objects.all().delete()
    Provider.objects.all().delete()

    line("baseline: verify + parse 1,000 holdings (no DB)", t_base, None)
    line("ingest 1,000 expanded, unchanged set (goal 50 ms)", t_exp_same, 0.050, t_base)
    line("ingest 1,000 expanded, full replace (goal 50 ms)", t_exp_swap, 0.050, t_base)
    line("ingest 1,000 compact, unchanged set (goal 50 ms)", t_cmp_same, 0.050, t_base)
    line("ingest 1,000 compact, full replace (goal 50 ms)", t_cmp_swap, 0.050, t_base)
    line("ingest whole Kimi K2 compact (23,100), unchanged", t_whole, None)

    t0 = time.perf_counter()
    _load_kimi()
    print(f"setup: {Holding.objects.count()} holdings of {K_PROVIDERS} providers in {time.perf_counter() - t0:.1f} s")
    def cold():
        selectors._VIEWS.clear()
        return selectors.shard_map_json(KIMI)

    t_view = _best(lambda: (selectors._VIEWS.clear(), selectors.shard_view(KIMI)), 3)
    t_map = _best(cold, 3)
    t_warm = _best(lambda: selectors.shard_map_json(KIMI), 5)
    line("shard_view from DB, cold (61x385x3, 500 prov)", t_view, None)
    line("tenzro_moeShardMap from DB, cold (goal 500 ms)", t_map, 0.5)
    line("tenzro_moeShardMap from DB, unchanged registry", t_warm, 0.5)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
