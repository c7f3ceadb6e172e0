"""Django admin for the registry: providers, holdings, models, and governance (policy, proposals, votes, audit).

The policy is read-only here: it changes only by applying a proposal. Staff users open
proposals (validated against the policy in force) and vote on them with the list actions;
each vote is tallied at once (``registry.governance``), so a proposal reaching quorum is
applied by the vote that reaches it.
"""
from __future__ import annotations

from django import forms
from django.contrib import admin, messages
from django.db.models import Count

from registry import governance, selectors
from registry.models import AuditEntry, Holding, MoeModel, Proposal, Provider, ReplicationPolicy, Vote


class ReadOnlyAdmin(admin.ModelAdmin):
    """Visible, never edited in the admin (written by services only)."""

    def has_add_permission(self, request, obj=None):
        """No manual rows."""
        return False

    def has_change_permission(self, request, obj=None):
        """Viewing only."""
        return False

    def has_delete_permission(self, request, obj=None):
        """Kept for the record."""
        return False


@admin.register(Provider)
class ProviderAdmin(admin.ModelAdmin):
    """Providers with liveness, roles and holding counts; suspend / reactivate actions."""

    list_display = ("short_id", "name", "state", "status", "connected", "roles", "moe_gpu", "reputation",
                    "n_holdings", "batches_served", "batch_failures", "price_per_input_token", "last_heartbeat")
    list_filter = ("status", "connected", "moe_gpu")
    search_fields = ("provider", "name", "http_endpoint", "iroh_endpoint_id")
    readonly_fields = ("provider", "last_heartbeat", "last_heartbeat_ms", "agent_channel", "connected", "created")
    actions = ("suspend", "reactivate")

    def get_queryset(self, request):
        """Annotated with the holding count."""
        return super().get_queryset(request).annotate(n=Count("holdings"))

    @admin.display(description="provider", ordering="provider")
    def short_id(self, obj):
        """First 16 hex digits of the key."""
        return obj.provider[:16] + "…"

    @admin.display(description="state")
    def state(self, obj):
        """Liveness and faults in one word (``registry.selectors.provider_state``)."""
        return selectors.provider_state(obj)

    @admin.display(description="holdings", ordering="n")
    def n_holdings(self, obj):
        """Declared holdings."""
        return obj.n

    @admin.action(description="Suspend (drop from shard views)")
    def suspend(self, request, queryset):
        """Status → Suspended."""
        n = queryset.update(status=Provider.Status.SUSPENDED)
        self.message_user(request, f"{n} provider(s) suspended")

    @admin.action(description="Reactivate")
    def reactivate(self, request, queryset):
        """Status → Active."""
        n = queryset.update(status=Provider.Status.ACTIVE)
        self.message_user(request, f"{n} provider(s) reactivated")


@admin.register(Holding)
class HoldingAdmin(ReadOnlyAdmin):
    """Declared holdings (replaced by each heartbeat)."""

    list_display = ("model_id", "layer", "expert", "provider", "residency", "committed_tps", "blob_uri")
    list_filter = ("model_id", "residency")
    search_fields = ("model_id", "provider__provider", "provider__name")
    list_select_related = ("provider",)


@admin.register(MoeModel)
class MoeModelAdmin(ReadOnlyAdmin):
    """Models published on this site."""

    list_display = ("model_id", "family", "num_experts", "top_k", "n_shared_experts", "hidden_size", "expert_d_ff",
                    "created")
    search_fields = ("model_id", "family")


@admin.register(ReplicationPolicy)
class ReplicationPolicyAdmin(ReadOnlyAdmin):
    """The policy in force; change it with a proposal."""

    list_display = ("__str__", "min_replication", "max_replication", "hot_threshold_tps", "repair_interval_s",
                    "max_repairs_per_pass", "settlement_holder_share_bps", "dispute_min_overlap",
                    "dispute_max_rel_delta", "dispute_min_rows_passed", "applied_proposal", "updated")

    def get_queryset(self, request):
        """Create the singleton on first view so the admin always shows the policy in force."""
        governance.current_policy()
        return super().get_queryset(request)


class VoteInline(admin.TabularInline):
    """Votes of a proposal (read-only)."""

    model = Vote
    extra = 0
    can_delete = False
    readonly_fields = ("voter", "approve", "created")

    def has_add_permission(self, request, obj=None):
        """Votes come from the actions, the API or signed provider votes."""
        return False


class ProposalForm(forms.ModelForm):
    """A new proposal; ``changes`` is validated against the policy in force."""

    class Meta:
        model = Proposal
        fields = ("title", "description", "changes")

    def clean_changes(self):
        """Refuse unknown fields and invalid values with the governance message."""
        changes = self.cleaned_data["changes"]
        try:
            governance.validate_changes(changes)
        except governance.GovernanceError as exc:
            raise forms.ValidationError(str(exc)) from exc
        return changes


@admin.register(Proposal)
class ProposalAdmin(admin.ModelAdmin):
    """Proposals with their tally over the electorate recorded at creation; actions vote as the
    signed-in staff user or withdraw."""

    form = ProposalForm
    list_display = ("id", "title", "status", "proposer", "changes", "tally", "created", "decided")
    list_filter = ("status",)
    search_fields = ("title", "proposer")
    actions = ("vote_yes", "vote_no", "withdraw")

    def get_inlines(self, request, obj):
        """Votes exist only once the proposal does."""
        return (VoteInline,) if obj else ()

    def get_readonly_fields(self, request, obj=None):
        """A proposal is immutable once opened."""
        return ("title", "description", "changes", "proposer", "electorate", "status", "created",
                "decided") if obj else ()

    def has_delete_permission(self, request, obj=None):
        """Proposals stay for the audit trail."""
        return False

    @admin.display(description="yes / no / quorum of electorate")
    def tally(self, obj):
        """Current tally."""
        t = governance.tally(obj)
        return f"{t['yes']} / {t['no']} / {t['quorum']} of {t['electorate']}"

    def save_model(self, request, obj, form, change):
        """Open through the service (audited), proposer = the staff user."""
        if change:
            return
        created = governance.create_proposal(obj.title, obj.changes, f"user:{request.user.get_username()}",
                                             obj.description)
        obj.pk = created.pk

    def _each(self, request, queryset, func, done: str):
        for p in queryset:
            try:
                after = func(p)
                self.message_user(request, f"#{p.pk}: {done}; now {after.status}")
            except governance.GovernanceError as exc:
                self.message_user(request, f"#{p.pk}: {exc}", level=messages.ERROR)

    @admin.action(description="Vote yes (as me)")
    def vote_yes(self, request, queryset):
        """Approve as ``user:<username>``."""
        voter = f"user:{request.user.get_username()}"
        self._each(request, queryset, lambda p: governance.vote(p.pk, voter, True), "approved")

    @admin.action(description="Vote no (as me)")
    def vote_no(self, request, queryset):
        """Reject as ``user:<username>``."""
        voter = f"user:{request.user.get_username()}"
        self._each(request, queryset, lambda p: governance.vote(p.pk, voter, False), "rejected")

    @admin.action(description="Withdraw")
    def withdraw(self, request, queryset):
        """Withdraw open proposals."""
        actor = f"user:{request.user.get_username()}"
        self._each(request, queryset, lambda p: governance.withdraw(p.pk, actor), "withdrawn")


@admin.register(Vote)
class VoteAdmin(ReadOnlyAdmin):
    """Every vote cast."""

    list_display = ("proposal", "voter", "approve", "created")
    list_filter = ("approve",)
    search_fields = ("voter",)


@admin.register(AuditEntry)
class AuditEntryAdmin(ReadOnlyAdmin):
    """The governance audit trail (append-only)."""

    list_display = ("at", "actor", "action", "proposal", "detail")
    list_filter = ("action",)
    search_fields = ("actor",)
