"""Ordinary Chat Completions at the device: temporary requests on the same KV pool as
conversation inputs, with no receipt and nothing journaled (SPEC: "Ordinary Chat Completions
keeps its separate, temporary request contract").

`chat.completions` answers later than its tick: token bytes stream back as frames with
`"more": true` (when asked to stream; raw bytes, so a character may be split between frames and
the gateway decodes them incrementally) and the last frame carries the finish reason and token
counts. A closed gateway connection cancels its chats and frees their pages.
"""
import itertools

from .engine.block_manager import pages_for
from .protocol import DeviceError, dumps, reply

ROLES = ("system", "user", "assistant")
FINISH = {"stop": "stop", "length": "length", "cancelled": "stop"}


class ChatCommands:
    def init_chat(self):
        self.chats = {}          # request id -> state of one chat request
        self.outbox = []         # (conn, reply) produced outside a tick, sent by the server
        self._chat_ids = itertools.count(1)

    def start_chat(self, conn, msg):
        """Returns an immediate error reply, or None when the answer will come from the engine."""
        try:
            self._principal(msg, "chat")
            if self.runner is None:
                raise DeviceError(503, "engine_unavailable", "this device runs no generation engine")
            args = self._args(msg)
            messages = args.get("messages")
            if (not isinstance(messages, list) or not messages
                    or any(not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str)
                           for m in messages)):
                raise DeviceError(400, "invalid_messages", "messages must be a non-empty list of {role, content}")
            self._model_index(args.get("model"))
            profile = self.runtime.runtime_profile
            tokenizer = self.runner.engine.tokenizer
            prompt = tokenizer.encode_chat(messages)
            capacity = profile["page_grant"] * profile["page_size"]
            max_tokens = args.get("max_tokens")
            if max_tokens is None:
                max_tokens = min(profile["max_output_tokens"], capacity - len(prompt) + 1)
            if not isinstance(max_tokens, int) or max_tokens < 1:
                raise DeviceError(400, "invalid_max_tokens", "max_tokens must be a positive integer")
            if len(prompt) + max_tokens - 1 > capacity:
                raise DeviceError(400, "context_length_exceeded",
                                  f"{len(prompt)} prompt tokens and max_tokens {max_tokens} exceed the page grant of "
                                  f"{capacity} tokens")
            stop = args.get("stop") or []
            request_id = ("chat", next(self._chat_ids))
            self.chats[request_id] = {"conn": conn, "id": msg.get("id"), "stream": bool(args.get("stream")),
                                      "text": bytearray(), "tokens": 0, "prompt_tokens": len(prompt)}
            self.runner.submit(request_id, prompt, max_new_tokens=max_tokens,
                               temperature=float(args.get("temperature", 1.0)), top_p=float(args.get("top_p", 1.0)),
                               stop=tuple(stop), page_limit=pages_for(len(prompt) + max_tokens - 1,
                                                                      profile["page_size"]))
            return None
        except DeviceError as err:
            return reply(msg.get("id"), err.status, err.body())

    def chat_event(self, request_id, token, data, finish):
        chat = self.chats.get(request_id)
        if chat is None:
            return
        if token is not None:
            chat["tokens"] += 1
        if data:
            if chat["stream"]:
                self.outbox.append((chat["conn"], {"id": chat["id"], "status": 200, "more": True, "body": data}))
            else:
                chat["text"] += data
        if finish is None:
            return
        del self.chats[request_id]
        if finish.startswith("failed"):
            error = DeviceError(500, "generation_failed", f"generation failed ({finish})")
            self.outbox.append((chat["conn"], reply(chat["id"], error.status, error.body())))
            return
        body = {"finish_reason": FINISH.get(finish, "stop"), "prompt_tokens": chat["prompt_tokens"],
                "completion_tokens": chat["tokens"], "text": bytes(chat["text"]).decode("utf-8", "replace")}
        self.outbox.append((chat["conn"], reply(chat["id"], 200, dumps(body))))

    def connection_closed(self, conn):
        """The gateway went away (its client disconnected): its chats stop and free their pages."""
        for request_id, chat in list(self.chats.items()):
            if chat["conn"] is conn:
                del self.chats[request_id]
                if self.runner is not None:
                    self.runner.cancel(request_id)

    def list_models(self, msg):
        self._principal(msg, "chat")
        card = self.runtime.json("gen/card")
        return 200, {"models": [{"name": card["name"], "digest": self.model_digest}]}
