"""The gateway with its shared routes dispatched by DRF itself: the measurement issue 54 §1 asks for
before deciding whether the shared routes run through DRF or through the front alone.

Served like the gateway (granian, RSGI; bench/http.py `--drf-front` starts it beside the gateway,
on the same device and database). Everything but the shared routes is the gateway's own front.
A shared route here: the front reads the body within the route's limit (what a server must do
before the body), then Django's ASGIRequest of it goes through DRF's `APIView.dispatch`, configured
for speed as the issue asks: the gateway's authentication class (BearerAuthentication, the
principal cache), a permission class for the command's action, the route's parser (StrictJSONParser
or RawBytesParser), the JSON renderer only with no content negotiation of renderers, the
gateway's exception handler. The handler returns its DeviceCall (finalize_response lets it
through); the front then checks the principal's rates, makes the call through the pooled async
device client and answers with the device's bytes, as the gateway does. DRF's dispatch is sync
and runs on the event loop (it does no I/O once the principal is cached; on a cache miss, once a
principal, it runs on a thread); adrf's async APIView
was not taken because it runs `initial()` (authentication, permissions) through sync_to_async,
a thread hop a request, the cost that made the earlier gateway slow (docs/performance.md)."""
from __future__ import annotations

import io
import os
from typing import Any

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "aotx_site.settings")

from aotx_site.gateway import application as gateway  # noqa: E402  (sets Django up)
from asgiref.sync import sync_to_async  # noqa: E402
from django.core.handlers.asgi import ASGIRequest  # noqa: E402
from rest_framework.negotiation import DefaultContentNegotiation  # noqa: E402
from rest_framework.permissions import BasePermission  # noqa: E402
from rest_framework.renderers import JSONRenderer  # noqa: E402
from rest_framework.views import APIView  # noqa: E402

from gpu_worker.contract.vocabulary import COMMANDS  # noqa: E402
from shared_api.device_client import pool  # noqa: E402
from shared_api.errors import ServiceError  # noqa: E402
from shared_api.http import front as front_module  # noqa: E402
from shared_api.http.auth import PRINCIPALS, BearerAuthentication, _digest, require_action  # noqa: E402
from shared_api.http.front import (BodyRefused, Front, _body_follows, _content_length, _headers,  # noqa: E402
                                   _reply_headers, _too_large, read_body, respond, respond_error)
from shared_api.http.rates import limiter  # noqa: E402
from shared_api.routes.views import DeviceCall, SharedView  # noqa: E402


class CommandAction(BasePermission):
    """The handler's device command's gateway action (403 `grant_missing` without it)."""

    def has_permission(self, request: Any, view: Any) -> bool:
        handler = getattr(view, request.method.lower(), None)
        command = getattr(handler, "command", None)
        if command is not None:
            require_action(request.user, COMMANDS[command].action)
        return True


class JSONOnly(DefaultContentNegotiation):
    """DRF's parser selection; the one renderer, without looking at Accept."""

    def select_renderer(self, request: Any, renderers: Any, format_suffix: Any = None) -> Any:
        return renderers[0], renderers[0].media_type


class DRFDispatch(APIView):
    authentication_classes = [BearerAuthentication]
    permission_classes = [CommandAction]
    renderer_classes = [JSONRenderer]
    content_negotiation_class = JSONOnly
    throttle_classes: list[Any] = []
    dispatch = APIView.dispatch  # (SharedView's answers 500: the gateway never lets DRF dispatch)

    def finalize_response(self, request: Any, response: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(response, DeviceCall):
            return response
        return super().finalize_response(request, response, *args, **kwargs)


def _cached(request: Any) -> bool:
    """Whether the request's principal is in the principal cache (or it has no valid header:
    DRF's authentication then refuses it without the database)."""
    try:
        digest = _digest(request.headers.get("Authorization", ""))
    except ServiceError:
        return True
    return PRINCIPALS.get(digest) is not None


_VIEWS: dict[type, Any] = {}


def drf_view(view: SharedView) -> Any:
    """The DRF view function of a shared route's view class (made once)."""
    view_class = type(view)
    found = _VIEWS.get(view_class)
    if found is None:
        found = _VIEWS[view_class] = type(view_class.__name__, (DRFDispatch, view_class), {}).as_view()
    return found


class DRFFront(Front):
    async def _shared(self, scope: Any, proto: Any, view: SharedView, kwargs: dict[str, str], method: str) -> int:
        headers = _headers(scope)
        close = _body_follows(headers)
        view_class = type(view)
        try:
            length = _content_length(headers)
            if length is not None and length > view_class.body_limit:
                raise _too_large(view_class.body_limit, view_class.body_code)
            try:
                raw = await read_body(proto, headers, length, view_class.body_limit, view_class.body_code,
                                      front_module.settings.AOTX_BODY_TIMEOUT)
            except BodyRefused as refused:
                raise refused.error from None
            close = False
            request = ASGIRequest(scope, io.BytesIO(raw))
            dispatch = drf_view(view)
            if _cached(request):
                answer = dispatch(request, **kwargs)
            else:  # the database on a principal cache miss: DRF's dispatch on a thread, this once
                answer = await sync_to_async(dispatch)(request, **kwargs)
            if not isinstance(answer, DeviceCall):  # a refusal, from DRF's exception handler
                if hasattr(answer, "render"):
                    answer.render()
                await self._send_response(proto, answer)
                return int(answer.status_code)
            user = request.user
            limiter().admit(user.principal_id, user.rates, len(raw), user.shared_rates)
            msg = await pool().call(answer.op, user.principal_id, answer.args)
        except ServiceError as err:
            respond_error(proto, err, close)
            return err.status
        respond(proto, msg.status, msg.body, _reply_headers(msg))
        return int(msg.status)


application = DRFFront(gateway.django, gateway.streams)
