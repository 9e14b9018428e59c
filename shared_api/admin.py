"""The admin console's principals (DESIGN: Django users log in to /admin/; API principals are what
they manage). Adding a principal issues its token once; its actions are a checkbox set of the valid
ones, its quotas a JSON object; every change — add, edit, revoke, reinstate (with a new token),
delete — rewrites the grant file the device
reads (shared_api/grants.py, which checks the document as the device will read it). The device
picks the new file up on its next tick; a reload it refused shows on the principal list."""
from __future__ import annotations

from django import forms
from django.conf import settings
from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse

from gpu_worker.contract.grantfile import LIMITS, GrantFileError, quota_problem
from gpu_worker.contract.vocabulary import ACTIONS

from . import config, ops
from .grants import write_grant_file_for
from .models import Principal, describe_quotas
from .streams.events import notify_principals

STATUS_TIMEOUT = 2.0  # seconds the principal list waits for the device's status

# The admin header's "View site": the gateway's landing page (GET /, aotx_site/urls.py `landing`), which
# links the admin console, the API reference, /healthz and /metrics.
admin.site.site_url = "/"


class PrincipalForm(forms.ModelForm):
    actions = forms.MultipleChoiceField(choices=[(a, a) for a in ACTIONS], widget=forms.CheckboxSelectMultiple,
                                        required=False, help_text="gateway actions of this principal's token")

    class Meta:
        model = Principal
        fields = ("name", "actions", "quotas", "active")
        help_texts = {"quotas": "what this principal may hold at the device at once and how fast it may send, "
                                "e.g. {\"spaces\": 10, \"requests_per_second\": 20, \"chats\": null}; "
                                f"names: {', '.join(LIMITS)}; one left out has its default, a fair share "
                                "(docs/grants.md, \"Defaults\"); null: unlimited",
                      "active": "unticking revokes the principal and its token for good; ticking it again "
                                "issues a new token"}

    def clean_quotas(self) -> dict[str, int | None]:  # (limit -> quota or null: quota_problem checks)
        quotas = self.cleaned_data.get("quotas")
        if quotas is None:
            return {}
        problem = quota_problem(quotas)
        if problem:
            raise forms.ValidationError(problem)
        return quotas


def rewrite_grant_file(request: HttpRequest, changed: list[str]) -> None:
    """Write the grant file from the database and say so (or why not) on the next page; tell the
    open event streams of the changed principals, in every gateway process, to recheck."""
    notify_principals(changed)
    try:
        path, count = write_grant_file_for(settings.AOTX_GATEWAY_CONFIG)
    except (config.ConfigError, GrantFileError, OSError) as exc:
        messages.error(request, f"The grant file was not rewritten: {exc}")
        return
    messages.info(request, f"Grant file {path} rewritten ({count} principals); the device reloads it on its next tick.")


def show_token(request: HttpRequest, principal: Principal, token: str) -> None:
    messages.warning(request, f"The token of {principal.name}, shown this once (only its digest is kept): {token}")


@admin.register(Principal)
class PrincipalAdmin(admin.ModelAdmin):
    form = PrincipalForm
    list_display = ("name", "principal_id", "action_list", "quota_list", "active", "updated_at")
    list_filter = ("active",)
    search_fields = ("name", "principal_id")
    readonly_fields = ("principal_id", "created_at", "updated_at")
    actions = ("rotate_tokens", "revoke", "reinstate")

    @admin.display(description="actions")
    def action_list(self, obj: Principal) -> str:
        return ", ".join(obj.actions) or "-"

    @admin.display(description="quotas")
    def quota_list(self, obj: Principal) -> str:
        return describe_quotas(obj.quotas)

    def save_model(self, request: HttpRequest, obj: Principal, form: forms.BaseForm, change: bool) -> None:
        """A new active principal gets its token; a revoked one made active again gets a new one."""
        was_active = change and Principal.objects.filter(pk=obj.pk, active=True).exists()
        token = obj.rotate_token() if obj.active and not was_active else None
        obj.save()
        rewrite_grant_file(request, [obj.principal_id])
        if token is not None:
            show_token(request, obj, token)

    def delete_model(self, request: HttpRequest, obj: Principal) -> None:
        super().delete_model(request, obj)
        rewrite_grant_file(request, [obj.principal_id])

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[Principal]) -> None:
        changed = [p.principal_id for p in queryset]
        super().delete_queryset(request, queryset)
        rewrite_grant_file(request, changed)

    @admin.action(description="Rotate the token of the selected principals (each new token is shown once)")
    def rotate_tokens(self, request: HttpRequest, queryset: QuerySet[Principal]) -> None:
        for principal in queryset:
            if not principal.active:
                messages.error(request, f"{principal.name} is revoked: reinstating it issues a new token")
                continue
            token = principal.rotate_token()
            principal.save()
            show_token(request, principal, token)
        notify_principals([p.principal_id for p in queryset])  # the old tokens' streams end

    @admin.action(description="Revoke the selected principals (no action, their tokens refused for good)")
    def revoke(self, request: HttpRequest, queryset: QuerySet[Principal]) -> None:
        for principal in queryset:
            principal.revoke()
            principal.save()
        rewrite_grant_file(request, [p.principal_id for p in queryset])

    @admin.action(description="Reinstate the selected principals (each gets a new token, shown once)")
    def reinstate(self, request: HttpRequest, queryset: QuerySet[Principal]) -> None:
        for principal in queryset:
            if principal.active:
                continue
            token = principal.reinstate()
            principal.save()
            show_token(request, principal, token)
        rewrite_grant_file(request, [p.principal_id for p in queryset])

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, object] | None = None) -> HttpResponse:
        """The principal list also says whether the device accepted the current grant file."""
        if request.method == "GET":
            problem = device_grant_problem()
            if problem:
                messages.error(request, f"The device could not reload the grant file and keeps its previous grants: "
                                        f"{problem}")
        return super().changelist_view(request, extra_context)


def device_grant_problem() -> str | None:
    """The device's last grant-file reload failure, None when it has none or cannot be asked."""
    status = ops.ping(STATUS_TIMEOUT)
    problem = ops.json_object((status or {}).get("grants")).get("problem")
    return problem if isinstance(problem, str) else None
