from django.apps import AppConfig


class LedgerConfig(AppConfig):
    name = "bench.baseline.ledger"
    label = "ledger"
