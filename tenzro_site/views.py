"""Site pages: health check and the overview of providers and published models."""
from __future__ import annotations

from django.http import JsonResponse
from django.shortcuts import render

from registry import selectors
from registry.models import MoeModel, Provider


def healthz(request):
    """``GET /healthz``: 200 when the site answers and its database is reachable."""
    return JsonResponse({"ok": True, "providers": Provider.objects.count(),
                         "live_providers": selectors.live_providers().count()})


def index(request):
    """Overview: live providers and, per published model, how many expert slots are covered."""
    models = []
    for m in MoeModel.objects.all():
        view = selectors.shard_view(m.model_id)
        slots = len(m.expert_keys())
        models.append({"model": m, "slots": slots, "covered": len(view.covered_experts()),
                       "under": len(view.under_replicated())})
    return render(request, "index.html", {"providers": Provider.objects.all(),
                                          "live": set(selectors.live_providers().values_list("provider", flat=True)),
                                          "models": models})


def coverage(request, model_id: str):
    """``/coverage/<model_id>``: a layer × expert grid coloured by replication, and the providers holding it.

    Cell classes: ``r0`` (nobody), ``r1`` … below ``min_replication`` (under-replicated),
    ``rok`` at or above it, ``rhot`` for hot experts. Slots come from the published model,
    else the seed catalog, else the covered experts.
    """
    view = selectors.shard_view(model_id)
    keys = selectors.expected_experts(model_id) or view.covered_experts()
    policy = view.policy
    layers: dict[int, list] = {}
    for layer, expert in keys:
        n = view.replication(layer, expert)
        cls = "rhot" if view.is_hot(layer, expert) else ("r0" if n == 0 else "r1" if n < policy.min_replication
                                                          else "rok")
        layers.setdefault(layer, []).append((expert, n, cls))
    held = {p: len(view.held_by(p)) for p in view.distinct_providers()}
    providers = [{"p": p, "held": held[p.provider]} for p in Provider.objects.filter(provider__in=held)]
    return render(request, "coverage.html", {
        "model_id": model_id, "rows": sorted(layers.items()), "policy": policy, "slots": len(keys),
        "covered": sum(1 for k in keys if view.replication(*k) > 0), "under": len(view.under_replicated()),
        "providers": providers})
