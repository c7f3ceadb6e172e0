"""``manage.py market_add_model --model-id ID [--n-embd N --n-layer N --n-expert N --expert-layers 1-47]``."""
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
    """List a model on the expert-coverage market (as ``tenzro_moeMarketAddModel``): a model published
    on this site takes its shape from the publication; any other needs the four shape options."""

    help = ("List a model on the expert-coverage market (Kvasir-compatible /api/expert-* endpoints). A model "
            "published here needs only --model-id; its MoE layers, expert count and sizes come from the publication.")

    def add_arguments(self, parser):
        parser.add_argument("--model-id", required=True)
        parser.add_argument("--name", default="")
        parser.add_argument("--n-embd", type=int, help="hidden size (unpublished models)")
        parser.add_argument("--n-layer", type=int, help="block count (unpublished models)")
        parser.add_argument("--n-expert", type=int, help="routed experts per layer (unpublished models)")
        parser.add_argument("--expert-layers", help="e.g. 1-47 or 0,2,4 (unpublished models)")

    def handle(self, *args, **o):
        for f in ("n_embd", "n_layer", "n_expert"):
            if o[f] is not None and o[f] < 1:
                raise CommandError(f"--{f.replace('_', '-')} must be at least 1")
        layers = _layers(o["expert_layers"]) if o["expert_layers"] is not None else None
        try:
            res = market.add_model(o["model_id"], o["n_embd"], o["n_layer"], o["n_expert"], layers, o["name"])
        except ValueError as exc:
            raise CommandError(f"--{exc.args[0].replace('_', '-')}: {exc.args[1]}") from exc
        self.stdout.write(json.dumps(res))
