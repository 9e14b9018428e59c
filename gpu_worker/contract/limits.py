"""Limits both processes enforce: the gateway refuses early, the device is the authority."""

INPUT_BYTES = 2048             # SPEC: text and device-added media links fit 2048 UTF-8 bytes
MEDIA_LINK_BYTES = 73          # "\n" + "media://" + 64 hex digits
MAX_MEDIA = 8                  # media rows per input
MAX_MEDIA_BYTES = 8 << 20      # one media source
DEFAULT_LIMIT = 50             # list reads
MAX_LIMIT = 200
MAX_BODY_BYTES = 65536         # a shared-route JSON body
MAX_CHAT_BODY_BYTES = 1 << 20  # a /v1/chat/completions body
