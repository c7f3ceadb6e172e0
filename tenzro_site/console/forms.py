"""Console forms: inputs of the governance actions and the pages' query strings.

Proposal validation is the RPC's: the form only parses numbers, then
``registry.governance.create_proposal`` validates the change against the policy in force
(the same call ``tenzro_moeCreateProposal`` makes); its ``GovernanceError.field``
(``changes.<field>``, ``title``) is mapped back onto the form field.
"""
from __future__ import annotations

from django import forms

from registry.governance import POLICY_FIELDS
from registry.models import Proposal
from moe.shardmap import ROLES


class ProposalForm(forms.Form):
    """A new proposal: ``title``, ``description`` and any subset of the policy fields (blank = unchanged)."""

    title = forms.CharField(max_length=200)
    description = forms.CharField(max_length=10_000, required=False, widget=forms.Textarea(attrs={"rows": 2}))

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for name, kind in POLICY_FIELDS.items():
            field = forms.FloatField if kind is float else forms.IntegerField
            self.fields[name] = field(required=False, label=name.replace("_", " "))

    def clean(self):
        """Collect the set policy fields into ``changes``; at least one is needed."""
        data = super().clean()
        changes = {k: data[k] for k in POLICY_FIELDS if data.get(k) is not None}
        if not changes and not self.errors:
            raise forms.ValidationError("set at least one policy field to change")
        data["changes"] = changes
        return data

    def add_governance_error(self, field: str, message: str) -> None:
        """Attach a ``GovernanceError`` (``field`` like ``changes.min_replication``) to its form field."""
        name = field.split(".", 1)[1] if field.startswith("changes.") else field
        self.add_error(name if name in self.fields else None, message)


class VoteForm(forms.Form):
    """A staff user's vote: ``approve`` is ``yes`` or ``no``."""

    approve = forms.ChoiceField(choices=[("yes", "approve"), ("no", "reject")])


class ProposalFilter(forms.Form):
    """``?status=`` of the governance page (ignored with a message when invalid)."""

    status = forms.ChoiceField(choices=[("", "all"), *[(s, s) for s in Proposal.Status.values]], required=False)


class ProviderFilter(forms.Form):
    """``?live=1&role=…`` of the provider list (ignored with a message when invalid)."""

    live = forms.BooleanField(required=False)
    role = forms.ChoiceField(choices=[("", "any"), *[(r, r) for r in ROLES]], required=False)


class ExpertQuery(forms.Form):
    """``?layer=&expert=`` of the coverage holders panel."""

    layer = forms.IntegerField(min_value=0, max_value=100_000)
    expert = forms.IntegerField(min_value=0, max_value=1_000_000)


class ReceiptFilter(forms.Form):
    """``?model=&provider=&layer=&expert=`` of the receipts browser (ignored with a message when invalid)."""

    model = forms.CharField(max_length=200, required=False)
    provider = forms.RegexField(r"^[0-9a-f]{64}$", required=False,
                                error_messages={"invalid": "a provider id is 64 lowercase hex digits"})
    layer = forms.IntegerField(min_value=0, max_value=100_000, required=False)
    expert = forms.IntegerField(min_value=0, max_value=1_000_000, required=False)


class DisputeFilter(forms.Form):
    """``?provider=&outcome=upheld|rejected`` of the disputes list."""

    provider = forms.RegexField(r"^[0-9a-f]{64}$", required=False,
                                error_messages={"invalid": "a provider id is 64 lowercase hex digits"})
    outcome = forms.ChoiceField(choices=[("", "any"), ("upheld", "upheld"), ("rejected", "rejected")],
                                required=False)


class SettlementFilter(forms.Form):
    """``?model=&provider=&forward=`` of the settlement ledger and its CSV export."""

    model = forms.CharField(max_length=200, required=False)
    provider = forms.RegexField(r"^[0-9a-f]{64}$", required=False,
                                error_messages={"invalid": "a provider id is 64 lowercase hex digits"})
    forward = forms.RegexField(r"^[0-9A-Za-z_-]{1,64}$", required=False,
                               error_messages={"invalid": "a forward id is up to 64 letters, digits, - or _"})
