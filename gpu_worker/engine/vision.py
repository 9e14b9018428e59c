"""Images as model inputs: the vision tower of an Idefics3 (SmolVLM) runtime and the image rules of
its processor (docs/engine.md, "Images").

An image goes bytes -> `decode_image` (Pillow, with the pixel limit that refuses decompression
bombs) -> `preprocess` (the model's processor rules: resize the longest edge, resize to whole tiles,
split into tiles plus one global view, rescale, normalise; transformers' Idefics3 image processor to
the bit, tests/engine/test_vision.py) -> `VisionTower.encode` (SigLIP encoder, pixel shuffle and the
connector's projection) -> features `[tokens, text hidden size]`, one row for each `<image>` token of
`image_prompt(rows, cols)`, which stands in the prompt where the image is. The engine splices those
rows at the image tokens' positions in its paged prefill (model.Llama, `embeds`): image tokens are
prompt tokens, so they take KV pages and count in page limits like text.

All of this runs on the device's helper threads, never the tick thread: it only reads the tower's
weights, so several images may be encoded at once. Audio would slot in the same way: an encoder
whose features replace its own placeholder tokens; none is packed yet, so a model's card lists
`media_types: ["image"]` at most and audio inputs are refused at admission (`model_lacks_media`).
"""

from __future__ import annotations

import hashlib
import io
import math
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from PIL import Image as PILImage

    from gpu_worker.storage.runtime_file import RuntimeFile

# transformers' Idefics3 processor never resizes beyond this (MAX_IMAGE_SIZE there)
MAX_IMAGE_SIDE = 4096
# Decoded images larger than this many pixels are refused (Pillow's own bomb limit is 89 478 485,
# beyond which it only warns, and twice that, beyond which it raises): 4096 x 4096, the largest side
# the processor keeps, squared.
MAX_IMAGE_PIXELS = MAX_IMAGE_SIDE * MAX_IMAGE_SIDE
FAKE_TOKEN, IMAGE_TOKEN, GLOBAL_TOKEN = "<fake_token_around_image>", "<image>", "<global-img>"


class MediaError(ValueError):
    """An input's media cannot become model input: `status` and `code` are the API's answer."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status, self.code = status, code


@dataclass(frozen=True)
class ImageRules:
    """The processor's rules (preprocessor_config.json and processor_config.json of the checkpoint)."""
    longest_edge: int          # size.longest_edge: the image's longest edge after the first resize
    tile: int                  # max_image_size.longest_edge: the side of a tile and of the global view
    image_splitting: bool
    resample: int              # PIL's resampling filter number (1: LANCZOS)
    rescale_factor: float
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    image_seq_len: int         # <image> tokens per tile

    @classmethod
    def from_card(cls, card: dict[str, Any]) -> "ImageRules":
        rules = card["image_rules"]
        return cls(rules["longest_edge"], rules["tile"], rules["image_splitting"], rules["resample"],
                   rules["rescale_factor"], tuple(rules["image_mean"]), tuple(rules["image_std"]),
                   card["image_seq_len"])


def decode_image(data: bytes, max_pixels: int = MAX_IMAGE_PIXELS) -> PILImage.Image:
    """The RGB image of `data`, fully decoded; MediaError (415 `media_not_image`, 400
    `media_truncated`, 413 `media_too_many_pixels`) for bytes that are not one."""
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image: Image.Image = Image.open(io.BytesIO(data))
            width, height = image.size
            if width * height > max_pixels:  # checked from the header, before decoding a pixel
                raise MediaError(413, "media_too_many_pixels",
                                 f"the image is {width}x{height} pixels; the limit is {max_pixels} pixels")
            image.load()
    except MediaError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise MediaError(413, "media_too_many_pixels", f"the image is a decompression bomb: {exc}") from None
    except UnidentifiedImageError:
        raise MediaError(415, "media_not_image", "the bytes are not an image Pillow can read") from None
    except (OSError, SyntaxError, ValueError, EOFError) as exc:  # Pillow's truncated or corrupt data
        raise MediaError(400, "media_truncated", f"the image data is truncated or corrupt: {exc}") from None
    if image.mode != "RGB":
        # transformers' convert_to_rgb: transparent pixels become white first
        if image.mode in ("RGBA", "LA", "P", "PA") or "transparency" in image.info:
            rgba = image.convert("RGBA")
            background = Image.new("RGBA", rgba.size, (255, 255, 255))
            image = Image.alpha_composite(background, rgba).convert("RGB")
        else:
            image = image.convert("RGB")
    return image


def _rescale_to_max_len(height: int, width: int, max_len: int) -> tuple[int, int]:
    aspect = width / height
    if width >= height:
        width = max_len
        height = int(width / aspect)
        height += height % 2
    else:
        height = max_len
        width = int(height * aspect)
        width += width % 2
    return max(height, 1), max(width, 1)


def _scale_below(height: int, width: int, max_len: int) -> tuple[int, int]:
    aspect = width / height
    if width >= height and width > max_len:
        width = max_len
        height = int(width / aspect)
    elif height > width and height > max_len:
        height = max_len
        width = int(height * aspect)
    return max(height, 1), max(width, 1)


def _to_tiles(height: int, width: int, tile: int) -> tuple[int, int]:
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height, width


def preprocess(image: PILImage.Image, rules: ImageRules) -> tuple[np.ndarray, int, int]:
    """Pixel values `[tiles, 3, tile, tile]` float32, rows and cols of the split (0, 0 when the image is
    one tile): transformers' Idefics3 image processor (its Pillow backend) step for step."""
    def resized(img: PILImage.Image, height: int, width: int) -> PILImage.Image:
        return img if img.size == (width, height) else img.resize((width, height), resample=rules.resample)

    height, width = image.height, image.width
    height, width = _scale_below(*_rescale_to_max_len(height, width, rules.longest_edge), MAX_IMAGE_SIDE)
    image = resized(image, height, width)
    tiles: list[PILImage.Image] = []
    rows = cols = 0
    if rules.image_splitting:
        image = resized(image, *_to_tiles(image.height, image.width, rules.tile))
        if image.height > rules.tile or image.width > rules.tile:
            rows = (image.height - rules.tile) // rules.tile + 1
            cols = (image.width - rules.tile) // rules.tile + 1
            tiles = [image.crop((c * rules.tile, r * rules.tile, (c + 1) * rules.tile, (r + 1) * rules.tile))
                     for r in range(rows) for c in range(cols)]
    tiles.append(resized(image, rules.tile, rules.tile))
    pixels = np.stack([np.asarray(t, dtype=np.uint8) for t in tiles])  # [tiles, H, W, 3]
    values = (pixels.astype(np.float64) * rules.rescale_factor).astype(np.float32)
    mean, std = np.asarray(rules.image_mean, np.float32), np.asarray(rules.image_std, np.float32)
    values = (values - mean) / std
    return np.ascontiguousarray(values.transpose(0, 3, 1, 2)), rows, cols


def image_prompt(rows: int, cols: int, image_seq_len: int) -> str:
    """The text that stands for one image in the prompt (transformers' Idefics3Processor)."""
    images = IMAGE_TOKEN * image_seq_len
    if rows == 0 and cols == 0:
        return f"{FAKE_TOKEN}{GLOBAL_TOKEN}{images}{FAKE_TOKEN}"
    text = ""
    for r in range(rows):
        for c in range(cols):
            text += f"{FAKE_TOKEN}<row_{r + 1}_col_{c + 1}>{images}"
        text += "\n"
    return text + f"\n{FAKE_TOKEN}{GLOBAL_TOKEN}{images}{FAKE_TOKEN}"


@dataclass(frozen=True)
class PreparedImage:
    """One image ready for a prompt: the text standing for it and the features of its <image> tokens."""
    prompt: str
    features: torch.Tensor  # [tokens, text hidden size], in the engine's compute dtype
    tiles: int
    digest: str  # sha256 of the image's bytes: the prefix cache shares pages only between equal images


class VisionTower:
    """The SigLIP encoder and the connector of an Idefics3 model, over the runtime file's
    `vision/tensor/*` (names as in transformers' `model.vision_model.*`, the connector's projection
    as `connector.proj`)."""

    def __init__(self, card: dict[str, Any], tensors: dict[str, torch.Tensor], device: str | torch.device,
                 dtype: torch.dtype):
        self.card, self.device, self.dtype = card, torch.device(device), dtype
        self.rules = ImageRules.from_card(card)
        self.t = {name: tensor.to(device=self.device, dtype=dtype, copy=True) for name, tensor in tensors.items()}
        for i in range(card["num_layers"]):  # one product for queries, keys and values
            p = f"encoder.layers.{i}."
            for kind in ("weight", "bias"):
                self.t[f"{p}qkv.{kind}"] = torch.cat([self.t.pop(f"{p}self_attn.{n}_proj.{kind}") for n in "qkv"])
        side = card["image_size"] // card["patch_size"]
        self.patches_per_side = side

    @classmethod
    def from_runtime(cls, runtime: RuntimeFile, device: str | torch.device = "cpu",
                     dtype: torch.dtype = torch.float32) -> "VisionTower | None":
        if not runtime.has("vision/card"):
            return None
        prefix = "vision/tensor/"
        tensors = {name[len(prefix):]: runtime.tensor(name) for name in runtime.names(prefix)}
        return cls(runtime.json("vision/card"), tensors, device, dtype)

    def _positions(self, rows: int, cols: int) -> torch.Tensor:
        """Position ids of a tile of rows x cols patches (Idefics3VisionEmbeddings' bucketing)."""
        n = self.patches_per_side
        boundaries = torch.arange(1 / n, 1.0, 1 / n, device=self.device)
        fh = torch.clamp(torch.arange(rows, device=self.device, dtype=torch.float32) * (1.0 / rows), max=1.0 - 1e-6)
        fw = torch.clamp(torch.arange(cols, device=self.device, dtype=torch.float32) * (1.0 / cols), max=1.0 - 1e-6)
        bh = torch.bucketize(fh, boundaries, right=True)
        bw = torch.bucketize(fw, boundaries, right=True)
        return (bh[:, None] * n + bw[None, :]).reshape(-1)

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """`[tiles, 3, H, W]` -> features `[tiles * image_seq_len, text hidden]`."""
        c, t = self.card, self.t
        x = pixel_values.to(self.device, self.dtype)
        patch = c["patch_size"]
        x = F.conv2d(x, t["embeddings.patch_embedding.weight"], t["embeddings.patch_embedding.bias"], stride=patch)
        tiles, dim, rows, cols = x.shape
        x = x.flatten(2).transpose(1, 2)
        x = x + F.embedding(self._positions(rows, cols), t["embeddings.position_embedding.weight"])
        heads = c["num_heads"]
        eps = c["layer_norm_eps"]
        for i in range(c["num_layers"]):
            p = f"encoder.layers.{i}."
            h = F.layer_norm(x, (dim,), t[p + "layer_norm1.weight"], t[p + "layer_norm1.bias"], eps)
            qkv = F.linear(h, t[p + "qkv.weight"], t[p + "qkv.bias"])
            q, k, v = qkv.view(tiles, -1, 3, heads, dim // heads).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(tiles, -1, dim)
            x = x + F.linear(a, t[p + "self_attn.out_proj.weight"], t[p + "self_attn.out_proj.bias"])
            h = F.layer_norm(x, (dim,), t[p + "layer_norm2.weight"], t[p + "layer_norm2.bias"], eps)
            h = F.gelu(F.linear(h, t[p + "mlp.fc1.weight"], t[p + "mlp.fc1.bias"]), approximate="tanh")
            x = x + F.linear(h, t[p + "mlp.fc2.weight"], t[p + "mlp.fc2.bias"])
        x = F.layer_norm(x, (dim,), t["post_layernorm.weight"], t["post_layernorm.bias"], eps)
        # pixel shuffle (Idefics3Connector), then the projection into the text model's embeddings
        s = c["scale_factor"]
        x = x.reshape(tiles, rows, cols // s, dim * s).permute(0, 2, 1, 3)
        x = x.reshape(tiles, cols // s, rows // s, dim * s * s).permute(0, 2, 1, 3)
        x = x.reshape(tiles, rows * cols // (s * s), dim * s * s)
        return F.linear(x, t["connector.proj"]).reshape(-1, t["connector.proj"].shape[0])

    def prepare(self, data: bytes) -> PreparedImage:
        """Bytes of an image -> its prompt text and features (MediaError for bytes that are no image)."""
        pixels, rows, cols = preprocess(decode_image(data), self.rules)
        features = self.encode(torch.from_numpy(pixels))
        return PreparedImage(image_prompt(rows, cols, self.rules.image_seq_len), features, pixels.shape[0],
                             hashlib.sha256(data).hexdigest())
