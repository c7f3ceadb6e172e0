"""``python manage.py tenzro_cluster --checkpoint DIR``: a local cluster that keeps running."""
from __future__ import annotations

import json
import signal
import sys
import threading

from django.core.management.base import BaseCommand, CommandError

from tenzro_site.cluster import ClusterError, LocalCluster
from moe.faults import parse_fault
from prepare.quantplan import QuantPlanError, parse_quant_plan


def parse_agent_faults(items: list[str] | None) -> dict[int, str]:
    """``["1=corrupt:0.25", ...]`` → ``{1: "corrupt:0.25"}``; raises ``CommandError`` naming the flag."""
    out: dict[int, str] = {}
    for item in items or []:
        index, sep, mode = item.partition("=")
        if not sep or not index.strip().isdigit():
            raise CommandError(f"--agent-fault {item!r}: expected INDEX=corrupt:P, INDEX=stall:S or INDEX=blackhole")
        try:
            parse_fault(mode)
        except ValueError as exc:
            raise CommandError(f"--agent-fault {item!r}: {exc}") from exc
        out[int(index)] = mode
    return out


class Command(BaseCommand):
    help = ("Start the site and N holder agents, publish and place the checkpoint's experts and gates "
            "(replication 2), wait for full coverage, print one JSON line, run until interrupted.")

    def add_arguments(self, parser):
        parser.add_argument("--checkpoint", required=True, action="append",
                            help="HF checkpoint directory (repeat for several models)")
        parser.add_argument("--holders", type=int, default=4)
        parser.add_argument("--port", type=int, default=0,
                            help="site port, or the balancer's with --sites above 1 (default: a free one)")
        parser.add_argument("--sites", type=int, default=1,
                            help="site processes behind HAProxy (needs a PostgreSQL DATABASE_URL and REDIS_URL); "
                                 "the JSON line's url/rpc are the balancer's, site_pids the processes'")
        parser.add_argument("--balancer", action="store_true",
                            help="HAProxy in front even of one site process (to compare 1 and N on one path)")
        parser.add_argument("--agent-http", action="store_true",
                            help="agents also serve POST /rpc on free ports (--http-port) and advertise them")
        parser.add_argument("--agent-iroh", action="store_true",
                            help="agents also serve moe/execute over iroh QUIC on 127.0.0.1 (--iroh) and advertise it; "
                                 "routers use it with TENZRO_DATA_TRANSPORT=iroh")
        parser.add_argument("--agent-site", default=None, metavar="URL",
                            help="the site URL the agents dial (a reverse proxy or a latency emulator in front of "
                                 "the site, e.g. tests/wan_proxy.py's); default the site's own http://127.0.0.1:PORT")
        parser.add_argument("--model-id", action="append", default=None,
                            help="model id per checkpoint (default: from the directory name)")
        parser.add_argument("--repair-interval", type=int, default=None, metavar="S",
                            help="seconds between repair passes (default: the governance policy's, 120)")
        parser.add_argument("--agent-role", action="append", default=None,
                            choices=["PrefillDecode", "Prefill", "Decode"],
                            help="agent i gets the i-th role, cycling (default PrefillDecode for all)")
        parser.add_argument("--quant", default=None,
                            help="publish the experts quantized: q4_k_m, q8_0, q4_k, q6_k or a JSON object")
        parser.add_argument("--agent-fault", action="append", default=None, metavar="INDEX=MODE",
                            help="DRILL: run agent INDEX with --fault MODE (corrupt:P, stall:S or blackhole); repeatable")

    def handle(self, *args, **opts):
        try:
            plan = parse_quant_plan(opts["quant"])
        except QuantPlanError as exc:
            raise CommandError(f"--quant: {exc}") from exc
        faults = parse_agent_faults(opts["agent_fault"])
        if opts["model_id"] and len(opts["model_id"]) != len(opts["checkpoint"]):
            raise CommandError("--model-id: give one per --checkpoint")
        if opts["repair_interval"] is not None and not 1 <= opts["repair_interval"] <= 86_400:
            raise CommandError(f"--repair-interval must be between 1 and 86400 seconds, got {opts['repair_interval']}")

        def say(line: str) -> None:
            print(line, file=sys.stderr, flush=True)

        def interrupt(*_):
            raise KeyboardInterrupt

        stop = threading.Event()
        cluster = None
        for sig in (signal.SIGINT, signal.SIGTERM):  # during start-up: stop at once, cleaning up
            signal.signal(sig, interrupt)
        try:
            cluster = LocalCluster(opts["checkpoint"], holders=opts["holders"], port=opts["port"], say=say,
                                   model_ids=opts["model_id"],
                                   quants=[plan.to_json() if plan else None] * len(opts["checkpoint"]),
                                   agent_http=opts["agent_http"], agent_iroh=opts["agent_iroh"],
                                   repair_interval=opts["repair_interval"],
                                   agent_faults=faults, roles=opts["agent_role"], agent_site=opts["agent_site"],
                                   sites=opts["sites"], balancer=opts["balancer"])
            cluster.start()
            for sig in (signal.SIGINT, signal.SIGTERM):  # ready: the next signal ends the wait below
                signal.signal(sig, lambda *_: stop.set())
            self.stdout.write(json.dumps(cluster.info()))
            self.stdout.flush()
            reported: set[int] = set()
            while not stop.wait(1.0):
                if not cluster.live_sites():
                    raise ClusterError("the site process exited" if len(cluster.sites) == 1 else
                                       "every site process exited")
                if cluster.balancer is not None and cluster.balancer.poll() is not None:
                    raise ClusterError("the balancer exited")
                for p in cluster.sites:  # one of several died: the others serve; its agents reconnect
                    if p.poll() is not None and p.pid not in reported:
                        reported.add(p.pid)
                        cluster.site_died(p)
                        say(f"site process {p.pid} exited with code {p.returncode}; "
                            f"{len(cluster.live_sites())} serve on behind the balancer")
        except KeyboardInterrupt as exc:
            raise CommandError("interrupted before the cluster was ready; stopped everything it started") from exc
        except (ClusterError, ValueError, OSError) as exc:
            raise CommandError(str(exc)) from exc
        finally:
            if cluster is not None:
                cluster.stop()
