import hashlib
import secrets

from django.db import migrations, models


def kill_revoked_tokens(apps, schema_editor):
    """A principal revoked before this version kept its token's digest, so reinstating it revived
    the old token; from now on a revocation replaces the digest (models.Principal.save), and the
    principals already revoked get the same: a digest nobody holds."""
    Principal = apps.get_model("shared_api", "Principal")
    for principal in Principal.objects.filter(active=False):
        principal.token_hash = hashlib.sha256(secrets.token_urlsafe(32).encode()).hexdigest()
        principal.save(update_fields=["token_hash"])


class Migration(migrations.Migration):

    dependencies = [
        ('shared_api', '0003_ops_samples_and_holds'),
    ]

    operations = [
        migrations.AddField(
            model_name='principal',
            name='quotas',
            field=models.JSONField(blank=True, default=dict),
        ),
        migrations.RunPython(kill_revoked_tokens, migrations.RunPython.noop),
    ]
