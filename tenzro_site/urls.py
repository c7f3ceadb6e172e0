"""URL routes: JSON-RPC, REST mirror + OpenAPI, blobs, console pages, admin, static files."""
from django.contrib import admin
from django.contrib.staticfiles.views import serve as serve_static
from django.urls import include, path, re_path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from router import openai_api
from prepare import views as prepare_views
from prepare.views import blob
from registry import api as reg
from registry import market_views as market
from settlement import api as eco
from tenzro_site import views
from tenzro_site.rpc import rpc_view

api_v1 = [
    path("providers", reg.ProvidersView.as_view(), name="providers"),
    path("providers/heartbeat", reg.HeartbeatView.as_view(), name="heartbeat"),
    path("providers/<str:provider>", reg.ProviderView.as_view(), name="provider"),
    path("holdings", reg.HoldingsView.as_view(), name="holdings"),
    path("shard-map", reg.ShardMapView.as_view(), name="shard-map"),
    path("plan", reg.PlanView.as_view(), name="plan"),
    path("policy", reg.PolicyView.as_view(), name="policy"),
    path("catalog", reg.CatalogView.as_view(), name="catalog"),
    path("catalog/<str:model_id>", reg.CatalogShapeView.as_view(), name="catalog-shape"),
    path("proposals", reg.ProposalsView.as_view(), name="proposals"),
    path("proposals/<int:proposal_id>", reg.ProposalView.as_view(), name="proposal"),
    path("proposals/<int:proposal_id>/vote", reg.VoteView.as_view(), name="proposal-vote"),
    path("proposals/<int:proposal_id>/withdraw", reg.WithdrawView.as_view(), name="proposal-withdraw"),
    path("governance/audit", reg.AuditView.as_view(), name="audit"),
    path("receipts", eco.ReceiptsView.as_view(), name="receipts"),
    path("receipts/<str:key>", eco.ReceiptView.as_view(), name="receipt"),
    path("receipts/<str:key>/dispute", eco.DisputeView.as_view(), name="receipt-dispute"),
    path("disputes", eco.DisputesView.as_view(), name="disputes"),
    path("settlements", eco.SettlementsView.as_view(), name="settlements"),
]

urlpatterns = [
    path("", include("tenzro_site.console.urls")),
    path("healthz", views.healthz, name="healthz"),
    path("metrics", views.metrics, name="metrics"),
    path("rpc", rpc_view, name="rpc"),
    path("v1/completions", openai_api.completions, name="openai-completions"),
    path("v1/chat/completions", openai_api.chat_completions, name="openai-chat-completions"),
    path("v1/models", openai_api.models, name="openai-models"),
    path("v1/models/<path:model_id>", openai_api.model, name="openai-model"),
    re_path(r"^v1/(?P<rest>.*)$", openai_api.not_found),  # OpenAI clients parse a JSON 404, not HTML
    path("api/v1/", include(api_v1)),
    # Expert-coverage market (Kvasir wire contract): with or without a trailing slash, no redirect.
    re_path(r"^api/auth/challenge/?$", market.challenge, name="market-challenge"),
    re_path(r"^api/auth/node-token/?$", market.node_token, name="market-node-token"),
    re_path(r"^api/expert-coverage/?$", market.coverage, name="market-coverage"),
    re_path(r"^api/expert-demand/?$", market.demand, name="market-demand"),
    re_path(r"^api/expert-volunteer/?$", market.volunteer, name="market-volunteer"),
    re_path(r"^api/expert-dispatch-map/?$", market.dispatch_map, name="market-dispatch-map"),
    re_path(r"^api/moe/recruitment/?$", market.recruitment, name="market-recruitment"),
    re_path(r"^api/expert-relay/sessions/?$", market.relay_sessions, name="market-relay-sessions"),
    re_path(r"^api/expert-relay/register/?$", market.relay_register, name="market-relay-register"),
    re_path(r"^api/proxy/models/(?P<model>[^?#]+?)/expert-shard/?$", prepare_views.expert_shard,
            name="market-expert-shard"),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="docs"),
    re_path(r"^api/(?P<rest>.*)$", views.api_not_found, name="api-not-found"),  # JSON, never HTML (§1.0)
    path("blobs/<str:blob_hash>", blob, name="blob"),
    path("prepare/", prepare_views.jobs, name="prepare-jobs"),
    path("prepare/<uuid:job_id>", prepare_views.job_detail, name="prepare-job"),
    path("prepare/<uuid:job_id>/progress", prepare_views.job_progress, name="prepare-job-progress"),
    path("prepare/rows", prepare_views.job_rows, name="prepare-job-rows"),
    path("admin/", admin.site.urls),
    # Admin CSS and the Swagger UI bundle (drf-spectacular-sidecar) from the apps' static dirs:
    # the site ships without a CDN or a separate static server.
    re_path(r"^static/(?P<path>.*)$", serve_static, {"insecure": True}),
]

handler400 = "tenzro_site.views.bad_request"  # JSON, never Django's HTML "Bad Request (400)"
