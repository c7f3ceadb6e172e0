"""``manage.py market_add_model --model-id ID --n-embd N --n-layer N --n-expert N --expert-layers 1-47``."""
from __future__ import annotations

import json

from django.core.management.base import BaseCommand, CommandError

from moe.ranges import RangeError, parse_ranges
from registry import market


def _layers(text: str) -> list[int]:
    try:
        return parse_ranges(text, "--expert-layers", 9_999_999)
    except RangeError as exc:
        raise CommandError(str(exc)) from None


class Command(BaseCommand):
    """List a catalog model on the expert-coverage market (as ``tenzro_moeMarketAddModel``)."""

    help = "List a model on the expert-coverage market (Kvasir-compatible /api/expert-* endpoints)."

    def add_arguments(self, parser):
        parser.add_argument("--model-id", required=True)
        parser.add_argument("--name", default="")
        parser.add_argument("--n-embd", type=int, required=True)
        parser.add_argument("--n-layer", type=int, required=True, help="block count")
        parser.add_argument("--n-expert", type=int, required=True)
        parser.add_argument("--expert-layers", required=True, help="e.g. 1-47 or 0,2,4")

    def handle(self, *args, **o):
        for f in ("n_embd", "n_layer", "n_expert"):
            if o[f] < 1:
                raise CommandError(f"--{f.replace('_', '-')} must be at least 1")
        try:
            res = market.add_model(o["model_id"], o["n_embd"], o["n_layer"], o["n_expert"],
                                   _layers(o["expert_layers"]), o["name"])
        except ValueError as exc:
            raise CommandError(f"--{exc.args[0].replace('_', '-')}: {exc.args[1]}") from exc
        self.stdout.write(json.dumps(res))
