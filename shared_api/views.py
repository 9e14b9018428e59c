"""The shared routes (DESIGN §4). Views are thin: check the gateway action, parse strictly,
call the device, pass its bytes through. The device re-checks grants and membership."""
from rest_framework.views import APIView

from .auth import require_action
from .device_client import device_response
from .errors import ApiError
from .strict import Mutation, decimal_counter, resource_id

MAX_LIMIT = 200


def list_args(request):
    args = {}
    cursor = request.query_params.get("cursor")
    if cursor is not None:
        decimal_counter(cursor, "cursor")
        args["cursor"] = cursor
    limit = request.query_params.get("limit")
    if limit is not None:
        if not limit.isdigit() or not 1 <= int(limit) <= MAX_LIMIT:
            raise ApiError(400, "bad_limit", f"limit must be an integer 1..{MAX_LIMIT}")
        args["limit"] = int(limit)
    unknown = sorted(set(request.query_params) - {"cursor", "limit"})
    if unknown:
        raise ApiError(400, "unknown_parameter", f"unknown query parameter(s): {', '.join(unknown)}")
    return args


class SharedView(APIView):
    """GET needs shared_read; POST needs the view's write_action."""
    write_action = "shared_write"

    def initial(self, request, *args, **kwargs):
        super().initial(request, *args, **kwargs)
        require_action(request, "shared_read" if request.method in ("GET", "HEAD") else self.write_action)


class CapabilitiesView(SharedView):
    def get(self, request):
        return device_response("capabilities", request)


class ParticipantView(SharedView):
    def get(self, request):
        return device_response("participant.get", request)

    def post(self, request):
        mutation = Mutation(request)
        return device_response("participant.register", request, mutation.args())


class OperationsView(SharedView):
    def get(self, request):
        return device_response("operations.list", request, list_args(request))


class OperationView(SharedView):
    def get(self, request, operation):
        return device_response("operations.get", request, {"operation": resource_id(operation, "op")})
