"""Limits both processes enforce: the gateway refuses early, the device is the authority."""

INPUT_BYTES = 2048             # SPEC: text and device-added media links fit 2048 UTF-8 bytes
MEDIA_LINK_BYTES = 73          # "\n" + "media://" + 64 hex digits
MAX_MEDIA = 8                  # media rows per input
MAX_MEDIA_BYTES = 8 << 20      # one media source
DEFAULT_LIMIT = 50             # list reads
MAX_LIMIT = 200
MAX_BODY_BYTES = 65536         # a shared-route JSON body
MAX_CHAT_BODY_BYTES = 1 << 20  # a /v1/chat/completions body
MAX_TOP_LOGPROBS = 20          # OpenAI's bounds: chat top_logprobs (the engine's logprobs), the
MAX_COMPLETION_LOGPROBS = 5    # completions route's legacy logprobs,
MAX_CHOICES = 16               # and our n: each choice of a chat reserves its own KV pages
MAX_SCHEMA_BYTES = 65536       # a response_format schema or a chat's tool definitions, as JSON (413 past it)
MAX_SCHEMA_DEPTH = 32          # nesting of a schema's objects and arrays (400 past it)
MAX_TOOLS = 64                 # function tools of one chat
MEMORY_PAYLOAD_BYTES = INPUT_BYTES  # one memory row's payload: a whole input's text and media links
MAX_MEMORY_TTL_SECONDS = 10 * 366 * 86400  # a memory time to live (a space's or an input's), at most
MAX_REASON_BYTES = 256           # a forgotten memory object's reason, kept in its receipt
MAX_STAFF_NAME = 150             # a console user's name in a staff forget's receipt (Django's username length)
MEMORY_PREVIEW_BYTES = 200       # the payload bytes ops.memory shows of each row
MAX_SEARCH_RESULTS = 50           # rows one memory search answers, at most
RECALL_K = 4                       # memory rows recalled into an input's prompt
RECALL_CONTEXT_BYTES = 1024        # the recalled items' rendered text, at most (docs/memory.md)
RECALL_FLOOR = 0.3                 # a recalled row's cosine similarity to the query, at least (docs/memory.md)
RECALL_MARGIN = 0.1                # ... and at most this far below the best recalled row's
INTERPRETATION_TOKENS = 48         # the model's interpretation of a turn (retention mode 2)
