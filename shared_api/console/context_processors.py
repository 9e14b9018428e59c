"""The journal hold state on every admin page (templates/admin/base_site.html): asked of the
device once per page, and only when the page is rendered for a staff user."""
from __future__ import annotations

from django.http import HttpRequest
from django.urls import reverse
from django.utils.functional import SimpleLazyObject

from .. import ops


def journal_hold(request: HttpRequest) -> dict[str, object]:
    user = getattr(request, "user", None)
    if not (user is not None and user.is_active and user.is_staff and request.path.startswith(reverse("admin:index"))):
        return {}
    return {"aotx_hold": SimpleLazyObject(lambda: ops.hold_state(ops.request_status(request)))}
