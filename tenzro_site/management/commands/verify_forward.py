"""``python manage.py verify_forward --checkpoint DIR --reference FILE``: check the distributed forward."""
from __future__ import annotations

import json
import sys

from django.core.management.base import BaseCommand, CommandError

from tenzro_site.cluster import ClusterError, LocalCluster
from tenzro_site.verify import REL_TOLERANCE, reference_layers, verify_dense_layers, verify_layers
from moe.codec import CheckpointError
from prepare.quantplan import QuantPlanError, parse_quant_plan


class Command(BaseCommand):
    help = ("Distributed forward of every MoE layer in a reference bundle, compared with the reference "
            "output and with the monolithic in-process forward. Exit 1 above tolerance.")

    def add_arguments(self, parser):
        parser.add_argument("--checkpoint", required=True)
        parser.add_argument("--reference", required=True, help="reference.safetensors (docs/DESIGN.md §4)")
        parser.add_argument("--holders", type=int, default=4)
        parser.add_argument("--model-id", default=None)
        parser.add_argument("--json", action="store_true", help="last line: one JSON object with every layer")
        parser.add_argument("--quant", default=None,
                            help="publish the experts quantized (q4_k_m, q8_0, ... or a JSON object); sharded must "
                                 "still equal the monolithic forward on the same weights exactly, and the error "
                                 "vs the reference is reported, not held to the dense tolerance")

    def handle(self, *args, **opts):
        try:
            quant = parse_quant_plan(opts["quant"])
        except QuantPlanError as exc:
            raise CommandError(f"--quant: {exc}") from exc
        quant = quant.to_json() if quant else None

        def say(line: str) -> None:
            print(line, file=sys.stderr, flush=True)

        try:
            reference_layers(opts["reference"])  # a bad reference fails before any process starts
        except ValueError as exc:
            raise CommandError(f"--reference: {exc}") from exc
        cluster = None
        try:
            cluster = LocalCluster([opts["checkpoint"]], holders=opts["holders"], say=say,
                                   model_ids=[opts["model_id"]], quants=[quant])
            cluster.start()
            rows = verify_layers(cluster.rpc, cluster.model_ids[0], opts["checkpoint"], opts["reference"], quant)
            dense = verify_dense_layers(cluster.rpc, cluster.model_ids[0], opts["checkpoint"], opts["reference"],
                                        cluster.dense_parts) if cluster.dense_ids else []
        except (ClusterError, CheckpointError, ValueError, OSError) as exc:
            raise CommandError(str(exc)) from exc
        finally:
            if cluster is not None:
                cluster.stop()
        extra = f" {'rel err vs dense':>17}" if quant else ""
        self.stdout.write(f"{'layer':>5} {'tokens':>6} {'holders':>7} {'max rel err vs ref':>19} "
                          f"{'max |Δ| vs mono':>16}{extra} {'compact-wire rel err':>21} {'B/elem out,back':>16}  ok")
        for r in rows:
            extra = f" {r['max_rel_err_vs_dense']:>17.3e}" if quant else ""
            compact = r["bytes_per_element"]["compact"]
            self.stdout.write(f"{r['layer']:>5} {r['tokens']:>6} {r['holders']:>7} "
                              f"{r['max_rel_err_vs_reference']:>19.3e} {r['max_abs_diff_vs_monolithic']:>16.3e}"
                              f"{extra} {r['compact_wire_rel_err']:>21.3e} "
                              f"{compact['out']:>7.3f},{compact['back']:<8.3f}  {'yes' if r['ok'] else 'NO'}")
        for r in dense:
            self.stdout.write(f"dense layer {r['layer']} split in {r['parts']} over {r['holders']} holders: "
                              f"max rel err vs unsplit MLP {r['max_rel_err_vs_unsplit']:.3e}, max |Δ| vs the "
                              f"split in process {r['max_abs_diff_vs_split']:.3e}  {'yes' if r['ok'] else 'NO'}")
        if opts["json"]:
            keys = ("layer", "max_rel_err_vs_reference", "max_abs_diff_vs_monolithic", "tokens", "holders", "quant",
                    "compact_wire_rel_err", "bytes_per_element", "receipts") + (
                ("max_rel_err_vs_dense",) if quant else ())
            self.stdout.write(json.dumps({"layers": [{k: r[k] for k in keys} for r in rows], "dense_layers": dense}))
        if not all(r["ok"] for r in rows + dense):
            self.stderr.write(f"FAILED: relative error above {REL_TOLERANCE:g} or sharded differs from monolithic")
            sys.exit(1)
