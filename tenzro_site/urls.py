"""URL routes: JSON-RPC, REST mirror, blobs, pages, admin."""
from django.contrib import admin
from django.urls import path

import holders.api  # noqa: F401  (registers JSON-RPC methods)
import prepare.api  # noqa: F401  (registers JSON-RPC methods)
from prepare import views as prepare_views
from prepare.views import blob
from registry.api import HeartbeatView
from tenzro_site import views
from tenzro_site.rpc import rpc_view

urlpatterns = [
    path("", views.index, name="index"),
    path("healthz", views.healthz, name="healthz"),
    path("rpc", rpc_view, name="rpc"),
    path("api/v1/providers/heartbeat", HeartbeatView.as_view(), name="heartbeat"),
    path("blobs/<str:blob_hash>", blob, name="blob"),
    path("prepare/", prepare_views.jobs, name="prepare-jobs"),
    path("prepare/<uuid:job_id>", prepare_views.job_detail, name="prepare-job"),
    path("admin/", admin.site.urls),
]
