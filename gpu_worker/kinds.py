"""Operation kinds: recorded in admissions and receipts (values are part of the journal format)."""
from enum import IntEnum


class Kind(IntEnum):
    PARTICIPANT_REGISTER = 1
    SPACE_CREATE = 2
    MEMBER_SET = 3
    CONVERSATION_CREATE = 4
    RETIREMENT = 5
    INPUT = 6
    CANCELLATION = 7


KIND_NAMES = {Kind.PARTICIPANT_REGISTER: "participant.register", Kind.SPACE_CREATE: "space.create",
              Kind.MEMBER_SET: "member.set", Kind.CONVERSATION_CREATE: "conversation.create",
              Kind.RETIREMENT: "retirement", Kind.INPUT: "conversation.input",
              Kind.CANCELLATION: "cancellation"}
