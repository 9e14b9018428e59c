"""Images of an input as model input (docs/engine.md "Images", README "Images"): the admission's
precise check of each image's bytes and its page charge, and the execution's preparation of the
current input's images on helper threads.

Admission (on the tick thread, `check`, from kinds/inputs.check) reads no more than an image's header
and tail, never decodes a pixel: Pillow identifies the bytes (else 415 `media_not_image`) and gives
the size from the header (more than vision.MAX_IMAGE_PIXELS: 413 `media_too_many_pixels`); the
format's end marker must be in the file's tail (PNG's IEND chunk, JPEG's EOI marker, GIF's trailer,
the RIFF length of a WebP; else 400 `media_truncated`). Each image is charged the card's
`image_token_budget` (the most prompt tokens one image takes) against the input's page limit, beside
its output limit: an input whose images do not fit is refused 409 `images_exceed_page_limit`.
Audio rows stay refused 409 `model_lacks_media` until a model declares audio (kinds/inputs.check).

Execution (`start`, once the input's memory is recalled and its turns gathered): on a helper thread, the bytes of each image row of
the current input are read and checked against their digest, decoded, preprocessed and encoded
(`VisionTower.prepare`), and the prompt is fitted with image parts in the input's message; then, on
the tick thread, the engine gets the prompt with `images=`. An image whose full decoding fails
despite the admission's checks (damage inside the data) fails the input. Media of earlier turns and
of recalled memory stay text links (`media://<sha256>`) and never attach again.
"""
from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING, Any, BinaryIO, Callable

from ..contract.errors import ServiceError
from ..engine.vision import MAX_IMAGE_PIXELS, MediaError, PreparedImage
from ..kinds.media import media_dir, read_source
from .prompt import fit_prompt
from ..kinds.kind import Executing, Running, Sourcing

if TYPE_CHECKING:
    from ..engine.tokenizer import Tokenizer


TAIL_BYTES = 4096  # how much of a file's end the truncation check reads


def check_header(path: str, sha: str, max_pixels: int = MAX_IMAGE_PIXELS) -> None:
    """The image's header and tail, without decoding (ServiceError with vision.py's codes)."""
    with open(path, "rb") as f:
        check_file(f, f"media source {sha}", max_pixels, sha256=sha)


def check_file(f: BinaryIO, name: str, max_pixels: int = MAX_IMAGE_PIXELS, **details: Any) -> None:
    """`check_header` of an open binary file (an uploaded source, or a chat's image bytes in memory,
    kinds/chat.py): `name` begins each refusal's message, `details` go in its body."""
    from PIL import Image, UnidentifiedImageError

    def refused(status: int, code: str, message: str) -> ServiceError:
        return ServiceError(status, code, f"{name}: {message}", **details)

    head = f.read(64)
    try:
        f.seek(0)
        with Image.open(f) as image:  # lazy: reads the header only
            width, height = image.size
            fmt = image.format
    except UnidentifiedImageError:
        raise refused(415, "media_not_image", "the bytes are not an image Pillow can read") from None
    except Image.DecompressionBombError as exc:
        raise refused(413, "media_too_many_pixels", f"the image is a decompression bomb: {exc}") from None
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise refused(400, "media_truncated", f"the image header is truncated or corrupt: {exc}") from None
    if width * height > max_pixels:
        raise refused(413, "media_too_many_pixels",
                      f"the image is {width}x{height} pixels; the limit is {max_pixels} pixels")
    size = f.seek(0, os.SEEK_END)
    f.seek(max(0, size - TAIL_BYTES))
    tail = f.read()
    whole = {
        "PNG": lambda: b"IEND" in tail,
        "JPEG": lambda: b"\xff\xd9" in tail,
        "MPO": lambda: b"\xff\xd9" in tail,
        "GIF": lambda: tail.endswith(b";") or b"\x00;" in tail,
        "WEBP": lambda: int.from_bytes(head[4:8], "little") + 8 <= size,
    }.get(fmt or "")
    if whole is not None and not whole():
        raise refused(400, "media_truncated", f"the {fmt} data ends before the image does")


def check(d: Sourcing, card: dict[str, Any], media: list[dict[str, Any]], pages: int, max_output: int) -> None:
    """kinds/inputs.check, for a model that takes images: each image row's bytes checked (header and
    tail), and the images' token budget charged against the page limit beside the output limit."""
    images = [row["sha256"] for row in media if row["type"] == "image"]
    if not images or "image" not in card["capabilities"]["media_types"]:
        return
    for sha in images:
        check_header(os.path.join(media_dir(d), sha), sha)
    budget = int(card["capabilities"]["image_token_budget"]) * len(images)
    room = pages * int(d.runtime.runtime_profile["page_size"])
    if budget + max_output > room:
        raise ServiceError(409, "images_exceed_page_limit",
                           f"{len(images)} image(s) take up to {budget} tokens; with {max_output} output tokens "
                           f"that exceeds the {room} tokens of {pages} pages")


def image_rows(d: Executing, body: dict[str, Any]) -> list[str]:
    """The digests of the input's image rows that become model input (a model with a vision tower)."""
    runner = d.runner
    if runner is None or getattr(runner.engine, "vision", None) is None:
        return []
    return [m["sha256"] for m in body.get("media", []) if m.get("type") == "image"]


class _WithImages:
    """A tokenizer whose `encode_chat` puts the prepared images' text at the image parts."""

    def __init__(self, tokenizer: Tokenizer, prompts: list[str]):
        self.tokenizer, self.prompts = tokenizer, prompts

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        return self.tokenizer.encode_chat(messages, images=self.prompts)


def with_image_parts(messages: list[dict[str, Any]], text: str, count: int) -> list[dict[str, Any]]:
    """The messages with the last (the input's) content as `count` image parts then its text."""
    parts: list[dict[str, Any]] = [{"type": "image"} for _ in range(count)]
    return messages[:-1] + [{"role": "user", "content": parts + [{"type": "text", "text": text}]}]


def prepare_prompt(d: Running, shas: list[str], text: str, messages: list[dict[str, Any]], room: int,
                   system: str | None) -> tuple[list[int] | None, list[PreparedImage]]:
    """On a helper thread: the images read, checked and encoded, then the prompt fitted."""

    assert d.runner is not None
    engine = d.runner.engine
    assert engine.vision is not None  # admission refused images for a model without a vision tower
    prepared = []
    for sha in shas:
        data = read_source(d, sha)
        if data is None:
            raise MediaError(409, "media_unavailable", f"the bytes of media source {sha} are gone")
        prepared.append(engine.vision.prepare(data))
    tokenizer = _WithImages(engine.tokenizer, [image.prompt for image in prepared])
    ids = fit_prompt(tokenizer, with_image_parts(messages, text, len(prepared)), room, system)
    return ids, prepared


def start(d: Running, rrow: int, body: dict[str, Any], messages: list[dict[str, Any]], room: int,
          system: str | None, settings: dict[str, Any],
          wrap: Callable[[Callable[[], Prepared]], Callable[[], Prepared]] = lambda work: work) -> bool:
    """Once the input's memory is recalled (gpu_worker/execution.py): when the input's images
    become model input, its prompt is built with them on a helper thread (True); else nothing
    happens here (False). `wrap`: what else that helper thread does first (its grammar)."""
    shas = image_rows(d, body)
    if not shas:
        return False
    d.off_thread(wrap(functools.partial(prepare_prompt, d, shas, str(body["text"]), messages, room, system)),
                 functools.partial(_prepared, d, rrow, settings))
    return True


Prepared = tuple["list[int] | None", "list[PreparedImage]"]


def _prepared(d: Executing, rrow: int, settings: dict[str, Any],
              result: Prepared | None, error: BaseException | None) -> None:
    """On the tick thread (execution._prompted with the images): the engine gets the input."""
    execution = d.executions.live.get(rrow)
    ids, prepared = result if result is not None else (None, [])
    # its settings without the images: an interpretation never attaches them again
    if execution is None or d.runner is None or not execution.prompted(ids, error, settings):
        return
    assert ids is not None
    d.runner.submit(("input", rrow), ids, images=prepared, **settings)

