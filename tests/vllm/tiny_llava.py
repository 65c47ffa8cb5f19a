"""The tests' tiny LLaVA model: built by ``tensorwire.bench.vllm_engine.tiny_llava`` (the package's builder, which
the engine benchmark uses too), re-exported here for the tests that import ``tiny_llava``.

    python tiny_llava.py OUT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

from tensorwire.bench.vllm_engine.tiny_llava import IMAGE_TOKEN_ID, build, image_tokens

IMAGE_SIZE = 56
IMAGE_TOKENS = image_tokens(IMAGE_SIZE)

__all__ = ["IMAGE_SIZE", "IMAGE_TOKENS", "IMAGE_TOKEN_ID", "build"]

if __name__ == "__main__":
    print(build(Path(sys.argv[1])))
