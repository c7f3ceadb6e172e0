# ExpertBlob and GateBlob now belong to registry (registry 0005); their tables stay.

from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ('prepare', '0002_prepare_jobs'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[],
            state_operations=[
                migrations.DeleteModel(name='ExpertBlob'),
                migrations.DeleteModel(name='GateBlob'),
            ],
        ),
    ]
