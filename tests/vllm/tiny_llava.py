"""Builds a tiny LLaVA-style model (CLIP vision tower + 2-layer Llama, random weights) offline.

Nothing is downloaded: the weights come from a seeded random init and are saved as safetensors, the tokenizer is a
word-level ``tokenizers`` model over a fixed vocabulary, the processor config is written by transformers' own
classes. Sizes are chosen for vLLM's CPU backend: its paged attention rejects head_dim 16, 64 works; two heads per
attention so that TP=2 can split them.

    python tiny_llava.py OUT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

IMAGE_SIZE = 56
PATCH_SIZE = 14
# LLaVA "default" feature selection drops the CLS token: (56 / 14) ** 2 = 16 embeddings per image.
IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2
TEXT_HIDDEN = 128
WORDS = [f"w{i}" for i in range(200)] + [
    "USER:", "ASSISTANT:", "describe", "the", "image", "what", "is", "this", "colour", "shape", "a", "an", "of",
]
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "<image>"]


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
            return new + name[len(old):]
    raise ValueError(f"unexpected parameter name {name!r}")


def build(out: Path, seed: int = 1234) -> Path:
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
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>",
        extra_special_tokens={"image_token": "<image>"},
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})

    # Two heads everywhere (head_dim 64): tensor parallelism at TP=2 splits every attention by heads.
    vision = CLIPVisionConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, projection_dim=128,
    )
    text = LlamaConfig(
        vocab_size=len(vocab), hidden_size=TEXT_HIDDEN, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
        bos_token_id=vocab["<s>"], eos_token_id=vocab["</s>"], pad_token_id=vocab["<pad>"],
        tie_word_embeddings=False,
    )
    config = LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=image_token_id,
        vision_feature_select_strategy="default", vision_feature_layer=-1, projector_hidden_act="gelu",
        image_seq_length=IMAGE_TOKENS,
    )
    config.torch_dtype = torch.float32
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    with torch.no_grad():
        # The default init (std 0.02) gives near-uniform logits; a larger scale makes every logprob depend
        # visibly on the image embeddings, which is what the end-to-end check needs.
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
    model.config.architectures = ["LlavaForConditionalGeneration"]
    model.config.save_pretrained(out)
    from safetensors.torch import save_file

    state = {_checkpoint_name(name): t.contiguous() for name, t in model.state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})

    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
    )
    processor = LlavaProcessor(
        image_processor=image_processor, tokenizer=tokenizer, patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default", num_additional_image_tokens=1, image_token="<image>",
    )
    processor.save_pretrained(out)
    return out


if __name__ == "__main__":
    print(build(Path(sys.argv[1])))
