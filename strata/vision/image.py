"""Image input for Qwen3-VL-style vision towers (qwen3_5_moe, qwen4_exp): data URL -> RGB -> pixel patches.

Contract: decode_data_url + preprocess give the same pixel_values (bit for bit) and image_grid_thw as transformers'
Qwen2VLImageProcessorPil, the PIL backend of the processor these models ship, given the PIL image of the same bytes:
transparency is composited onto white, the resize is PIL bicubic in uint8 to smart_resize's size, then x / 255 in
float64, float32 (x - mean) / std, and the patch layout (merge blocks, channel, temporal copy, row, column).
Unlike that processor, decoding applies the EXIF orientation first, as transformers' load_image does for a URL.
A bad image raises ImageError (a ValueError: the request's fault); a bad preprocessor_config.json, ModelLoadError.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import io
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from strata.errors import ModelLoadError

MEDIA_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG", "image/webp": "WEBP"}
MAX_ASPECT = 200                 # transformers' smart_resize refuses a longer side over 200 times the shorter
BICUBIC = 3                      # PIL's resample code for bicubic, the processor's `resample`


class ImageError(ValueError):
    """An image in a request that cannot be used: the message says what was wrong and what is allowed."""


@dataclass(frozen=True)
class ImageSettings:
    """The image processor's settings. The defaults are the values Qwen3-VL and Qwen3.5 ship."""
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 65536                   # size.shortest_edge (256 x 256)
    max_pixels: int = 16777216                # size.longest_edge (4096 x 4096)
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    @classmethod
    def from_preprocessor(cls, d: dict[str, Any] | None, source: str) -> ImageSettings:
        """Settings from a preprocessor_config.json dict (None: the file is absent, the defaults). A key it leaves
        out keeps its default; top-level min_pixels / max_pixels (older files) override size, as transformers does."""
        if d is None:
            return cls()
        if not isinstance(d, dict):
            raise ModelLoadError(f"{source}: a preprocessor config must be a JSON object, got {type(d).__name__}")

        def bad(key: str, value: Any, allowed: str) -> ModelLoadError:
            return ModelLoadError(f"{source}: {key} is {value!r}; it must be {allowed}")

        def positive_int(key: str, value: Any) -> int:
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise bad(key, value, "a positive integer")
            return value

        def triple(key: str, value: Any, nonzero: bool) -> tuple[float, float, float]:
            # transformers takes one number for all three channels, or one per channel
            values = [value] * 3 if isinstance(value, (int, float)) and not isinstance(value, bool) else value
            if not isinstance(values, list) or len(values) != 3 or not all(
                    isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values) \
                    or (nonzero and 0 in values):
                raise bad(key, value, "a list of 3 " + ("non-zero " if nonzero else "") + "numbers")
            return tuple(float(v) for v in values)

        default = cls()
        # as transformers' __init__: size (else the default), then top-level min_pixels / max_pixels over it
        size = d.get("size")
        if size is None:
            size = {"shortest_edge": default.min_pixels, "longest_edge": default.max_pixels}
        elif not isinstance(size, dict):
            raise bad("size", size, 'an object {"shortest_edge": min_pixels, "longest_edge": max_pixels}')
        pixels = {}
        for edge, old_key in (("shortest_edge", "min_pixels"), ("longest_edge", "max_pixels")):
            if d.get(old_key) is not None:
                pixels[edge] = positive_int(old_key, d[old_key])
            elif edge in size:
                pixels[edge] = positive_int(f"size.{edge}", size[edge])
            else:
                raise bad("size", size, f'an object with "shortest_edge" and "longest_edge" (it has no "{edge}")')
        min_pixels, max_pixels = pixels["shortest_edge"], pixels["longest_edge"]
        if min_pixels > max_pixels:
            raise ModelLoadError(f"{source}: the minimum pixels (size.shortest_edge or min_pixels, {min_pixels}) "
                                 f"are over the maximum (size.longest_edge or max_pixels, {max_pixels})")

        # settings this module does not implement: refuse them rather than give other pixels (null is the default)
        if d.get("resample") not in (None, BICUBIC):
            raise bad("resample", d["resample"], f"{BICUBIC} (bicubic), the only resize implemented")
        if d.get("rescale_factor") not in (None, 1 / 255):
            raise bad("rescale_factor", d["rescale_factor"], f"{1 / 255!r} (1/255), the only rescale implemented")
        for key in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
            if d.get(key) not in (None, True):
                raise bad(key, d[key], "true, the only setting implemented")

        return cls(
            patch_size=positive_int("patch_size", d.get("patch_size", default.patch_size)),
            temporal_patch_size=positive_int("temporal_patch_size",
                                             d.get("temporal_patch_size", default.temporal_patch_size)),
            merge_size=positive_int("merge_size", d.get("merge_size", default.merge_size)),
            min_pixels=min_pixels, max_pixels=max_pixels,
            image_mean=triple("image_mean", d.get("image_mean", list(default.image_mean)), nonzero=False),
            image_std=triple("image_std", d.get("image_std", list(default.image_std)), nonzero=True),
        )


def decode_data_url(url: str, max_pixels: int) -> np.ndarray:
    """uint8 [H, W, 3] RGB of a base64 data URL holding a PNG, JPEG or WebP of at most max_pixels pixels."""
    if not isinstance(url, str) or url[:5].lower() != "data:":
        shown = url[:40] + "..." if isinstance(url, str) and len(url) > 40 else url
        raise ImageError(f"an image must be a data URL (data:image/png;base64,...), got {shown!r}; "
                         "remote URLs are not fetched")
    header, comma, payload = url[5:].partition(",")
    if not comma:
        raise ImageError("an image data URL needs a comma between its header and its data "
                         "(data:image/png;base64,...)")
    media_type, *params = header.split(";")
    media_type = media_type.strip().lower()
    if media_type not in MEDIA_TYPES:
        raise ImageError(f"image media type {media_type or '(none)'!r} is not supported; "
                         f"allowed: {', '.join(sorted(MEDIA_TYPES))}")
    if "base64" not in (p.strip().lower() for p in params):
        raise ImageError("an image data URL must be base64-encoded (data:image/png;base64,...)")
    try:
        # whitespace is dropped (line-wrapped base64); any other character outside the alphabet is an error
        data = base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"the image data URL's base64 is invalid ({e})") from None
    if not data:
        raise ImageError("the image is empty (zero bytes after the data URL's comma)")

    try:
        # only these decoders: the bytes may be anything, and Pillow would otherwise try every format it knows
        img = Image.open(io.BytesIO(data), formats=sorted(set(MEDIA_TYPES.values())))
    except Image.DecompressionBombError as e:
        raise ImageError(f"the image is too large ({e}); the limit is {max_pixels} pixels") from None
    except UnidentifiedImageError:
        raise ImageError("the image's bytes are not a PNG, JPEG or WebP image") from None
    except (OSError, SyntaxError, ValueError) as e:
        raise ImageError(f"the image's bytes are not a PNG, JPEG or WebP image that can be decoded ({e})") from None
    width, height = img.size
    if width == 0 or height == 0:
        raise ImageError(f"the image has zero size ({width}x{height})")
    # checked from the header, before the pixels are decoded
    if width * height > max_pixels:
        raise ImageError(f"the image is {width}x{height} = {width * height} pixels, over the limit of "
                         f"{max_pixels} pixels")
    try:
        img.load()
        img = ImageOps.exif_transpose(img)
        return _convert_rgb(img)
    except (OSError, SyntaxError, ValueError) as e:
        raise ImageError(f"the image's bytes are not a PNG, JPEG or WebP image that can be decoded ({e})") from None


def _convert_rgb(img: Image.Image) -> np.ndarray:
    """transformers' convert_to_rgb for a PIL image: any transparency (an alpha band, or a palette's or a colour's
    transparency entry) is composited onto white; other modes are PIL's convert("RGB")."""
    if "A" in img.getbands() or img.info.get("transparency") is not None:
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return np.array(Image.alpha_composite(white, rgba).convert("RGB"))
    return np.array(img.convert("RGB"))


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' smart_resize: (height, width) rounded to multiples of factor, scaled into [min, max] pixels
    keeping the aspect ratio. round() is Python's (half to even), as there."""
    if min(height, width) <= 0:
        raise ImageError(f"the image has zero size ({width}x{height})")
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise ImageError(f"the image is {width}x{height}; its longer side may be at most {MAX_ASPECT} times "
                         "its shorter side")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _pixel_table(s: ImageSettings) -> np.ndarray:
    """float32 [3, 256]: each uint8 value's normalized value per channel, by transformers' dtype steps (rescale in
    float64 then cast to float32; normalize in float32): a uint8 image has only these values."""
    scaled = (np.arange(256, dtype=np.float64) * (1 / 255)).astype(np.float32)
    mean = np.array(s.image_mean, dtype=np.float32)[:, None]
    std = np.array(s.image_std, dtype=np.float32)[:, None]
    return (scaled[None, :] - mean) / std


def preprocess(rgb: np.ndarray, s: ImageSettings) -> tuple[np.ndarray, tuple[int, int, int]]:
    """(pixel_values float32 [n_patches, 3 * temporal * patch * patch], (t, h, w) in patches) of one uint8
    [H, W, 3] image, as the processor returns them: patches in merge-block order, the image repeated over time."""
    if not (isinstance(rgb, np.ndarray) and rgb.dtype == np.uint8 and rgb.ndim == 3 and rgb.shape[2] == 3):
        raise ValueError(f"preprocess takes a uint8 [H, W, 3] array, got {getattr(rgb, 'dtype', type(rgb))} "
                         f"{getattr(rgb, 'shape', '')}")
    p, m, t = s.patch_size, s.merge_size, s.temporal_patch_size
    height, width = rgb.shape[:2]
    rh, rw = smart_resize(height, width, p * m, s.min_pixels, s.max_pixels)
    # in uint8 through PIL, as transformers' resize does (PIL rounds and clips to uint8 before the rescale)
    resized = np.asarray(Image.fromarray(rgb).resize((rw, rh), resample=Image.Resampling.BICUBIC))
    gh, gw = rh // p, rw // p
    # [gh/m, mh, ph, gw/m, mw, pw, C] -> [gh/m, gw/m, mh, mw, C, ph, pw]: transformers' patch order
    blocks = resized.reshape(gh // m, m, p, gw // m, m, p, 3).transpose(0, 3, 1, 4, 6, 2, 5)
    blocks = blocks.reshape(gh * gw, 3, p * p)
    values = _pixel_table(s)[np.arange(3)[None, :, None], blocks]          # [n, C, p*p] float32
    out = np.empty((gh * gw, 3, t, p * p), dtype=np.float32)
    out[:] = values[:, :, None, :]
    return out.reshape(gh * gw, 3 * t * p * p), (1, gh, gw)


def image_tokens(grid_thw: tuple[int, int, int], merge_size: int) -> int:
    """Placeholder tokens the image takes in the prompt: one per merge_size x merge_size block of patches."""
    t, h, w = grid_thw
    if h % merge_size or w % merge_size:
        raise ValueError(f"grid {grid_thw} is not whole {merge_size}x{merge_size} blocks")
    return t * h * w // (merge_size * merge_size)


def image_hash(rgb: np.ndarray) -> str:
    """Stable hash of a decoded image's shape, dtype and pixels (not of its encoding): the key, with the settings,
    for caching the vision tower's output."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{rgb.dtype.str}:{'x'.join(map(str, rgb.shape))};".encode())
    h.update(np.ascontiguousarray(rgb).data)
    return h.hexdigest()
