from django.urls import path

from . import views

urlpatterns = [
    path("capabilities", views.CapabilitiesView.as_view()),
    path("participant", views.ParticipantView.as_view()),
    path("participants/<str:participant>", views.OtherParticipantView.as_view()),
    path("spaces", views.SpacesView.as_view()),
    path("spaces/<str:space>", views.SpaceView.as_view()),
    path("spaces/<str:space>/members", views.MembersView.as_view()),
    path("spaces/<str:space>/conversations", views.ConversationsView.as_view()),
    path("spaces/<str:space>/deletion", views.SpaceDeletionView.as_view()),
    path("spaces/<str:space>/memory", views.MemoryListView.as_view()),
    path("spaces/<str:space>/memory/search", views.MemorySearchView.as_view()),
    path("spaces/<str:space>/publications", views.PublicationsView.as_view()),
    path("memory/<str:memory>", views.MemoryView.as_view()),
    path("memory/<str:memory>/versions", views.MemoryVersionsView.as_view()),
    path("memory/<str:memory>/deletion", views.MemoryDeletionView.as_view()),
    path("conversations/<str:conversation>", views.ConversationView.as_view()),
    path("conversations/<str:conversation>/inputs", views.InputsView.as_view()),
    path("conversations/<str:conversation>/events", views.ConversationEventsView.as_view()),
    path("conversations/<str:conversation>/forks", views.ConversationForksView.as_view()),
    path("conversations/<str:conversation>/deletion", views.ConversationDeletionView.as_view()),
    path("operations", views.OperationsView.as_view()),
    path("operations/<str:operation>", views.OperationView.as_view()),
    path("operations/<str:operation>/result", views.ResultView.as_view()),
    path("operations/<str:operation>/events", views.OperationEventsView.as_view()),
    path("retirements", views.RetirementsView.as_view()),
    path("cancellations", views.CancellationsView.as_view()),
]
