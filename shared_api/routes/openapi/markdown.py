"""docs/api.md, rendered from the same table as the OpenAPI document (OPERATIONS, SCHEMAS, CODES);
tests/shared_api/test_openapi.py fails when the file and the table differ.
"""
from __future__ import annotations

from gpu_worker.contract.limits import DEFAULT_LIMIT, MAX_LIMIT

from . import GENERAL
from .codes import CODES
from .operations import OPERATIONS, ROUTES, full_path, operation_errors
from .schemas import SCHEMAS, Schema


def _field_text(schema: Schema) -> str:
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[1]
        target = SCHEMAS[name]
        if "enum" in target:
            return _field_text(target)
        return f"{name} `{target['pattern']}`" if "pattern" in target else name
    if "enum" in schema:
        text = " \\| ".join(f'`"{v}"`' for v in schema["enum"])
        return text + (f" (default `\"{schema['default']}\"`)" if "default" in schema else "")
    if schema.get("type") == "array":
        return f"array of {_field_text(schema['items'])}"
    return f"`{schema['pattern']}`" if "pattern" in schema else schema.get("type", "")


def render_markdown() -> str:
    """docs/api.md: a short reference rendered from OPERATIONS, SCHEMAS and CODES."""
    out = ["# AOTX Shared API reference", "",
           "<!-- Rendered from shared_api/routes/openapi/ (the same table as /aotx/v1/openapi.json). Regenerate with",
           "     .venv/bin/python -c 'import django, os; os.environ[\"DJANGO_SETTINGS_MODULE\"] = "
           "\"aotx_site.settings\"; django.setup(); "
           "from shared_api.routes.openapi.markdown import render_markdown as r; "
           "open(\"docs/api.md\", \"w\").write(r())'",
           "     tests/shared_api/test_openapi.py fails when this file and the schema differ. -->", "",
           "The machine-readable contract is `GET /aotx/v1/openapi.json` (OpenAPI 3.1, no token needed).", "",
           GENERAL, "", "## Routes", "",
           "| method | path | gateway action | body | success |", "|---|---|---|---|---|"]
    for key, spec in OPERATIONS.items():
        success = " · ".join(f"{s} {c}" for s, c in sorted(spec["success"].items(), reverse=True))
        out.append(f"| {spec['method']} | `{full_path(key)}` | `{spec['grant']}` | "
                   f"{spec['body'] or '-'} | {success} |")
    out += ["", "List reads take `cursor` (a counter: the previous page's `next_cursor`) and `limit` "
                f"(1..{MAX_LIMIT}, default {DEFAULT_LIMIT}) and answer `{{\"items\": [...], \"next_cursor\": ... | null}}`. "
                "Path IDs that do not match their pattern are 400 `bad_id`; any other query parameter is 400 "
                "`unknown_parameter`.", ""]
    for key, spec in OPERATIONS.items():
        out += [f"## {spec['method']} {ROUTES[key]}", "", f"{spec['summary']}. "
                + " ".join(filter(None, [spec["description"], f"Needs `{spec['grant']}`."])), ""]
        if spec["body"]:
            body = SCHEMAS[spec["body"]]
            out.append("Body fields (besides `schema`, `lineage`, `operation_key`, `sequence`):" if len(
                body["properties"]) > 4 else "Body: the mutation envelope only.")
            for name, field in list(body["properties"].items())[4:]:
                need = "required" if name in body["required"] else "optional"
                out.append(f"- `{name}` ({need}): {_field_text(field)}"
                           + (f" — {field['description']}" if field.get("description") else ""))
            out.append("")
        out.append("Errors: " + "; ".join(
            f"{status} " + (", ".join(f"`{c}`" for c in codes) or "-")
            for status, codes in operation_errors(key).items()))
        out.append("")
    out += ["## Error codes", "", "| status | code | meaning |", "|---|---|---|"]
    statuses: dict[str, set[int]] = {}
    for key in OPERATIONS:
        for status, codes in operation_errors(key).items():
            for code in codes:
                statuses.setdefault(code, set()).add(status)
    for code in sorted(CODES, key=lambda c: (min(statuses[c]), c)):
        listed = ", ".join(str(s) for s in sorted(statuses[code]))
        out.append(f"| {listed} | `{code}` | {CODES[code].replace('|', '/')} |")
    out += ["", "## Components", ""]
    for name in ("Receipt", "Participant", "Space", "Conversation", "Member", "Capabilities", "Error"):
        schema = SCHEMAS[name]
        keys = ", ".join(f"`{k}`" for k in schema["properties"])
        out.append(f"- **{name}**: {keys}." + (f" {schema['description']}" if schema.get("description") else ""))
    return "\n".join(out) + "\n"
