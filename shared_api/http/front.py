"""The gateway's HTTP front: the one application every request goes through (aotx_site/gateway.py),
served through RSGI by granian (shared_api/http/server.py).

The shared routes (every SharedView in the URLconf: /aotx/v1/shared/..., /aotx/v1/media/...) are
dispatched by DRF here, on the event loop: the front matches the path against the URLconf's
patterns, admits the caller from the Authorization header through the principal cache (401/403
before the body), reads the body within the route's limit, calls the route's DRF view function
on Django's ASGIRequest of it (DRF's request, authentication and permission classes, parsers,
negotiation and exception handler: shared_api/routes/views.py) and makes the handler's
DeviceCall through the process's pooled async device client. Nothing of it waits on a thread
(docs/performance.md: Django's ASGI handler costs several thread hops per request, which bounded
the gateway at a few hundred requests a second).

Refusing before reading (every route): a request head over AOTX_MAX_HEADER_BYTES is answered 431
`headers_too_large`; a token in the query string is refused and never logged;
a request without a valid token is answered 401 from its headers, and a body over the route's
limit 413 from its Content-Length (or as soon as a chunked body passes the limit), in both cases
without reading the body, and the connection is then closed; so is a request past one of its
principal's rates (429 `rate_limited`, shared_api/http/rates.py). A body that stalls for
AOTX_BODY_TIMEOUT seconds is answered 408. Requests waiting on the device are bounded per process
(DevicePool: 503 `gateway_busy` beyond). The OpenAI-compatible routes (/v1/chat/completions,
/v1/completions, /v1/embeddings, /v1/models) run their async views here too, on Django's
ASGIRequest, refused 401 / 413 from the headers. Event streams go to their Channels consumers,
every other request (admin, schema, /metrics, /healthz) to Django, both through the server's one
ASGI bridge (`server.asgi`), Django behind the same guard: its bodies are bounded too.
"""
from __future__ import annotations

import asyncio
import io
import logging
import os
import re
import time
from typing import Any, Awaitable, Callable
from urllib.parse import parse_qsl

from django.conf import settings
from django.core.handlers.asgi import ASGIRequest
from django.http import HttpRequest, HttpResponse, HttpResponseBase, StreamingHttpResponse
from django.http.request import split_domain_port, validate_host
from django.urls import URLPattern, URLResolver, get_resolver
from django.urls.converters import StringConverter

from gpu_worker.contract.limits import MAX_CHAT_BODY_BYTES
from gpu_worker.contract.vocabulary import CHAT, COMMANDS
from gpu_worker.contract.wire import Reply

from . import metrics
from .auth import ADMITTED, AuthenticatedPrincipal, admit
from ..device_client import pool
from ..errors import WWW_AUTHENTICATE, ServiceError
from ..openai.views import ROUTES as OPENAI_ROUTES
from ..openai.views import PRINCIPAL as OPENAI_PRINCIPAL
from ..openai.views import openai_error
from .rates import RateLimited, limiter, retry_headers
from .refusals import RefusalBackoff, is_quota_refusal
from .server import (HEAD_BYTES, HEADERS, PRIVATE_HEADERS, REPEATED, ASGIApp, AccessLog, BodyIncomplete, Logged,
                     Proto, Receive, Receiver, RequestHead, Scope, Stream, asgi, asgi_scope, body_chunks)
from ..routes.views import DeviceCall, SharedView

log = logging.getLogger("shared_api.http.front")

TOKEN_PREFIX = "aotx_"
TOKEN_PARAMETERS = frozenset(("access_token", "token", "api_key", "apikey", "key", "authorization", "bearer"))
BASE_HEADERS = [("content-type", "application/json"), *PRIVATE_HEADERS]
OPENAI_PREFIX = "/v1/"
WHOLE_BODY_BYTES = 256 * 1024  # a declared body up to this is read whole, timed as a whole (else chunk by chunk)
OPENAI_CODES = {"rate_limited": "rate_limit_exceeded"}  # our codes under OpenAI's names, on /v1


class BodyRefused(Exception):
    """The body was not read to its end: too large (413), too slow (408) or cut off (400)."""

    def __init__(self, error: ServiceError) -> None:
        super().__init__(error.message)
        self.error = error


class ClientGone(Exception):
    """The client (/v1) disconnected before its answer was ready: there is no one to answer."""


def _headers(scope: Scope) -> dict[bytes, bytes]:
    """Request headers by lowercase name (a repeated header: its last value)."""
    found: dict[bytes, bytes] | None = scope.get(HEADERS)  # (asgi_scope's)
    return found if found is not None else {name.lower(): value for name, value in scope["headers"]}


def _token_in_query(scope: Scope) -> bool:
    query = scope.get("query_string", b"")
    if not query:
        return False
    for name, value in parse_qsl(query.decode("latin-1"), keep_blank_values=True):
        if name.lower() in TOKEN_PARAMETERS or TOKEN_PREFIX in value:
            return True
    return False


ONCE_ONLY = (b"authorization", b"host")  # headers a request may send once (a proxy may read the first, we the last)


def _head_refusal(scope: Scope) -> ServiceError | None:
    """What every route refuses from the head alone, Django's and the streams' as the API's: a
    header that says who the caller is, or which site it asks, sent twice (400
    `repeated_header`); a Host outside AOTX_ALLOWED_HOSTS (400 `bad_host`, Django's rule, applied
    once here for every route)."""
    for name in scope.get(REPEATED, ()):
        if name in ONCE_ONLY:
            return ServiceError(400, "repeated_header", f"the {name.decode()} header is sent more than once")
    host = _headers(scope).get(b"host")
    if host is not None and not _allowed_host(host):
        return ServiceError(400, "bad_host", f"Invalid Host header {host.decode('latin-1')[:200]!r}: it is not in "
                                             f"AOTX_ALLOWED_HOSTS")
    return None


def allow_listen_host() -> None:
    """The address the gateway listens on, when it names one (`serve` sets AOTX_LISTEN_HOST before
    its workers start; a worker may have loaded the settings before), is an allowed host: added
    to settings.ALLOWED_HOSTS, which Django's own check (the admin) reads on every request too."""
    host = os.environ.get("AOTX_LISTEN_HOST", "")
    if host in ("", "0.0.0.0", "::"):
        return
    pattern = f"[{host}]" if ":" in host else host
    if pattern not in settings.ALLOWED_HOSTS:
        settings.ALLOWED_HOSTS = [*settings.ALLOWED_HOSTS, pattern]


_HOSTS_SEEN: dict[bytes, bool] = {}  # Host values answered before, and whether they were allowed


def _allowed_host(host: bytes) -> bool:
    allowed = _HOSTS_SEEN.get(host)
    if allowed is None:
        domain, _ = split_domain_port(host.decode("latin-1"))
        allowed = bool(domain) and validate_host(domain, settings.ALLOWED_HOSTS)
        if len(_HOSTS_SEEN) < 256:  # (a hostile client's many made-up hosts are checked each time)
            _HOSTS_SEEN[host] = allowed
    return allowed


def _body_follows(headers: dict[bytes, bytes]) -> bool:
    """Whether a body follows the headers: answered before it is read, such a request leaves the
    connection unusable (the answer closes it)."""
    return b"transfer-encoding" in headers or headers.get(b"content-length", b"0") not in (b"0", b"")


def _content_length(headers: dict[bytes, bytes]) -> int | None:
    value = headers.get(b"content-length")
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ServiceError(400, "bad_request", "Content-Length must be a decimal integer") from None


def _too_large(limit: int, code: str = "body_too_large") -> ServiceError:
    return ServiceError(413, code, f"the body exceeds this route's {limit} bytes")


def _stalled(timeout: float) -> ServiceError:
    return ServiceError(408, "body_timeout", f"the body stalled for {timeout:g}s")


def _incomplete() -> ServiceError:
    return ServiceError(400, "body_incomplete", "the body did not arrive whole (its chunked framing broke, or the "
                                                "connection ended before its end): nothing was done")


async def read_body(proto: Proto, headers: dict[bytes, bytes], length: int | None, limit: int, code: str,
                    timeout: float) -> bytes:
    """The whole body, at most `limit` bytes (BodyRefused 413 past it, 408 when a chunk takes
    longer than `timeout`: one timer for the body, moved on at each chunk; a small declared body,
    within `limit` by then, is read whole in `timeout`); the memory it holds is the body and no
    more. A body that does not arrive whole (broken chunked framing, fewer bytes than its
    Content-Length, the connection ended first) is BodyRefused 400 `body_incomplete`: an upload
    cut off mid-way is never taken for a complete one."""
    if length == 0 or (length is None and b"transfer-encoding" not in headers):
        return b""
    if length is not None and length <= WHOLE_BODY_BYTES:
        # a small declared body in one read (each chunk read is a wake-up from the server's thread)
        try:
            async with asyncio.timeout(timeout):
                body = await proto()
        except TimeoutError:
            raise BodyRefused(_stalled(timeout)) from None
        except asyncio.CancelledError:
            raise
        except Exception:  # (the server's: the body could not be read whole)
            raise BodyRefused(_incomplete()) from None
        if len(body) != length:
            raise BodyRefused(_incomplete())
        return body
    parts: list[bytes] = []
    size = 0
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(timeout) as deadline:
            async for chunk in body_chunks(proto):
                size += len(chunk)
                if size > limit:
                    raise BodyRefused(_too_large(limit, code))
                parts.append(chunk)
                deadline.reschedule(loop.time() + timeout)
    except TimeoutError:
        raise BodyRefused(_stalled(timeout)) from None
    except BodyIncomplete:
        raise BodyRefused(_incomplete()) from None
    if length is not None and size != length:
        raise BodyRefused(_incomplete())
    return parts[0] if len(parts) == 1 else b"".join(parts)


def respond(proto: Proto, status: int, body: bytes, headers: list[tuple[str, str]] | None = None,
            close: bool = False) -> None:
    """A JSON answer (the server adds its Content-Length); `close`: the body was not read, so the
    connection cannot carry another request."""
    out = [*BASE_HEADERS, *(headers or [])]
    if close:
        out.append(("connection", "close"))
    proto.response_bytes(status, out, body)


def respond_error(proto: Proto, err: ServiceError, close: bool = False,
                  headers: list[tuple[str, str]] | None = None) -> None:
    extra = [("www-authenticate", WWW_AUTHENTICATE)] if err.status == 401 else []
    respond(proto, err.status, err.body(), extra + (headers or []), close)


async def _disconnected(proto: Proto) -> None:
    """Returns when the client disconnects."""
    await proto.client_disconnect()


def _reply_headers(msg: Reply) -> list[tuple[str, str]]:
    return [(str(name).lower(), str(value)) for name, value in (msg.headers or {}).items()]


def _authorization(headers: dict[bytes, bytes]) -> str:
    return headers.get(b"authorization", b"").decode("latin-1")


# An OpenAI-compatible route's view (shared_api/openai/views.py).
OpenAIView = Callable[[HttpRequest], Awaitable[HttpResponseBase]]

async def _admit(view: SharedView, method: str, headers: dict[bytes, bytes]
                 ) -> tuple[AuthenticatedPrincipal, int | None]:
    """What must be refused before the body is read: the caller once it holds the method's
    action, when the declared body is within the route's limit; and the declared length (None:
    chunked). Refusals: 405, 401, 403, 413."""
    handler = getattr(view, "get" if method == "HEAD" else method.lower(), None)
    command = getattr(handler, "command", None)
    if handler is None or command is None:
        raise _MethodNotAllowed(method, [m.upper() for m in ("get", "post", "put") if hasattr(view, m)])
    action = COMMANDS[command].action
    assert action is not None
    user = await admit(_authorization(headers), action)
    view_class = type(view)
    limit = view_class.body_limit
    length = _content_length(headers)
    if length is not None and length > limit:
        raise _too_large(limit, view_class.body_code)
    return user, length


def _drf_request(scope: Scope, raw: bytes, length: int | None, user: AuthenticatedPrincipal) -> ASGIRequest:
    """Django's request of a shared route's body, read, and the principal admitted for it (what
    the view's BearerAuthentication hands DRF). A chunked body gets the Content-Length of what
    was read: DRF reads a body of the declared length only."""
    scope[ADMITTED] = user
    if length is None:
        scope["headers"] = [(name, value) for name, value in scope["headers"]
                            if name.lower() not in (b"content-length", b"transfer-encoding")]
        scope["headers"].append((b"content-length", str(len(raw)).encode()))
    return ASGIRequest(scope, io.BytesIO(raw))


class Route:
    """One shared route of the URLconf: its full regex, view (for what is checked before the
    body), DRF view function (`dispatch`) and pattern (the metrics' label)."""
    __slots__ = ("regex", "view", "dispatch", "route")

    def __init__(self, regex: re.Pattern[str], view_class: type[SharedView], route: str) -> None:
        self.regex = regex
        self.view = view_class()
        self.dispatch: Callable[..., HttpResponseBase | DeviceCall] = view_class.as_view()
        self.route = route


def shared_routes() -> list[Route]:
    """Every SharedView route of the URLconf, in its order, as one anchored regex each (Django's
    resolver builds a ResolverMatch and walks thread-locals per request: a tenth of the front's
    time). Path converters must be `str` (the value as matched), as they all are."""
    routes: list[Route] = []

    def walk(patterns: list[URLPattern | URLResolver], regex: str, route: str) -> None:
        for entry in patterns:
            part = entry.pattern.regex.pattern.lstrip("^")
            if isinstance(entry, URLResolver):
                walk(entry.url_patterns, regex + part, route + str(entry.pattern))
            elif isinstance(entry, URLPattern):
                view_class = getattr(entry.callback, "view_class", None)
                if isinstance(view_class, type) and issubclass(view_class, SharedView):
                    converters = getattr(entry.pattern, "converters", {})
                    assert all(isinstance(c, StringConverter) for c in converters.values()), entry
                    routes.append(Route(re.compile("/" + regex + part), view_class, route + str(entry.pattern)))
    walk(get_resolver().url_patterns, "", "")
    return routes


class Front:
    """The application (RSGI): shared routes and OpenAI routes here, streams to `streams`, the rest
    to `django` (both ASGI, through the server's bridge)."""

    def __init__(self, django: ASGIApp, streams: Callable[[Scope], ASGIApp | None]) -> None:
        self.django = django
        self.streams = streams
        self._routes: list[Route] | None = None
        self.refusals = RefusalBackoff()  # over-quota answers, later for a principal that keeps asking
        self.sleep = asyncio.sleep  # (its waits: tests record them)
        self.max_header_bytes = settings.AOTX_MAX_HEADER_BYTES
        self.access_log = AccessLog()
        allow_listen_host()

    def route(self, path: str) -> tuple[Route, dict[str, str]] | None:
        if self._routes is None:
            self._routes = shared_routes()
        for route in self._routes:
            match = route.regex.match(path)
            if match is not None:
                return route, match.groupdict()
        return None

    async def __rsgi__(self, request: RequestHead, proto: Proto) -> None:
        if request.proto != "http":  # (the server serves HTTP only: websockets are off)
            return
        started = time.perf_counter()
        logged = Logged(proto)
        try:
            await self.answer(request, logged)
        finally:
            self.access_log.add(request, logged.status, started)

    async def answer(self, request: RequestHead, proto: Proto) -> None:
        scope = asgi_scope(request)
        if scope[HEAD_BYTES] > self.max_header_bytes:
            respond_error(proto, ServiceError(431, "headers_too_large", f"the request line and headers exceed "
                                                                        f"{self.max_header_bytes} bytes"), close=True)
            return
        refused = _head_refusal(scope)
        if refused is not None:
            respond_error(proto, refused, close=True)
            return
        if _token_in_query(scope):
            respond_error(proto, ServiceError(
                401, "unauthenticated", "a token is accepted only in the Authorization header, never in the URL "
                                        "(URLs are logged): rotate this token"), close=True)
            return
        consumer = self.streams(scope)
        if consumer is not None:
            await asgi(consumer, scope, proto)
            return
        found = self.route(scope["path"])
        if found is not None:
            await self.shared(scope, proto, *found)
            return
        view = OPENAI_ROUTES.get(scope["path"])
        if view is not None:
            await self.openai(scope, proto, view)
        else:
            await self.guarded_django(scope, proto)

    # ---- the shared routes --------------------------------------------------------------

    async def shared(self, scope: Scope, proto: Proto, route: Route, kwargs: dict[str, str]) -> None:
        started = time.perf_counter()
        method = scope["method"]
        status = 500
        try:
            status = await self._shared(scope, proto, route, kwargs, method)
        finally:
            metrics.record(method, route.route, status, started)

    async def _shared(self, scope: Scope, proto: Proto, route: Route, kwargs: dict[str, str], method: str) -> int:
        """Refusals before the body (`_admit`, the rates), the body read within the route's limit,
        then DRF's dispatch of the view on it (no I/O: the principal is admitted), and the
        handler's DeviceCall through the pooled client; DRF's refusals in its exception
        handler's error body."""
        headers = _headers(scope)
        close = _body_follows(headers)
        view_class = type(route.view)
        try:
            user, length = await _admit(route.view, method, headers)
            limiter().admit(user.principal_id, user.rates, length or 0, user.shared_rates)
            try:
                raw = await read_body(proto, headers, length, view_class.body_limit, view_class.body_code,
                                      settings.AOTX_BODY_TIMEOUT)
            except BodyRefused as refused:
                raise refused.error from None
            if length is None:
                limiter().charge(user.principal_id, user.rates, len(raw), user.shared_rates)
            close = False
            answer = route.dispatch(_drf_request(scope, raw, length, user), **kwargs)
            if not isinstance(answer, DeviceCall):  # a refusal, from DRF's exception handler
                await self._send_response(proto, answer)
                return int(answer.status_code)
            msg = await pool().call(answer.op, user.principal_id, answer.args)
        except _MethodNotAllowed as exc:
            respond_error(proto, exc.error(), close, [("allow", ", ".join(exc.allowed))])
            return 405
        except ServiceError as err:
            extra = None
            if isinstance(err, RateLimited):
                extra = retry_headers(err)
                await self.refused_again(err.principal_id)
            respond_error(proto, err, close, extra)
            return err.status
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("internal error answering %s %s", method, scope["path"])
            respond_error(proto, ServiceError(500, "internal_error", "internal error; see the gateway log"))
            return 500
        reply_headers = _reply_headers(msg)
        if is_quota_refusal(msg.status, msg.body):
            reply_headers.append(("retry-after", "1"))
            await self.refused_again(user.principal_id)
        respond(proto, msg.status, msg.body, reply_headers)
        return int(msg.status)

    async def refused_again(self, principal_id: str) -> None:
        """Wait before answering a principal's over-quota refusal (shared_api/http/refusals.py)."""
        delay = self.refusals.delay(principal_id)
        if delay:
            await self.sleep(delay)

    # ---- the OpenAI-compatible routes ----------------------------------------------------

    async def openai(self, scope: Scope, proto: Proto, view: OpenAIView) -> None:
        """/v1/chat/completions and the rest: their async views, run here on Django's ASGIRequest,
        without Django's handler and middleware. Those cost a thread per request (the handler's
        ThreadSensitiveContext and the sync middlewares' hops), and a tenant looping on 429 slowed
        the other tenants' reads (docs/performance.md, "Hostile neighbours").
        Refused from the headers as the guard refuses (401, 413), bodies bounded and timed. A
        client that disconnects before its answer is ready cancels the view (`_unless_gone`), and
        one that disconnects from a stream cancels its generator: either way a chat stops."""
        started = time.perf_counter()
        status = 500
        try:
            status = await self._openai(scope, proto, view)
        finally:
            metrics.record(scope["method"], scope["path"], status, started)

    async def _openai(self, scope: Scope, proto: Proto, view: OpenAIView) -> int:
        headers = _headers(scope)
        close = _body_follows(headers)
        try:
            user = await admit(_authorization(headers), CHAT)  # every OpenAI-compatible route's action
            length = _content_length(headers)
            if length is not None and length > MAX_CHAT_BODY_BYTES:
                raise BodyRefused(_too_large(MAX_CHAT_BODY_BYTES))
            limiter().admit(user.principal_id, user.rates, length or 0, user.shared_rates)
            raw = await read_body(proto, headers, length, MAX_CHAT_BODY_BYTES, "body_too_large",
                                  settings.AOTX_BODY_TIMEOUT)
            if length is None:
                limiter().charge(user.principal_id, user.rates, len(raw), user.shared_rates)
        except (ServiceError, BodyRefused) as exc:
            err = exc.error if isinstance(exc, BodyRefused) else exc
            if isinstance(err, RateLimited):
                await self.refused_again(err.principal_id)
            self._refuse(proto, err, True, close=close or err.status == 401)
            return err.status
        request = ASGIRequest(scope, io.BytesIO(raw))  # (Django's request of an ASGI scope and its body)
        setattr(request, OPENAI_PRINCIPAL, user.principal_id)  # the views' principal: authenticated once, here
        try:
            response = await self._unless_gone(view(request), proto)
        except ClientGone:
            return 499  # the view was cancelled: it closed its device stream (a chat stops)
        except Exception:
            log.exception("internal error answering %s %s", scope["method"], scope["path"])
            self._refuse(proto, ServiceError(500, "internal_error", "internal error; see the gateway log"),
                         True, close=False)
            return 500
        if isinstance(response, HttpResponse) and is_quota_refusal(response.status_code, response.content):
            response["Retry-After"] = "1"
            await self.refused_again(user.principal_id)
        await self._send_response(proto, response, stream=True)
        return int(response.status_code)

    @staticmethod
    async def _unless_gone(answer: Awaitable[HttpResponseBase], proto: Proto) -> HttpResponseBase:
        """The view's response, or ClientGone when the client disconnects first: the view is then
        cancelled, as Django's ASGI handler cancels its views, and its cleanup closes its device
        stream. A non-streamed chat waits minutes for its whole answer; without this, a client
        that gave up left the device generating an answer nobody would read."""
        loop = asyncio.get_running_loop()
        answering = asyncio.ensure_future(answer)
        listening = loop.create_task(_disconnected(proto))
        try:
            await asyncio.wait((answering, listening), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (answering, listening):
                task.cancel()  # (a no-op on a task that is done)
            await asyncio.gather(answering, listening, return_exceptions=True)
        if answering.cancelled():
            raise ClientGone
        return answering.result()  # (or the view's exception)

    @staticmethod
    def _django_headers(response: HttpResponseBase, close: bool) -> list[tuple[str, str]]:
        out = [(name.lower(), value) for name, value in response.items()] + PRIVATE_HEADERS
        if close:
            out.append(("connection", "close"))
        return out

    @classmethod
    async def _send_response(cls, proto: Proto, response: HttpResponseBase, close: bool = False,
                             stream: bool = False) -> None:
        """A Django response, as Django's handler would send it behind NoStoreMiddleware (with
        `close`, the connection ends after it). A streamed one (`stream`) is sent as its generator
        yields; the client's disconnect cancels the generator (which closes its device stream: a
        chat stops and frees its pages)."""
        out = cls._django_headers(response, close)
        if not isinstance(response, StreamingHttpResponse):
            assert isinstance(response, HttpResponse)
            proto.response_bytes(response.status_code, out, response.content)
            return
        assert stream
        # granian ends a streamed response when its transport is released: held here only
        transport: list[Stream] = [proto.response_stream(response.status_code, out)]

        async def write() -> None:
            async for part in response:
                await transport[0].send_bytes(part)

        loop = asyncio.get_running_loop()
        streaming, listening = loop.create_task(write()), loop.create_task(_disconnected(proto))
        try:
            await asyncio.wait((streaming, listening), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (streaming, listening):
                task.cancel()
            await asyncio.gather(streaming, listening, return_exceptions=True)
            transport.clear()
        if streaming.done() and not streaming.cancelled() and streaming.exception() is not None:
            if listening.done():
                return  # (the client went away: its writes failed)
            raise streaming.exception()  # type: ignore[misc]

    # ---- everything else: Django, behind the guard --------------------------------------

    async def guarded_django(self, scope: Scope, proto: Proto) -> None:
        """Django reads a whole body before its view runs: refuse what must be refused first."""
        headers = _headers(scope)
        openai = scope["path"].startswith(OPENAI_PREFIX)
        limit = MAX_CHAT_BODY_BYTES if openai else settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        try:
            if openai:
                await admit(_authorization(headers), CHAT)
            length = _content_length(headers)
            if length is not None and length > limit:
                raise BodyRefused(_too_large(limit))
        except (ServiceError, BodyRefused) as exc:
            err = exc.error if isinstance(exc, BodyRefused) else exc
            self._refuse(proto, err, openai, close=isinstance(exc, BodyRefused) or err.status == 401)
            return
        refused: list[ServiceError] = []
        received = 0
        timeout = settings.AOTX_BODY_TIMEOUT

        def bound(receive: Receiver) -> Receive:
            async def bounded_receive() -> dict[str, Any]:
                nonlocal received
                if refused:
                    return {"type": "http.disconnect"}
                if receive.body_done:  # (then it waits for the disconnect: no body timeout)
                    return await receive()
                try:
                    async with asyncio.timeout(timeout):
                        message = await receive()
                except TimeoutError:
                    refused.append(_stalled(timeout))
                    return {"type": "http.disconnect"}
                if message["type"] == "http.request":
                    received += len(message.get("body", b""))
                    if received > limit:
                        refused.append(_too_large(limit))
                        return {"type": "http.disconnect"}
                elif receive.incomplete:
                    refused.append(_incomplete())
                return message
            return bounded_receive

        started = await asgi(self.django, scope, proto, bound)
        if refused and not started:  # Django gave up on the body (RequestAborted) and answered nothing
            self._refuse(proto, refused[0], openai, close=True)

    @classmethod
    def _refuse(cls, proto: Proto, err: ServiceError, openai: bool, close: bool) -> None:
        extra = retry_headers(err) if isinstance(err, RateLimited) else []
        if not openai:
            respond_error(proto, err, close, extra)
            return
        response = openai_error(err.status, OPENAI_CODES.get(err.code, err.code), err.message)  # OpenAI's shape
        for name, value in extra:
            response[name] = value
        proto.response_bytes(response.status_code, cls._django_headers(response, close), response.content)


class _MethodNotAllowed(Exception):
    def __init__(self, method: str, allowed: list[str]) -> None:
        super().__init__(method)
        self.method = method
        self.allowed = allowed

    def error(self) -> ServiceError:
        return ServiceError(405, "method_not_allowed", f'Method "{self.method}" not allowed.')
