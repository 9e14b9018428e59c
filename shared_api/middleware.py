from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Coroutine

from asgiref.sync import iscoroutinefunction, markcoroutinefunction

if TYPE_CHECKING:
    from django.http import HttpRequest, HttpResponseBase


class NoStoreMiddleware:
    """SPEC: all responses disable caching (errors, admin pages and the schema included).

    Sync and async capable, so that under daphne it adds no thread hop of its own."""
    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Callable[[HttpRequest], Any]) -> None:
        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)

    def __call__(self, request: HttpRequest) -> HttpResponseBase | Coroutine[Any, Any, HttpResponseBase]:
        if self.is_async:
            return self._acall(request)
        response = self.get_response(request)
        response["Cache-Control"] = "no-store"
        return response

    async def _acall(self, request: HttpRequest) -> HttpResponseBase:
        response = await self.get_response(request)
        response["Cache-Control"] = "no-store"
        return response
