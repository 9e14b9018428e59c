from django.urls import path

from bench.baseline.ledger.views import Mutate

urlpatterns = [path("m", Mutate.as_view())]
