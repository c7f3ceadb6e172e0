# The catalog of published blobs moves from `prepare` to `registry` (one-way layers): the
# tables stay where prepare 0001 created them; only the migration state changes owner.

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('registry', '0004_provider_holder_record'),
        ('prepare', '0003_blob_catalog_to_registry'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[],
            state_operations=[
                migrations.CreateModel(
                    name='ExpertBlob',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('model_id', models.CharField(max_length=200)),
                        ('layer', models.PositiveIntegerField()),
                        ('expert', models.PositiveIntegerField()),
                        ('blob_hash', models.CharField(max_length=64)),
                        ('nbytes', models.BigIntegerField()),
                        ('quant', models.CharField(default='f32', max_length=32)),
                        ('created', models.DateTimeField(auto_now_add=True)),
                    ],
                    options={
                        'db_table': 'prepare_expertblob',
                        'ordering': ['model_id', 'layer', 'expert'],
                        'constraints': [models.UniqueConstraint(fields=('model_id', 'layer', 'expert'), name='one_blob_per_expert')],
                    },
                ),
                migrations.CreateModel(
                    name='GateBlob',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('model_id', models.CharField(max_length=200)),
                        ('layer', models.PositiveIntegerField()),
                        ('blob_hash', models.CharField(max_length=64)),
                        ('created', models.DateTimeField(auto_now_add=True)),
                    ],
                    options={
                        'db_table': 'prepare_gateblob',
                        'ordering': ['model_id', 'layer'],
                        'constraints': [models.UniqueConstraint(fields=('model_id', 'layer'), name='one_gate_per_layer')],
                    },
                ),
            ],
        ),
    ]
