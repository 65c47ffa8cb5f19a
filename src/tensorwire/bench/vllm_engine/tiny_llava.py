"""Builds a tiny LLaVA-style model (CLIP vision tower + Llama, random weights) offline, for vLLM on CPU.

Nothing is downloaded: the weights come from a seeded random init and are saved as safetensors, the tokenizer is a
word-level ``tokenizers`` model over a fixed vocabulary, the processor config is written by transformers' own
classes. vLLM's CPU paged attention rejects head_dim 16; 64 works. Two heads per attention, so TP=2 can split them.

- :func:`build` with its defaults: the end-to-end tests' model (a 2-layer CLIP tower on 56 px images, 16 image
  tokens, a 2-layer Llama of hidden 128).
- :func:`build_sized`: the engine benchmark's models: 1-layer CLIP, 1-layer Llama of hidden 4096 (an image item
  is ``tokens x 4096`` float32: 64 / 625 / 6400 tokens = 1.05 / 10.2 / 105 MB), sized by the image's side.

    python -m tensorwire.bench.vllm_engine.tiny_llava OUT_DIR [--image-tokens N]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

PATCH_SIZE = 14
WORDS = [f"w{i}" for i in range(200)] + [
    "USER:",
    "ASSISTANT:",
    "describe",
    "the",
    "image",
    "what",
    "is",
    "this",
    "colour",
    "shape",
    "a",
    "an",
    "of",
]
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "<image>"]
IMAGE_TOKEN_ID = SPECIALS.index("<image>")
PROMPT = "USER: <image> describe the image ASSISTANT:"
# The benchmark's hidden size: one image token is 4096 float32 = 16 KiB.
BENCH_TEXT_HIDDEN = 4096


# transformers 5 names LLaVA's modules model.vision_tower / model.language_model / lm_head; the llava-hf
# checkpoints (and vLLM's CLIPVisionModel) keep the CLIP tower's `vision_model.` level. Write that layout.
_PREFIXES = (
    ("model.vision_tower.", "vision_tower.vision_model."),
    ("model.language_model.", "language_model.model."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("lm_head.", "language_model.lm_head."),
)


def _checkpoint_name(name: str) -> str:
    for old, new in _PREFIXES:
        if name.startswith(old):
            return new + name[len(old) :]
    raise ValueError(f"unexpected parameter name {name!r}")


def image_tokens(image_size: int) -> int:
    """LLaVA "default" feature selection drops the CLS token: ``(image_size / 14) ** 2`` embeddings per image."""
    return (image_size // PATCH_SIZE) ** 2


def side_for_tokens(tokens: int) -> int:
    """The image side (pixels) whose item has ``tokens`` embeddings; ``tokens`` must be a square."""
    n = math.isqrt(tokens)
    if n * n != tokens:
        raise ValueError(f"image tokens must be a square number, not {tokens}")
    return n * PATCH_SIZE


def build(
    out: Path,
    seed: int = 1234,
    *,
    image_size: int = 56,
    text_hidden: int = 128,
    vision_layers: int = 2,
    text_layers: int = 2,
    init_std: float = 0.2,
    max_positions: int = 512,
) -> Path:
    """Write the model, tokenizer and processor into ``out`` (created) and return it."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        PreTrainedTokenizerFast,
    )
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    out.mkdir(parents=True, exist_ok=True)
    vocab = {tok: i for i, tok in enumerate(SPECIALS + WORDS)}
    image_token_id = vocab["<image>"]
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=core,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        extra_special_tokens={"image_token": "<image>"},
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})

    # Two heads of 64 everywhere (for any hidden size): tensor parallelism at TP=2 splits every attention by heads.
    vision = CLIPVisionConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=vision_layers,
        num_attention_heads=2,
        image_size=image_size,
        patch_size=PATCH_SIZE,
        projection_dim=128,
    )
    text = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=text_hidden,
        intermediate_size=256,
        num_hidden_layers=text_layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=max_positions,
        bos_token_id=vocab["<s>"],
        eos_token_id=vocab["</s>"],
        pad_token_id=vocab["<pad>"],
        tie_word_embeddings=False,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=image_token_id,
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        projector_hidden_act="gelu",
        image_seq_length=image_tokens(image_size),
    )
    config.torch_dtype = torch.float32  # type: ignore[misc]
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    with torch.no_grad():
        # The default init (std 0.02) gives near-uniform logits; a larger scale makes every logprob depend
        # visibly on the image embeddings, which is what the end-to-end check needs.
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, init_std)
    model.config.architectures = ["LlavaForConditionalGeneration"]
    model.config.save_pretrained(out)
    from safetensors.torch import save_file

    state = {_checkpoint_name(name): t.contiguous() for name, t in model.state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})

    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": image_size},
        crop_size={"height": image_size, "width": image_size},
    )
    processor = LlavaProcessor(  # type: ignore[no-untyped-call]
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        image_token="<image>",
    )
    processor.save_pretrained(out)
    return out


def build_sized(out: Path, tokens: int, seed: int = 1234) -> Path:
    """The benchmark's model for items of ``tokens`` x 4096 float32 (1-layer CLIP, 1-layer Llama)."""
    side = side_for_tokens(tokens)
    # std 0.02 keeps a 4096-wide projector's outputs finite and still image-dependent.
    return build(
        out,
        seed,
        image_size=side,
        text_hidden=BENCH_TEXT_HIDDEN,
        vision_layers=1,
        text_layers=1,
        init_std=0.02,
        max_positions=max(512, 2 * tokens + 256),
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument(
        "--image-tokens",
        type=int,
        default=None,
        help="build the benchmark's model for this many tokens per item (default: the tests' model)",
    )
    args = ap.parse_args(argv)
    print(build_sized(args.out, args.image_tokens) if args.image_tokens else build(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
