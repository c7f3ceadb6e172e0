"""Record each proposal's electorate (issue 15 item 11).

Backfill of proposals opened before this migration, whose electorate was never recorded:
an open proposal gets the electorate in force now (the one its tally used until now); a
decided proposal gets the operator plus everyone who voted on it, so its tally reads as it
stood when it was decided (a staff user created afterwards no longer turns "1 of 1" into
"1 of 2").
"""
from django.conf import settings
from django.db import migrations, models


def backfill(apps, schema_editor):
    Proposal = apps.get_model("registry", "Proposal")
    Provider = apps.get_model("registry", "Provider")
    User = apps.get_model(*settings.AUTH_USER_MODEL.split("."))
    min_rep = settings.TENZRO["GOVERNANCE_MIN_VOTER_REPUTATION"]
    now = sorted(["operator",
                  *(f"user:{u}" for u in User.objects.filter(is_staff=True, is_active=True)
                    .values_list("username", flat=True)),
                  *(f"provider:{p}" for p in Provider.objects.filter(status="Active", reputation__gte=min_rep)
                    .values_list("provider", flat=True))])
    for p in Proposal.objects.all():
        if p.status == "Open":
            voters = set(now)
        else:
            voters = {"operator"}
        voters |= set(p.votes.values_list("voter", flat=True))
        p.electorate = sorted(voters)
        p.save(update_fields=["electorate"])


class Migration(migrations.Migration):

    dependencies = [
        ("registry", "0007_economy"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.AddField(
            model_name="proposal",
            name="electorate",
            field=models.JSONField(blank=True, default=list),
        ),
        migrations.RunPython(backfill, migrations.RunPython.noop),
    ]
