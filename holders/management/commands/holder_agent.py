"""``python manage.py holder_agent --site URL``: run a holder agent."""
from __future__ import annotations

import asyncio
import logging
import os
import signal

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from holders import compute
from holders.agent import AuthRefused, HolderAgent, ws_url
from holders.identity import load_or_create_key, provider_id


class Command(BaseCommand):
    help = "Run a holder agent: connect to the site, prove identity, heartbeat holdings, execute experts."

    def add_arguments(self, parser):
        parser.add_argument("--site", required=True, help="site URL, e.g. http://127.0.0.1:8000")
        parser.add_argument("--key", default=os.environ.get("TENZRO_KEY_FILE"),
                            help="ed25519 seed file (created on first run; default $TENZRO_KEY_FILE or var/agent.key)")
        parser.add_argument("--blob-dir", default=None, help="where fetched blobs are kept (default var/agent-blobs)")
        parser.add_argument("--budget", type=int, default=None,
                            help="memory-tier budget in bytes "
                                 "(default $TENZRO_MEMORY_BUDGET or 60%% of available memory)")
        parser.add_argument("--disk-dir", default=None, help="disk tier directory (default <blob-dir>/tier)")
        parser.add_argument("--compute", default=None, choices=["auto", "cpu", "cuda", "wgpu"],
                            help="compute backend "
                                 "(default $TENZRO_COMPUTE_BACKEND or auto: CUDA when usable, else CPU)")
        parser.add_argument("--name", default="", help="a display name for this provider")
        parser.add_argument("--heartbeat-interval", type=float, default=None,
                            help="seconds between signed heartbeats (default $TENZRO_HEARTBEAT_INTERVAL or 15)")

    def handle(self, *args, **opts):
        try:
            ws_url(opts["site"])
        except ValueError as exc:
            raise CommandError(str(exc)) from exc
        interval = opts["heartbeat_interval"] or settings.TENZRO["HEARTBEAT_INTERVAL_S"]
        if interval <= 0:
            raise CommandError("--heartbeat-interval must be positive")
        try:
            key = load_or_create_key(opts["key"] or settings.VAR_DIR / "agent.key")
        except (ValueError, OSError) as exc:
            raise CommandError(f"--key: {exc}") from exc
        if opts["budget"] is not None and opts["budget"] <= 0:
            raise CommandError("--budget must be a positive number of bytes")
        blob_dir = opts["blob_dir"] or settings.VAR_DIR / "agent-blobs"
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        try:
            compute.set_backend(compute.select_backend(opts["compute"]))
            agent = HolderAgent(opts["site"], key, blob_dir, name=opts["name"], heartbeat_interval=interval,
                                memory_budget=opts["budget"], disk_dir=opts["disk_dir"])
        except compute.BackendUnavailable as exc:
            raise CommandError(f"--compute: {exc}") from exc
        except ValueError as exc:  # TENZRO_MEMORY_BUDGET / TENZRO_COMPUTE_BACKEND malformed
            raise CommandError(str(exc)) from exc
        except OSError as exc:
            raise CommandError(f"--disk-dir: {exc}") from exc
        self.stdout.write(f"holder agent {provider_id(key)} → {opts['site']} (compute {agent.backend.tag}, "
                          f"memory budget {agent.runtime.budget} bytes, disk tier {agent.runtime.disk.root})")

        async def main():
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, agent.stop)
            await agent.run()

        try:
            asyncio.run(main())
        except AuthRefused as exc:
            raise CommandError(str(exc)) from exc
