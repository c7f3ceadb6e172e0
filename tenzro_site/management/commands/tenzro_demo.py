"""``python manage.py tenzro_demo``: the main job — distributed MoE forwards on real checkpoints.

The demo keeps its own state (``$TENZRO_VAR_DIR/demo/``: agent keys, blobs, logs, operator
token and an SQLite database there), so an operator's ``tenzro_cluster`` in the same checkout
never sees the demo's providers, models or the holder its failover scene kills.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from moe import wire
from tenzro_site.cluster import ClusterError, LocalCluster
from prepare.dense import dense_model_id
from tenzro_site.management.commands.verify_generate import table as generation_table
from tenzro_site.verify import REL_TOLERANCE, verify_dense_layers, verify_generation, verify_layers
from prepare.quantplan import QuantPlanError, parse_quant_plan
from prepare.services import default_model_id
from registry.selectors import shard_view

FIXTURES = ("qwen3_moe_tiny", "deepseek_v3_tiny")

#: Set in the demo's own process (see :func:`demo_environment`): its settings are the demo's.
DEMO_MARKER = "TENZRO_DEMO_STATE"


def demo_environment(environ: dict, var_dir: Path) -> dict:
    """The environment the demo runs in: ``var_dir / "demo"`` as ``TENZRO_VAR_DIR``, its own
    blob dir, and ``TENZRO_DEMO_DATABASE_URL`` (default: SQLite in that dir) as ``DATABASE_URL``;
    Redis only from ``TENZRO_DEMO_REDIS_URL``, with its own channel prefix and Celery queue. The
    operator's ``DATABASE_URL``, ``REDIS_URL``, key, blob dir and token never reach it."""
    demo_dir = Path(var_dir) / "demo"
    env = {k: v for k, v in environ.items()
           if k not in {"DATABASE_URL", "REDIS_URL", "TENZRO_BLOB_DIR", "TENZRO_KEY_FILE", "TENZRO_OPERATOR_TOKEN",
                        "TENZRO_CHANNEL_PREFIX", "TENZRO_CELERY_QUEUE", "TENZRO_TEST_SQLITE_FILE"}}
    env.update({DEMO_MARKER: "1", "TENZRO_VAR_DIR": str(demo_dir),
                "DATABASE_URL": environ.get("TENZRO_DEMO_DATABASE_URL") or f"sqlite:///{demo_dir / 'db.sqlite3'}"})
    if environ.get("TENZRO_DEMO_REDIS_URL"):
        env.update({"REDIS_URL": environ["TENZRO_DEMO_REDIS_URL"], "TENZRO_CHANNEL_PREFIX": "tenzro-demo",
                    "TENZRO_CELERY_QUEUE": "tenzro-demo"})
    return env


def row_checks(r: dict) -> str:
    """The last columns of a layer row of the summary: error vs the dense forward (quantized
    rows), ms, whether sharded equals monolithic exactly, and the tolerance check vs
    transformers, which only dense rows must meet (a quantized row reports its error, unchecked)."""
    quantized = "max_rel_err_vs_dense" in r
    vs_dense = f"{r['max_rel_err_vs_dense']:.3e}" if quantized else "(dense)"
    exact = "yes" if r["max_abs_diff_vs_monolithic"] == 0.0 else "NO (FAILED)"
    if quantized:
        vs_ref = f"not checked ({r['quant'] if isinstance(r.get('quant'), str) else 'quantized'})"
    else:
        vs_ref = "ok" if r["max_rel_err_vs_reference"] <= REL_TOLERANCE else "FAILED"
    return f"{vs_dense:>17} {r['ms']:>7.1f}  {exact:<21}  {vs_ref}"


def _ref_dir(checkpoint: Path) -> Path:
    """Where a checkpoint's reference bundles live: the directory, or a GGUF file's directory."""
    return checkpoint if checkpoint.is_dir() else checkpoint.parent


class Command(BaseCommand):
    help = ("Start the site and holder agents, publish and place real checkpoints' experts (replication 2), "
            "run a distributed forward of every MoE layer, compare with transformers and the monolithic "
            "forward, and print a summary. Exit 0 only when every check held.")

    def add_arguments(self, parser):
        parser.add_argument("--checkpoint", action="append", default=None,
                            help="checkpoint directory (or GGUF file) with reference.safetensors beside it "
                                 "(default: the shipped fixtures)")
        parser.add_argument("--holders", type=int, default=4, help="holder agents to start (at least 2; default 4)")
        parser.add_argument("--keep-running", action="store_true", help="leave the cluster up until Ctrl-C")
        parser.add_argument("--quant", default="q4_k_m",
                            help="also publish every checkpoint quantized with this preset or JSON object and report "
                                 "the quantized forward's error against the dense one ('none' to skip; default q4_k_m)")

    def handle(self, *args, **opts):
        if opts["holders"] < 2:  # before anything starts: the failover scene stops one holder
            raise CommandError(f"--holders {opts['holders']}: the demo needs at least 2 holders (its failover "
                               "scene stops one and another must take over)")
        for c in opts["checkpoint"] or []:
            if not Path(c).exists():
                raise CommandError(f"--checkpoint {c}: no such file or directory")
        if os.environ.get(DEMO_MARKER) != "1":
            self._exec_in_demo_state(opts)
        t0 = time.perf_counter()
        ckpts = [Path(c) for c in (opts["checkpoint"] or
                                   [settings.BASE_DIR / "tests" / "fixtures" / f for f in FIXTURES])]
        for c in ckpts:
            if not (_ref_dir(c) / "reference.safetensors").is_file():
                raise CommandError(f"--checkpoint {c}: no reference.safetensors beside the checkpoint "
                                   "(a GGUF file: in its directory)")
        try:
            plan = parse_quant_plan(opts["quant"])
        except QuantPlanError as exc:
            raise CommandError(f"--quant: {exc}") from exc
        quant = plan.to_json() if plan else None
        runs = [(c, None, None) for c in ckpts]
        if quant:
            label = plan.label if isinstance(quant, str) else "quant"
            runs += [(c, f"{default_model_id(c)}-{label.replace('_', '-')}", quant) for c in ckpts]

        def say(line: str) -> None:
            self.stdout.write(f"· {line}")

        try:
            cluster = LocalCluster([c for c, _, _ in runs], holders=opts["holders"], say=say,
                                   model_ids=[m for _, m, _ in runs], quants=[q for _, _, q in runs])
        except ClusterError as exc:
            raise CommandError(str(exc)) from exc
        results = []
        failover = None
        economy = None
        dense: list[tuple[str, dict]] = []
        generations: list[dict] = []
        try:
            cluster.start()
            t_up = time.perf_counter()
            for (ckpt, _, q), model_id in zip(runs, cluster.model_ids):
                view = shard_view(model_id).to_json()
                rows = verify_layers(cluster.rpc, model_id, ckpt, _ref_dir(ckpt) / "reference.safetensors", q)
                results.append((model_id, view, rows))
                if dense_model_id(model_id) in cluster.dense_ids:
                    dense += [(model_id, r) for r in verify_dense_layers(
                        cluster.rpc, model_id, ckpt, _ref_dir(ckpt) / "reference.safetensors", cluster.dense_parts)]
            economy = self._economy_scene(cluster, cluster.model_ids[0], ckpts[0])
            for (ckpt, _, q), model_id in zip(runs, cluster.model_ids):
                ref = _ref_dir(ckpt) / "generation_reference.safetensors"
                if q is None and ref.is_file():
                    generations.append(verify_generation(cluster.rpc, model_id, ref, "f32"))
            failover = self._failover_scene(cluster, cluster.model_ids[0], ckpts[0])
            if opts["keep_running"]:
                self.stdout.write(f"cluster running at {cluster.url} (Ctrl-C to stop)")
                while cluster.site and cluster.site.poll() is None:
                    time.sleep(1)
        except (ClusterError, ValueError, OSError) as exc:
            raise CommandError(str(exc)) from exc
        except KeyboardInterrupt:
            pass
        finally:
            cluster.stop()
        ok = self._summary(results, t_up - t0, time.perf_counter() - t0, opts["holders"], failover, dense, economy,
                           generations)
        if not ok:
            sys.exit(1)

    def _exec_in_demo_state(self, opts: dict) -> None:
        """Replace this process with the same command in the demo's own state (settings are read
        once per process, so the demo's var dir and database need a fresh one)."""
        argv = [sys.executable, str(Path(settings.BASE_DIR) / "manage.py"), "tenzro_demo",
                "--holders", str(opts["holders"]), "--quant", str(opts["quant"])]
        for c in opts["checkpoint"] or []:
            argv += ["--checkpoint", str(Path(c).resolve())]
        if opts["keep_running"]:
            argv.append("--keep-running")
        env = demo_environment(dict(os.environ), settings.VAR_DIR)
        self.stdout.write(f"· demo state in {env['TENZRO_VAR_DIR']} (database {env['DATABASE_URL']}); "
                          "a tenzro_cluster in this checkout does not see it")
        self.stdout.flush()
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, argv, env)

    def _economy_scene(self, cluster: LocalCluster, model_id: str, ckpt: Path, max_forwards: int = 60) -> dict:
        """Receipts economy: forwards of the first MoE layer until the router's secret keeps a
        batch (about 1 in ``receipt_sample_one_in``), the automatic audit of that receipt, and
        the settlements of every forward the demo ran (the failover scene runs after this)."""
        tensors = load_file(str(_ref_dir(ckpt) / "reference.safetensors"))
        layer = min(int(k[len("layer"):].split(".")[0]) for k in tensors if k.endswith(".hidden_states"))
        x = tensors[f"layer{layer}.hidden_states"].astype(np.float32)
        one_in = cluster.rpc("tenzro_moeReplicationPolicy", {})["receipt_sample_one_in"]
        before = {r["key"] for r in cluster.rpc("tenzro_moeListReceipts", {"limit": 1000})["receipts"]}
        batches = forwards = 0
        kept = None
        for i in range(max_forwards):
            res = cluster.rpc("tenzro_moeForward", {"model_id": model_id, "layer": layer, "d_model": int(x.shape[1]),
                                                    "hidden_states": wire.b64encode(wire.encode_f32(
                                                        x * np.float32(1 + i / 64)))})
            forwards += 1
            batches += res["receipts"]
            deadline = time.time() + 5
            while kept is None and time.time() < deadline:  # samples are written just after the answer
                new = [r for r in cluster.rpc("tenzro_moeListReceipts", {"limit": 1000})["receipts"]
                       if r["key"] not in before and r["forward_id"] == res["forward_id"]]
                kept = new[0] if new else None
                if kept is None and res["receipts"]:
                    time.sleep(0.2)
                else:
                    break
            if kept is not None:
                break
        audit = None
        if kept is not None:
            deadline = time.time() + 60
            while time.time() < deadline:
                got = cluster.rpc("tenzro_moeGetReceipt", {"key": kept["key"]})
                if got["dispute_outcome"] is not None:
                    audit = got["dispute_outcome"]
                    break
                time.sleep(0.3)
        time.sleep(1.0)  # settlements of the last forwards are written in the background
        settled = cluster.rpc("tenzro_moeListSettlements", {"limit": 1000})["settlements"]
        providers = {p["provider"]: p for p in cluster.rpc("tenzro_moeListProviders", {})["providers"]}
        return {"one_in": one_in, "forwards": forwards, "batches": batches, "kept": kept, "audit": audit,
                "settlements": settled, "providers": providers}

    def _economy_summary(self, eco: dict | None) -> bool:
        """Print the settlements per holder and the audit; True when the audit ran and passed."""
        if eco is None:
            return True
        w = self.stdout.write
        per: dict[str, dict] = {}
        for s in eco["settlements"]:
            row = per.setdefault(s["provider"], {"forwards": 0, "tokens": 0, "gross": 0, "holder": 0, "fee": 0})
            row["forwards"] += 1
            row["tokens"] += s["tokens"]
            row["gross"] += s["gross"]
            row["holder"] += s["holder_amount"]
            row["fee"] += s["network_fee"]
        w("")
        w("settlement of the demo's forwards (one record per forward and holder, exactly once):")
        w(f"{'holder':<16} {'forwards':>8} {'tokens':>8} {'gross':>10} {'holder share':>12} {'network fee':>11} "
          f"{'balance':>10} {'reputation':>10}")
        for pid, r in sorted(per.items()):
            p = eco["providers"].get(pid, {})
            w(f"{pid[:12] + '…':<16} {r['forwards']:>8} {r['tokens']:>8} {r['gross']:>10} {r['holder']:>12} "
              f"{r['fee']:>11} {p.get('balance', 0):>10} {p.get('reputation', 0):>10}")
        kept, audit = eco["kept"], eco["audit"]
        if kept is None:
            w(f"audit: no batch was kept in {eco['forwards']} forwards ({eco['batches']} batches) at 1 in "
              f"{eco['one_in']}  FAILED")
            return False
        if audit is None:
            w(f"audit: receipt {kept['key']} was kept but not audited in time  FAILED")
            return False
        v = audit["verification"]
        ok = not audit["disputed"] and v["pass"]
        w(f"audit: 1 in {eco['one_in']} sampling kept a batch after {eco['forwards']} forward(s) "
          f"({eco['batches']} remote batches): {kept['model_id']} l{kept['layer']}/e{kept['expert']} "
          f"({kept['tokens']} tokens) from {kept['provider'][:12]}…; re-executed by {audit['executed_by']}: "
          f"{v['rows_passed']}/{v['rows_total']} rows within tolerance -> "
          f"{'honest' if ok else 'UPHELD (fraud proof signed by the site)'}  {'ok' if ok else 'FAILED'}")
        return ok

    def _failover_scene(self, cluster: LocalCluster, model_id: str, ckpt: Path) -> dict:
        """Kill the busiest primary holder of the first MoE layer in the middle of that layer's
        forward: the backups take over and the output must equal the no-fault output exactly."""
        tensors = load_file(str(_ref_dir(ckpt) / "reference.safetensors"))
        layer = min(int(k[len("layer"):].split(".")[0]) for k in tensors if k.endswith(".hidden_states"))
        x = tensors[f"layer{layer}.hidden_states"].astype(np.float32)
        params = {"model_id": model_id, "layer": layer, "d_model": int(x.shape[1]), "carrier": "f32",
                  "hidden_states": wire.rows_to_b64(x)}
        before = cluster.rpc("tenzro_moeForward", params)
        view = shard_view(model_id).to_json()
        primaries = [h["holders"][0]["provider"] for h in view["holders"] if h["layer"] == layer]
        victim = max(sorted(set(primaries)), key=primaries.count)
        proc = next(p for pid, p in cluster.agents if pid == victim)
        self.stdout.write(f"· failover: holder {victim[:12]}… (primary of {primaries.count(victim)} experts of "
                          f"layer {layer}) is SIGKILLed while its batches are in flight")
        proc.send_signal(signal.SIGSTOP)  # hold its batches in flight, then kill it mid-forward
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(cluster.rpc, "tenzro_moeForward", params)
            time.sleep(0.5)
            proc.kill()
            proc.wait()
            after = fut.result()
        same = np.array_equal(wire.rows_from_b64(before["outputs"], x.shape[1], field="outputs"),
                              wire.rows_from_b64(after["outputs"], x.shape[1], field="outputs"))
        return {"model_id": model_id, "layer": layer, "victim": victim, "identical": same,
                "failures": len(after["failures"]), "replans": after["replans"], "holders": len(after["holders"]),
                "ms": after["timings_ms"]["total"]}

    def _summary(self, results, t_start: float, t_total: float, holders: int, failover: dict | None = None,
                 dense: list[tuple[str, dict]] = (), economy: dict | None = None,
                 generations: list[dict] = ()) -> bool:
        w = self.stdout.write
        w("")
        w(f"{'model':<26} {'layer':>5} {'tokens':>6} {'holders':>7} {'rel err vs transformers':>24} "
          f"{'max |Δ| vs monolithic':>22} {'rel err vs dense':>17} {'ms':>7}  {'sharded == monolithic':<21}  "
          f"vs transformers ≤ {REL_TOLERANCE:g}")
        all_ok = True
        for model_id, _view, rows in results:
            for r in rows:
                all_ok &= r["ok"]
                w(f"{model_id:<26} {r['layer']:>5} {r['tokens']:>6} {r['holders']:>7} "
                  f"{r['max_rel_err_vs_reference']:>24.3e} {r['max_abs_diff_vs_monolithic']:>22.3e} "
                  f"{row_checks(r)}")
        w("")
        w(f"{'wire (compact: Q8_0 rows out, bf16 back)':<44} {'B/elem out':>10} {'B/elem back':>11} "
          f"{'f32 out':>8} {'f32 back':>8} {'rel err vs transformers':>24} {'receipts':>8}")
        for model_id, _view, rows in results:
            for r in rows:
                b = r["bytes_per_element"]
                w(f"{model_id + ' layer ' + str(r['layer']):<44} {b['compact']['out']:>10.3f} "
                  f"{b['compact']['back']:>11.3f} {b['f32']['out']:>8.3f} {b['f32']['back']:>8.3f} "
                  f"{r['compact_wire_rel_err']:>24.3e} {r['receipts']:>8}")
        for model_id, r in dense:
            all_ok &= r["ok"]
            w(f"dense {model_id} layer {r['layer']}: MLP split in {r['parts']} intermediate slices over "
              f"{r['holders']} holder(s); rel err vs unsplit {r['max_rel_err_vs_unsplit']:.3e}, |Δ| vs split in "
              f"process {r['max_abs_diff_vs_split']:.3e}  {'ok' if r['ok'] else 'FAILED'}")
        if failover is not None:
            all_ok &= failover["identical"] and failover["failures"] > 0
            w(f"failover {failover['model_id']} layer {failover['layer']}: holder {failover['victim'][:12]}… killed; "
              f"{failover['failures']} batch failure(s) fell over to backups ({failover['replans']} replans, "
              f"{failover['holders']} holders answered, {failover['ms']:.1f} ms); output "
              f"{'identical to the no-fault run' if failover['identical'] else 'DIFFERS from the no-fault run'}")
        w("")
        for model_id, view, _rows in results:
            min_rep = min((h["replication"] for h in view["holders"]), default=0)
            covered_ok = not view["under_replicated_experts"]
            all_ok &= covered_ok
            w(f"coverage {model_id}: {view['covered_experts']} expert slots held by "
              f"{view['distinct_providers']} "
              f"providers, min replication {min_rep}, under-replicated {len(view['under_replicated_experts'])}")
        w(f"{holders} holder agents; cluster up in {t_start:.1f} s; total {t_total:.1f} s; "
          f"tolerance {REL_TOLERANCE:g} relative vs transformers for dense experts, exactly 0 vs monolithic "
          f"(quantized: monolithic on the same quantized weights; their error vs transformers and vs the dense "
          f"forward is reported)")
        quant_rows = [r for _, _, rows in results for r in rows if "max_rel_err_vs_dense" in r]
        if quant_rows:
            w(f"quantized forward ({quant_rows[0]['quant']}): max rel err vs dense "
              f"{max(r['max_rel_err_vs_dense'] for r in quant_rows):.3e}, vs transformers "
              f"{max(r['max_rel_err_vs_reference'] for r in quant_rows):.3e}")
        all_ok &= self._economy_summary(economy)
        if generations:
            w("")
            w("whole-model generation (backbone on the site, experts on the holders; greedy, 8 tokens; f32 carriers "
              "vs transformers; compact wire: argmax agreement and logit cosine)")
            for line in generation_table(generations):
                w(line)
            all_ok &= all(g["ok"] for g in generations)
        w("ALL CHECKS PASSED" if all_ok else "SOME CHECKS FAILED")
        return all_ok
