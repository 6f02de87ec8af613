"""A chat request's images: the `image_url` content parts of its messages (data: URLs only) decoded and preprocessed
as the model's image processor does (strata/vision/image.py), each a 400 naming its part when it cannot be used;
after the chat template has rendered one placeholder token per image, `expand` gives each image its tokens and the
ids the prompt cache matches (an image's tokens stand for its content hash, so equal images share a prefix and
different ones never do).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from strata.engine.images import Image
from strata.model.vision import VisionConfig, image_tokens
from strata.serve import openai_api as oa
from strata.vision.image import ImageError, ImageSettings, decode_data_url, image_hash, preprocess

KEY_SPACE = 1 << 62        # cache ids of image tokens are negative: -1 - (a hash-derived number below this)


def image_parts(messages: list[dict]) -> list[tuple[str, str]]:
    """(param, url) of every image part of the messages, in order."""
    out = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, (list, tuple)):
            for j, part in enumerate(content):
                if isinstance(part, dict) and part.get("type") == "image_url":
                    out.append((f"messages[{i}].content[{j}].image_url.url", part["image_url"]["url"]))
    return out


def settings_for(model_dir: Path | None) -> ImageSettings:
    """The model's image processor settings (preprocessor_config.json beside its tokenizer; absent: Qwen3-VL's)."""
    path = None if model_dir is None else Path(model_dir) / "preprocessor_config.json"
    config = json.loads(path.read_text(encoding="utf-8")) if path is not None and path.is_file() else None
    return ImageSettings.from_preprocessor(config, str(path))


def read_images(parts: list[tuple[str, str]], settings: ImageSettings, max_pixels: int) -> list[Image]:
    """Each part's image preprocessed; an image that cannot be used is a 400 naming its part."""
    images = []
    for param, url in parts:
        try:
            rgb = decode_data_url(url, max_pixels)
            patches, grid = preprocess(rgb, settings)
        except ImageError as e:
            raise oa.bad(param, f"{param}: {e}", code="invalid_image") from None
        images.append(Image(patches, grid, key=image_hash(rgb)))
    return images


def expand(ids: list[int], images: list[Image], vc: VisionConfig) -> tuple[list[int], tuple[int, ...]]:
    """The rendered prompt's ids with each image's one placeholder token made its tokens -> (ids, the ids the
    prompt cache matches)."""
    pad_id = vc.image_token_id
    at = [i for i, t in enumerate(ids) if t == pad_id]
    if len(at) != len(images):
        raise oa.bad("messages", f"the chat template placed {len(at)} image placeholders for {len(images)} images: "
                                 f"this model's template does not render image parts", code="invalid_messages")
    out, keyed, last = [], [], 0
    for i, image in zip(at, images):
        n = image_tokens(vc, image.grid)
        base = int(hashlib.blake2b(image.key.encode(), digest_size=8).hexdigest(), 16) % KEY_SPACE
        out += ids[last:i] + [pad_id] * n
        keyed += ids[last:i] + [-1 - (base + j) % KEY_SPACE for j in range(n)]
        last = i + 1
    out += ids[last:]
    keyed += ids[last:]
    return out, tuple(keyed)
