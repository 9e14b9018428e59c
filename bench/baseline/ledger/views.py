"""POST /m: the baseline's one mutation, written the way a plain DRF service would write it.

Same contract as the gateway's space creation, minus the device: strict envelope, bearer token
checked by one indexed lookup of its SHA-256, then an idempotent insert keyed by (lineage,
sequence). New -> 202 with a receipt-shaped body of the gateway's size; exact retry -> 200 with
the stored bytes; changed input -> 409."""
import hashlib
import json
import re

import rfc8785
from django.db import IntegrityError
from django.http import HttpResponse
from rest_framework.views import APIView

from .models import Operation

SCHEMA = "aotx.shared.mutation.v1"
ENVELOPE = ("schema", "lineage", "operation_key", "sequence")
HEX32 = re.compile(r"[0-9a-f]{32}\Z")
DECIMAL = re.compile(r"[1-9][0-9]{0,18}\Z")
SCOPES = ("private", "room", "instance")
INCARNATION = hashlib.sha256(b"baseline").hexdigest()[:32]


def error(status, code, message):
    return HttpResponse(json.dumps({"error": {"code": code, "message": message}}), status=status,
                        content_type="application/json")


def receipt(lineage, key, sequence, canonical):
    """The gateway's receipt fields, so both systems send about the same bytes back."""
    save = {"boot": "1", "commit_digest": hashlib.sha256(canonical).hexdigest(), "file_incarnation": INCARNATION,
            "generation": str(sequence), "source": "postgresql"}
    return json.dumps({
        "admission": {"save": save, "saved": True}, "device": {"committed": True}, "disk_error": None,
        "effective": {"model_digest": None, "page_limit": None}, "kind": "space.create",
        "operation": f"op-{lineage}-{key}", "operation_key": key, "participant": f"par-{lineage}",
        "pending_bytes": 0, "result": {"finish": None, "input_tokens": None, "length": 0, "output_tokens": None},
        "schema": "aotx.shared.receipt.v1", "sequence": str(sequence), "target": f"spc-{lineage}-{key}",
        "terminal": {"save": save, "saved": True, "status": "succeeded"}, "transport": {"accepted": True},
    }, sort_keys=True, separators=(",", ":")).encode()


class Mutate(APIView):
    def post(self, request):
        body = request.data
        if not isinstance(body, dict):
            return error(400, "invalid_json", "body must be a JSON object")
        unknown = sorted(set(body) - set(ENVELOPE) - {"scope"})
        missing = [f for f in ENVELOPE if f not in body]
        if unknown or missing:
            return error(400, "bad_fields", f"unknown {unknown}, missing {missing}")
        lineage, key, sequence = body["lineage"], body["operation_key"], body["sequence"]
        if (body["schema"] != SCHEMA or not isinstance(lineage, str) or not HEX32.match(lineage)
                or not isinstance(key, str) or not HEX32.match(key) or int(key, 16) == 0
                or not isinstance(sequence, str) or not DECIMAL.match(sequence)
                or body.get("scope", "private") not in SCOPES):
            return error(400, "bad_field", "malformed envelope")
        if lineage != request.user.lineage:
            return error(409, "stale_lineage", "lineage does not belong to this token")
        canonical = rfc8785.dumps({"method": "POST", "path": request.path, "body": body})
        response = receipt(lineage, key, sequence, canonical)
        try:
            # autocommit: this INSERT is one synchronously committed transaction
            Operation.objects.create(lineage=lineage, sequence=int(sequence), canonical=canonical, response=response)
        except IntegrityError:
            stored = Operation.objects.filter(lineage=lineage, sequence=int(sequence)).values_list(
                "canonical", "response").first()
            if stored is not None and bytes(stored[0]) == canonical:
                return HttpResponse(bytes(stored[1]), status=200, content_type="application/json")
            return error(409, "changed_input", "this sequence was used with different bytes")
        return HttpResponse(response, status=202, content_type="application/json",
                            headers={"Location": f"/operations/op-{lineage}-{key}"})
