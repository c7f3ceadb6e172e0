"""Console routes, included at the site root by ``tenzro_site.urls``."""
from django.contrib.auth import views as auth_views
from django.urls import path

from tenzro_site.console import views

urlpatterns = [
    path("", views.index, name="index"),
    path("login/", auth_views.LoginView.as_view(template_name="console/login.html"), name="console-login"),
    path("logout/", auth_views.LogoutView.as_view(), name="console-logout"),
    path("governance/", views.governance_page, name="console-governance"),
    path("governance/proposals", views.proposal_create, name="console-proposal-create"),
    path("governance/proposals/<int:proposal_id>/vote", views.proposal_vote, name="console-proposal-vote"),
    path("governance/proposals/<int:proposal_id>/withdraw", views.proposal_withdraw,
         name="console-proposal-withdraw"),
    path("providers/", views.providers, name="console-providers"),
    path("providers/<str:provider>", views.provider, name="console-provider"),
    path("coverage/", views.coverage_index, name="console-coverage-index"),
    path("coverage/<str:model_id>", views.coverage, name="coverage"),
    path("coverage/<str:model_id>/holders", views.expert_holders, name="console-expert-holders"),
    path("receipts/", views.receipts, name="console-receipts"),
    # receipt keys hold the model id, which may contain "/": the dispute route is matched first
    path("receipts/<path:key>/dispute", views.receipt_dispute, name="console-receipt-dispute"),
    path("receipts/<path:key>", views.receipt, name="console-receipt"),
    path("disputes/", views.disputes, name="console-disputes"),
    path("settlements/", views.settlements, name="console-settlements"),
    path("serving/", views.serving, name="console-serving"),
    path("serving/panel", views.serving_panel, name="console-serving-panel"),
    path("settlements.csv", views.settlements_csv, name="console-settlements-csv"),
]
