"""Images for a model with a vision tower: ImageEncoder runs the tower (strata/model/vision.py) on the engine's device,
one compiled function per image grid, and keeps each image's text embeddings by its content hash, so an image sent
again (a conversation's next turn) is not encoded again. prompt_rows() lays a prompt's images out for its parts: the
(t, h, w) rotary positions of every token, the tower's rows at the image tokens, and the rotary position that the
token after the prompt takes.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from functools import partial

import numpy as np

from strata.errors import StrataError
from strata.plan import PromptRows
from strata.model.vision import VisionConfig, grid_inputs, mrope_positions, tower


@dataclass(frozen=True)
class Image:
    """One image of a prompt, preprocessed: patches [N, C*T*P*P] float32 in merge-block order and its grid (t, h, w
    in patches); key: its content hash (strata/vision/image.py image_hash), None to encode it every time."""
    patches: np.ndarray
    grid: tuple[int, int, int]
    key: str | None = None


class ImageEncoder:
    def __init__(self, ops, vc: VisionConfig, params: dict, keep: int = 64):
        self.ops, self.vc, self.params, self.keep = ops, vc, params, keep
        self._compiled: dict = {}
        self._cache: OrderedDict[str, np.ndarray] = OrderedDict()
        self.encoded = 0               # images run through the tower (the rest came from the cache)
        self._lock = threading.Lock()  # the server encodes in worker threads, the scheduler at admission

    def encode(self, image: Image) -> np.ndarray:
        """The image's text embeddings [tokens, out_hidden_size] on the host."""
        with self._lock:
            return self._encode(image)

    def _encode(self, image: Image) -> np.ndarray:
        if image.key is not None and image.key in self._cache:
            self._cache.move_to_end(image.key)
            return self._cache[image.key]
        t, h, w = image.grid
        n = t * h * w
        if image.patches.shape != (n, self.vc.patch_features):
            raise StrataError(f"an image of grid {image.grid} needs patches [{n}, {self.vc.patch_features}], "
                              f"found {list(image.patches.shape)}")
        f = self._compiled.get(image.grid)
        if f is None:
            f = self._compiled[image.grid] = self.ops.compile(
                partial(tower, self.ops, self.vc, frame=h * w))
        inputs = grid_inputs(self.vc, image.grid)
        rows = np.asarray(self.ops.to_host(f(self.params, self.ops.to_device(image.patches),
                                             self.ops.to_device(inputs))))
        self.encoded += 1
        if image.key is not None:
            self._cache[image.key] = rows
            while len(self._cache) > self.keep:
                self._cache.popitem(last=False)
        return rows

    def prompt_rows(self, ids: np.ndarray, images: list[Image], first: int, hidden: int) -> PromptRows:
        """A prompt's tokens ids (image tokens included) whose images these are, its first token at rotary
        position `first`."""
        try:
            pos, following = mrope_positions(self.vc, ids, [im.grid for im in images], first)
        except ValueError as e:
            raise StrataError(str(e)) from None
        is_image = np.asarray(ids) == self.vc.image_token_id
        rows = None
        if images:
            rows = np.zeros((len(ids), hidden), np.float32)
            rows[is_image] = np.concatenate([self.encode(im) for im in images])
        return PromptRows(pos.T.astype(np.int32), rows, is_image, following)


NO_IMAGES = "this model takes no images: it has no vision tower, or the vision setting is off"


def prompt_rows(enc: ImageEncoder | None, ids, images, first: int, pos: int, hidden: int) -> PromptRows | None:
    """The PromptRows of prompt tokens ids at cache position pos whose first token takes rotary position `first`,
    its images encoded; None for plain text at its cache positions (no images, no image tokens, first == pos)."""
    if images and enc is None:
        raise StrataError(NO_IMAGES)
    ids = np.asarray(ids)
    if enc is None or (not images and first == pos and not (ids == enc.vc.image_token_id).any()):
        return None
    return enc.prompt_rows(ids, list(images), first, hidden)


def text_rows(n: int, first: int) -> PromptRows:
    """A prompt part of plain text whose first token sits at rotary position `first`."""
    return PromptRows(np.repeat(np.arange(first, first + n, dtype=np.int32)[:, None], 3, axis=1), None,
                      np.zeros(n, bool), first + n)

