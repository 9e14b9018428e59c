class NoStoreMiddleware:
    """SPEC: all responses disable caching (errors, admin pages and the schema included)."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        response = self.get_response(request)
        response["Cache-Control"] = "no-store"
        return response
