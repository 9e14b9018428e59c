from django.db import models


class Token(models.Model):
    """A bearer token stored as its SHA-256 digest, bound to one lineage (like a principal)."""
    token_hash = models.CharField(max_length=64, unique=True)
    lineage = models.CharField(max_length=32)
    active = models.BooleanField(default=True)

    is_authenticated = True  # DRF's IsAuthenticated reads this from request.user (the token row)


class Operation(models.Model):
    """One accepted mutation: (lineage, sequence) is the idempotency key; the canonical bytes
    decide between an exact retry (200, stored response) and a changed input (409)."""
    lineage = models.CharField(max_length=32)
    sequence = models.BigIntegerField()
    canonical = models.BinaryField()
    response = models.BinaryField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["lineage", "sequence"], name="operation_once")]
