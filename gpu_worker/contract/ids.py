"""Identifier and counter shapes of SPEC.md "Resources" (lowercase hex only). The gateway refuses
anything else with 400 before the device sees it; the device parses with the same patterns."""
from __future__ import annotations

import re

HEX32_PATTERN = "[0-9a-f]{32}"
HEX32 = re.compile(rf"{HEX32_PATTERN}\Z")
SHA256 = re.compile(r"[0-9a-f]{64}\Z")
# Counters are decimal strings without leading zeros, below 2**63; sequences and floors start at 1.
COUNTER_PATTERN = "(0|[1-9][0-9]{0,18})"
POSITIVE_PATTERN = "[1-9][0-9]{0,18}"
COUNTER = re.compile(COUNTER_PATTERN + r"\Z")
MAX_COUNTER = (1 << 63) - 1

# prefix -> the whole ID's pattern, unanchored (OpenAPI anchors it with ^ and $)
ID_PATTERNS = {
    "par": f"par-{HEX32_PATTERN}",
    "spc": f"spc-{HEX32_PATTERN}-{HEX32_PATTERN}",
    "con": f"con-{HEX32_PATTERN}-{HEX32_PATTERN}",
    "op": f"op-{HEX32_PATTERN}-{HEX32_PATTERN}",
    "mem": f"mem-{HEX32_PATTERN}-{HEX32_PATTERN}",
}
# The same shapes with each hex part as a group: par- has one (the participant), the others two
# (lineage, id).
PARTICIPANT_ID = re.compile(rf"par-({HEX32_PATTERN})\Z")
SPACE_ID, CONVERSATION_ID, OPERATION_ID, MEMORY_ID = (
    re.compile(rf"{prefix}-({HEX32_PATTERN})-({HEX32_PATTERN})\Z") for prefix in ("spc", "con", "op", "mem"))
ID_REGEX = {"par": PARTICIPANT_ID, "spc": SPACE_ID, "con": CONVERSATION_ID, "op": OPERATION_ID, "mem": MEMORY_ID}
assert all(regex.pattern.replace("(", "").replace(")", "") == ID_PATTERNS[prefix] + r"\Z"
           for prefix, regex in ID_REGEX.items())


def shape(prefix: str) -> str:
    """How an ID of this prefix is written, for error messages."""
    return f"{prefix}-{{32 hex}}" if prefix == "par" else f"{prefix}-{{lineage}}-{{32 hex}}"


def participant_id(raw: bytes) -> str:
    return "par-" + raw.hex()


def space_id(lineage: bytes, raw: bytes) -> str:
    return f"spc-{lineage.hex()}-{raw.hex()}"


def conversation_id(lineage: bytes, raw: bytes) -> str:
    return f"con-{lineage.hex()}-{raw.hex()}"


def operation_id(lineage: bytes, raw: bytes) -> str:
    return f"op-{lineage.hex()}-{raw.hex()}"


def split_id(match: re.Match[str]) -> tuple[bytes, bytes]:
    """(lineage, id) bytes of a matched two-part ID."""
    return bytes.fromhex(match.group(1)), bytes.fromhex(match.group(2))
