"""The encoder interface the service runs: image bytes in, per-image embeddings with 2-D positions out."""

from __future__ import annotations

import abc
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tensorwire.encoder._config import PreprocessConfig
from tensorwire.encoder._preprocess import check_request
from tensorwire.errors import ClosedError


@dataclass(frozen=True)
class ImageEmbedding:
    """What one image encodes to.

    ``embedding``: [n_tokens, hidden] on the encoder's device, contiguous.
    ``position_ids``: int64 [n_tokens, 2], the (row, col) of each token on ``grid``, row-major, same device.
    """

    embedding: torch.Tensor
    position_ids: torch.Tensor
    grid: tuple[int, int]
    original_size: tuple[int, int]


class VisionEncoder(abc.ABC):
    """A vision tower plus its preprocessing.

    Contract:
    - ``encode(images)`` takes the raw bytes of each image (JPEG, PNG, ...) and returns one ``ImageEmbedding``
      per image, in order. The returned tensors are new (never views of a reused buffer); the caller owns them.
      When ``encode`` returns, the device work that produced them has finished (CUDA is synchronized), so an
      exporter may read them at once.
    - Bad input (empty request, too many images, undecodable or oversized image) raises ``InvalidPayload``
      before any forward pass; nothing else about the encoder changes, it keeps serving.
    - Thread-safety: ``encode`` may be called from many threads; forward passes run one at a time (a lock),
      which is the fastest order on one device anyway.
    - ``close()`` is idempotent; ``encode`` after it raises ``ClosedError``.
    """

    def __init__(self, *, name: str, device: str, preprocess: PreprocessConfig) -> None:
        self.name = name
        self.device = torch.device(device)
        self.preprocess = preprocess
        self._lock = threading.Lock()
        self._closed = False

    @property
    @abc.abstractmethod
    def hidden_size(self) -> int:
        """Width of each output token."""

    @property
    @abc.abstractmethod
    def dtype(self) -> torch.dtype:
        """Dtype of the embeddings."""

    @abc.abstractmethod
    def _encode(self, images: Sequence[bytes]) -> list[ImageEmbedding]:
        """Subclass hook: preprocessing and forward; called under the lock after the request checks."""

    def encode(self, images: Sequence[bytes]) -> list[ImageEmbedding]:
        if self._closed:
            raise ClosedError(f"encoder {self.name!r} is closed")
        check_request(list(images), self.preprocess)
        with self._lock, torch.inference_mode():
            out = self._encode(images)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        return out

    def close(self) -> None:
        self._closed = True

    def __enter__(self) -> VisionEncoder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def describe(self) -> str:
        dtype = str(self.dtype).replace("torch.", "")
        return f"{self.name} on {self.device} (hidden={self.hidden_size}, dtype={dtype})"
