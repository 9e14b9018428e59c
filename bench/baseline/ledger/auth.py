"""Bearer tokens, kept apart from views.py: DRF reads DEFAULT_AUTHENTICATION_CLASSES while the
APIView subclass is being defined, so this class cannot live in the module that defines it."""
import hashlib

from rest_framework.authentication import BaseAuthentication
from rest_framework.exceptions import AuthenticationFailed

from .models import Token


class BearerTokenAuthentication(BaseAuthentication):
    def authenticate(self, request):
        scheme, _, token = request.META.get("HTTP_AUTHORIZATION", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            return None
        row = Token.objects.filter(token_hash=hashlib.sha256(token.encode()).hexdigest(), active=True).first()
        if row is None:
            raise AuthenticationFailed("unknown or revoked token")
        return row, None

    def authenticate_header(self, request):
        return 'Bearer realm="baseline"'
