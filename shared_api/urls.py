from django.urls import path

from . import views

urlpatterns = [
    path("capabilities", views.CapabilitiesView.as_view()),
    path("participant", views.ParticipantView.as_view()),
    path("operations", views.OperationsView.as_view()),
    path("operations/<str:operation>", views.OperationView.as_view()),
]
