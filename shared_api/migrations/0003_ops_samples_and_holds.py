from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('shared_api', '0002_principal_invariants'),
    ]

    operations = [
        migrations.CreateModel(
            name='CapacitySample',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('taken_at', models.DateTimeField(db_index=True)),
                ('boot', models.BigIntegerField()),
                ('usage', models.JSONField(default=dict)),
                ('capacities', models.JSONField(default=dict)),
                ('kv', models.JSONField(blank=True, null=True)),
                ('executions_queued', models.IntegerField(blank=True, null=True)),
                ('executions_running', models.IntegerField(blank=True, null=True)),
                ('journal_bytes', models.BigIntegerField()),
                ('runtime_file_bytes', models.BigIntegerField(blank=True, null=True)),
                ('saved_transfers', models.BigIntegerField(blank=True, null=True)),
                ('fdatasyncs', models.BigIntegerField(blank=True, null=True)),
                ('fdatasync_seconds', models.FloatField(blank=True, null=True)),
                ('subscriptions', models.IntegerField(blank=True, null=True)),
                ('hold', models.BooleanField(default=False)),
            ],
            options={
                'ordering': ['taken_at'],
            },
        ),
        migrations.CreateModel(
            name='HoldIncident',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('since_ns', models.BigIntegerField(unique=True)),
                ('ended_ns', models.BigIntegerField(blank=True, null=True)),
                ('cause', models.CharField(max_length=32)),
                ('disk_error', models.TextField(blank=True, null=True)),
                ('pending_bytes', models.BigIntegerField(blank=True, null=True)),
                ('recorded_at', models.DateTimeField(auto_now_add=True)),
            ],
            options={
                'ordering': ['-since_ns'],
            },
        ),
    ]
