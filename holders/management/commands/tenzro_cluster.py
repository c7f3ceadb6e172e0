"""``python manage.py tenzro_cluster --checkpoint DIR``: a local cluster that keeps running."""
from __future__ import annotations

import json
import signal
import sys
import threading

from django.core.management.base import BaseCommand, CommandError

from holders.cluster import ClusterError, LocalCluster


class Command(BaseCommand):
    help = ("Start the site and N holder agents, publish and place the checkpoint's experts and gates "
            "(replication 2), wait for full coverage, print one JSON line, run until interrupted.")

    def add_arguments(self, parser):
        parser.add_argument("--checkpoint", required=True, action="append",
                            help="HF checkpoint directory (repeat for several models)")
        parser.add_argument("--holders", type=int, default=4)
        parser.add_argument("--port", type=int, default=0, help="site port (default: a free one)")
        parser.add_argument("--model-id", action="append", default=None,
                            help="model id per checkpoint (default: from the directory name)")

    def handle(self, *args, **opts):
        def say(line: str) -> None:
            print(line, file=sys.stderr, flush=True)

        cluster = LocalCluster(opts["checkpoint"], holders=opts["holders"], port=opts["port"], say=say,
                               model_ids=opts["model_id"])
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        try:
            cluster.start()
            self.stdout.write(json.dumps(cluster.info()))
            self.stdout.flush()
            while not stop.wait(1.0):
                if cluster.site is not None and cluster.site.poll() is not None:
                    raise ClusterError("the site process exited")
        except (ClusterError, ValueError, OSError) as exc:
            raise CommandError(str(exc)) from exc
        finally:
            cluster.stop()
