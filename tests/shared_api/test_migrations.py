"""The migration that brings quotas also kills the tokens of principals revoked before it (whose
digest an earlier version kept, so a reinstatement revived the old token)."""
import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

from shared_api.models import hash_token


@pytest.mark.django_db(transaction=True)
def test_principals_revoked_before_the_quotas_migration_lose_their_old_token():
    executor = MigrationExecutor(connection)
    before = [("shared_api", "0003_ops_samples_and_holds")]
    executor.migrate(before)
    old = executor.loader.project_state(before).apps.get_model("shared_api", "Principal")
    revoked = old.objects.create(name="gone", principal_id="a" * 32, token_hash=hash_token("old-gone"),
                                 actions=["shared_read"], active=False)
    active = old.objects.create(name="here", principal_id="b" * 32, token_hash=hash_token("old-here"),
                                actions=["shared_read"], active=True)
    executor = MigrationExecutor(connection)
    executor.migrate(executor.loader.graph.leaf_nodes())
    from shared_api.models import Principal
    assert Principal.objects.get(pk=revoked.pk).token_hash != hash_token("old-gone")
    assert Principal.objects.get(pk=active.pk).token_hash == hash_token("old-here")
    assert Principal.objects.get(pk=active.pk).quotas == {}
