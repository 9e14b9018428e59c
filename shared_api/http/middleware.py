from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Generic, TypeVar, cast

from asgiref.sync import iscoroutinefunction, markcoroutinefunction, sync_to_async
from django.http import HttpResponse

from .server import PRIVATE_HEADERS

if TYPE_CHECKING:
    from django.http import HttpRequest, HttpResponseBase
    from whitenoise.responders import StaticFile

S = TypeVar("S")  # what `before` hands to `after`
# The next handler: a response, or (under ASGI) a coroutine of one.
GetResponse = Callable[["HttpRequest"], Any]


class HybridMiddleware(Generic[S]):
    """The gateway's middleware base: sync and async capable, so that under ASGI a middleware adds
    no thread hop of its own. A subclass says what happens around the response: `before` (its
    result, of type S, is handed to `after`) and `after`."""
    sync_capable = True
    async_capable = True

    def __init__(self, get_response: GetResponse) -> None:
        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)

    def before(self, request: HttpRequest) -> S:
        return cast(S, None)  # (a middleware with nothing to hand on: `after` gets None)

    def after(self, request: HttpRequest, response: HttpResponseBase, state: S) -> None:
        pass

    def __call__(self, request: HttpRequest) -> HttpResponseBase | Awaitable[HttpResponseBase]:
        if self.is_async:
            return self._acall(request)
        state = self.before(request)
        response: HttpResponseBase = self.get_response(request)
        self.after(request, response, state)
        return response

    async def _acall(self, request: HttpRequest) -> HttpResponseBase:
        state = self.before(request)
        response: HttpResponseBase = await self.get_response(request)
        self.after(request, response, state)
        return response


class NoStoreMiddleware(HybridMiddleware[None]):
    """SPEC: all responses disable caching (errors, admin pages and the schema included)."""

    def after(self, request: HttpRequest, response: HttpResponseBase, state: None) -> None:
        for name, value in PRIVATE_HEADERS:
            response[name] = value


class StaticFilesMiddleware(HybridMiddleware[None]):
    """Static files (the admin's CSS and JS): settings.STATIC_ROOT, filled by `collectstatic`
    (`make setup`), served under STATIC_URL through WhiteNoise's file table and responder (media
    types, ETag / Last-Modified and 304, HEAD, ranges, precompressed variants when present).

    WhiteNoise's own middleware is sync only, so under ASGI it would put every request, the
    API's too, through a thread; this one is async capable, and a request that is not a GET or
    HEAD of a collected file goes on at once (a dict lookup). Caching: none — NoStoreMiddleware
    gives these responses `Cache-Control: no-store` like every other (SPEC: all responses disable
    caching); they are a few small files of the admin console."""

    def __init__(self, get_response: GetResponse) -> None:
        from django.conf import settings
        from whitenoise.base import WhiteNoise

        super().__init__(get_response)
        self.files = WhiteNoise(None, max_age=None)  # no Cache-Control of its own: see above
        root = settings.STATIC_ROOT
        if root and os.path.isdir(root):  # before collectstatic there is nothing to serve
            self.files.add_files(os.fspath(root), prefix=settings.STATIC_URL)

    def _file(self, request: HttpRequest) -> StaticFile | None:
        if request.method not in ("GET", "HEAD"):
            return None
        return self.files.files.get(request.path_info)

    @staticmethod
    def _serve(static_file: StaticFile, request: HttpRequest) -> HttpResponse:
        answer = static_file.get_response(request.method, request.META)
        body = b""
        if answer.file is not None:
            with answer.file:
                body = answer.file.read()
        response = HttpResponse(body, status=int(answer.status))
        del response["Content-Type"]
        for key, value in answer.headers:
            response[key] = value
        return response

    def __call__(self, request: HttpRequest) -> HttpResponseBase | Awaitable[HttpResponseBase]:
        if self.is_async:
            return self._acall(request)
        static_file = self._file(request)
        if static_file is not None:
            return self._serve(static_file, request)
        response: HttpResponseBase = self.get_response(request)
        return response

    async def _acall(self, request: HttpRequest) -> HttpResponseBase:
        static_file = self._file(request)
        if static_file is not None:  # a file read: off the event loop
            return await sync_to_async(self._serve, thread_sensitive=False)(static_file, request)
        response: HttpResponseBase = await self.get_response(request)
        return response
