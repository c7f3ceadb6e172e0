"""``python manage.py verify_generate --checkpoint DIR --reference FILE``: check whole-model generation."""
from __future__ import annotations

import json
import os
import signal
import sys

from django.core.management.base import BaseCommand, CommandError

from moe.codec import CheckpointError
from tenzro_site.cluster import ClusterError, LocalCluster
from tenzro_site.verify import (GEN_TOLERANCE, check_kill_after_steps, generation_reference, verify_generation,
                                verify_generation_under_kill)

JSON_KEYS = ("model_id", "greedy_ids_equal", "max_rel_err_logits", "compact")


def table(rows: list[dict]) -> list[str]:
    """The human-readable lines of ``verify_generate`` / ``tenzro_demo`` for result rows."""
    lines = [f"{'model':<22} {'carrier':>7} {'greedy ids':>10} {'logits max rel err':>19} "
             f"{'compact argmax':>14} {'compact cosine':>14} {'tok/s':>8}  check"]
    for r in rows:
        lines.append(f"{r['model_id']:<22} {r['carrier']:>7} {'equal' if r['greedy_ids_equal'] else 'DIFFER':>10} "
                     f"{r['max_rel_err_logits']:>19.3e} {r['compact']['argmax_agreement']:>14.4f} "
                     f"{r['compact']['logit_cosine']:>14.6f} {r['tokens_per_s'] or 0:>8.1f}  "
                     f"{'ok' if r['ok'] else 'FAILED'}")
    return lines


class Command(BaseCommand):
    help = ("Run a generation reference's prompt through a local cluster (backbone on the site, experts on "
            "holder agents): greedy ids vs greedy_ids, prompt logits vs logits, and with the compact wire the "
            "argmax agreement and logit cosine. Exit 1 when ids differ or the f32 error is above 1e-4.")

    def add_arguments(self, parser):
        parser.add_argument("--checkpoint", required=True)
        parser.add_argument("--reference", required=True, help="generation_reference.safetensors")
        parser.add_argument("--holders", type=int, default=4)
        parser.add_argument("--carrier", choices=["f32", "auto"], default="f32")
        parser.add_argument("--model-id", default=None)
        parser.add_argument("--json", action="store_true", help="last line: one JSON object (see the README)")
        parser.add_argument("--kill-holder-after-steps", type=int, default=None, metavar="K",
                            help="then run the greedy check again and SIGKILL the busiest holder after K decode "
                                 "steps; ids must stay equal, its batches served by failover or the fallback "
                                 "replica (JSON key \"churn\")")

    def handle(self, *args, **opts):
        try:
            ref = generation_reference(opts["reference"])  # a bad reference fails before any process starts
        except ValueError as exc:
            raise CommandError(f"--reference: {exc}") from exc
        if opts["kill_holder_after_steps"] is not None:
            try:
                check_kill_after_steps(ref, opts["kill_holder_after_steps"])
            except ValueError as exc:
                raise CommandError(str(exc)) from exc

        def say(line: str) -> None:
            print(line, file=sys.stderr, flush=True)

        cluster = None
        try:
            cluster = LocalCluster([opts["checkpoint"]], holders=opts["holders"], say=say,
                                   model_ids=[opts["model_id"]])
            cluster.start()
            row = verify_generation(cluster.rpc, cluster.model_ids[0], opts["reference"], opts["carrier"])
            if opts["kill_holder_after_steps"] is not None:
                row["churn"] = self.churn(cluster, opts)
                row["ok"] = row["ok"] and row["churn"]["ok"]
        except (ClusterError, CheckpointError, ValueError, OSError) as exc:
            raise CommandError(str(exc)) from exc
        finally:
            if cluster is not None:
                cluster.stop()
        for line in table([row]):
            self.stdout.write(line)
        self.stdout.write(f"generated {row['output_ids']} (reference {row['reference_ids']}); "
                          f"layer forwards {row['layers']['forwards']}, batches {row['layers']['batches']}, "
                          f"receipts {row['layers']['receipts']}, transports {row['layers']['transports']}")
        if "churn" in row:
            c = row["churn"]
            self.stdout.write(f"holder {c['killed'][:12]}… SIGKILLed after {c['kill_after_steps']} decode steps: "
                              f"greedy ids {'equal' if c['greedy_ids_equal'] else 'DIFFER'} {c['output_ids']}, "
                              f"{c['failovers']} batch(es) failed over, {c['fallback']} on the fallback replica, "
                              f"{c['replans']} replan(s); in the last step: "
                              f"{'SERVED BY THE KILLED HOLDER' if c['served_after_kill'] else 'not served by it'}  "
                              f"{'ok' if c['ok'] else 'FAILED'}")
        if opts["json"]:
            self.stdout.write(json.dumps({k: row[k] for k in JSON_KEYS + (("churn",) if "churn" in row else ())}))
        if not row["ok"]:
            self.stderr.write(f"FAILED: greedy ids differ or logits error above {GEN_TOLERANCE:g} (f32), or compact "
                              f"argmax/cosine below 15/16 / 0.999 (auto), or the run with a killed holder failed")
            sys.exit(1)

    @staticmethod
    def churn(cluster: LocalCluster, opts: dict) -> dict:
        """The greedy check with the busiest holder (primary of the most experts) SIGKILLed
        mid-decode (``verify_generation_under_kill``)."""
        model_id = cluster.model_ids[0]
        shard = cluster.rpc("tenzro_moeShardMap", {"model_id": model_id})
        primaries = [h["holders"][0]["provider"] for h in shard["holders"] if h["holders"]]
        if not primaries:
            raise ClusterError(f"{model_id} has no holders to kill")
        victim = max(sorted(set(primaries)), key=primaries.count)
        proc = next(p for pid, p in cluster.agents if pid == victim)

        def kill() -> str:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            return victim

        return verify_generation_under_kill(cluster.url, model_id, opts["reference"],
                                            opts["kill_holder_after_steps"],
                                            lambda: os.kill(proc.pid, signal.SIGSTOP), kill)
