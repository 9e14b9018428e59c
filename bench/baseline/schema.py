"""Create the baseline's tables and load its tokens, without manage.py or migrations:

    BASELINE_DATABASE_URL=postgresql://... python -m bench.baseline.schema < tokens.json

stdin: [[sha256_hex_of_token, lineage], ...]. The database itself is created and dropped by
bench/http.py."""
import json
import os
import sys

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.baseline.settings")

import django  # noqa: E402

django.setup()

from django.db import connection, transaction  # noqa: E402

from bench.baseline.ledger.models import Operation, Token  # noqa: E402


def main():
    rows = json.load(sys.stdin)
    with connection.schema_editor() as editor:
        editor.create_model(Token)
        editor.create_model(Operation)
    with transaction.atomic():
        Token.objects.bulk_create([Token(token_hash=h, lineage=lineage) for h, lineage in rows])
    print(f"baseline schema ready, {len(rows)} tokens")


if __name__ == "__main__":
    main()
