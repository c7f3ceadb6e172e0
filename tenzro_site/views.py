"""Site pages: health check and the overview of providers and published models."""
from __future__ import annotations

from django.http import JsonResponse
from django.shortcuts import render

from registry import selectors
from registry.models import MoeModel, Provider


def healthz(request):
    """``GET /healthz``: 200 when the site answers and its database is reachable."""
    return JsonResponse({"ok": True, "providers": Provider.objects.count()})


def index(request):
    """Overview: live providers and, per published model, how many expert slots are covered."""
    models = []
    for m in MoeModel.objects.all():
        view = selectors.shard_view(m.model_id)
        slots = len(m.expert_keys())
        models.append({"model": m, "slots": slots, "covered": view.to_json()["covered_experts"],
                       "under": len(view.under_replicated())})
    return render(request, "index.html", {"providers": Provider.objects.all(),
                                          "live": set(selectors.live_providers().values_list("provider", flat=True)),
                                          "models": models})
