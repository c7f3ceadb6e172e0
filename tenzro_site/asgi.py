"""ASGI entry point (daphne): HTTP through Django, ``/ws/agent/`` to the holder-agent consumer,
``/api/expert-relay`` to the Kvasir relay (``router.kvasir_relay``); any other WebSocket path is
refused with a close frame (``tenzro_site.ws``), never an HTTP 500."""
import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tenzro_site.settings")
django_asgi_app = get_asgi_application()  # before importing consumers (they import models)

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.urls import path, re_path  # noqa: E402

from router.consumers import AgentConsumer  # noqa: E402
from router.kvasir_relay import KvasirRelayConsumer  # noqa: E402
from tenzro_site.ws import UnknownPathConsumer  # noqa: E402

# Agents send no Origin header and prove their identity by signature, so no origin validator here.
application = ProtocolTypeRouter({
    "http": django_asgi_app,
    "websocket": URLRouter([path("ws/agent/", AgentConsumer.as_asgi()),
                            # Kvasir workers' relay (contract §1.8), with or without a trailing slash
                            re_path(r"^api/expert-relay/?$", KvasirRelayConsumer.as_asgi()),
                            re_path(r"", UnknownPathConsumer.as_asgi())]),
})
