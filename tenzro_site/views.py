"""Site health check (the console pages live in ``tenzro_site.console``)."""
from __future__ import annotations

from django.http import JsonResponse

from registry import selectors
from registry.models import Provider


def healthz(request):
    """``GET /healthz``: 200 when the site answers and its database is reachable."""
    return JsonResponse({"ok": True, "providers": Provider.objects.count(),
                         "live_providers": selectors.live_providers().count()})
