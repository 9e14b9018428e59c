from django.contrib import admin

from .models import Principal


@admin.register(Principal)
class PrincipalAdmin(admin.ModelAdmin):
    list_display = ("name", "principal_id", "actions", "active", "updated_at")
    readonly_fields = ("principal_id", "created_at", "updated_at")
    exclude = ("token_hash",)
