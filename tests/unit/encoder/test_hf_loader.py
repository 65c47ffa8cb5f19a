"""``--model DIR``: tiny random-weight transformers models written by the test, loaded offline."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tensorwire.encoder import load_encoder, sample_paths
from tensorwire.errors import ConfigError, InvalidPayload

transformers = pytest.importorskip("transformers")


def _tiny_clip(path: Path) -> None:
    cfg = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, image_size=56, patch_size=14)
    torch.manual_seed(0)
    transformers.CLIPVisionModel(cfg).save_pretrained(path)


def _tiny_qwen_tower(path: Path) -> None:
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    torch.manual_seed(0)
    cfg = Qwen2VLVisionConfig(depth=1, embed_dim=32, hidden_size=48, num_heads=4, patch_size=14)
    Qwen2VisionTransformerPretrainedModel._from_config(cfg).save_pretrained(path)


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_clip_directory_loads_and_matches_transformers(tmp_path: Path) -> None:
    _tiny_clip(tmp_path / "clip")
    enc = load_encoder(str(tmp_path / "clip"))
    assert enc.hidden_size == 32 and enc.name == "hf:clip"
    data = [p.read_bytes() for p in sample_paths()[:2]]
    out = enc.encode(data)
    assert [o.embedding.shape for o in out] == [(16, 32), (16, 32)]  # (56/14)^2 patches, CLS dropped
    assert out[0].position_ids.tolist()[:5] == [[0, 0], [0, 1], [0, 2], [0, 3], [1, 0]]
    # The loaded weights are the saved ones: compare with transformers' own forward on the same pixels.
    from tensorwire.encoder._preprocess import prepare

    ref = transformers.CLIPVisionModel.from_pretrained(tmp_path / "clip", local_files_only=True).eval()
    pixels = prepare(data[0], enc.preprocess, 14, fixed_size=(56, 56)).pixels
    with torch.inference_mode():
        expected = ref(pixel_values=pixels[None]).last_hidden_state[0, 1:]
    torch.testing.assert_close(out[0].embedding, expected)
    with pytest.raises(InvalidPayload):
        enc.encode([b"garbage"])


def test_preprocessor_config_mean_std_is_used(tmp_path: Path) -> None:
    _tiny_clip(tmp_path / "m")
    (tmp_path / "m" / "preprocessor_config.json").write_text(json.dumps({"image_mean": [0.1, 0.2, 0.3],
                                                                         "image_std": [0.5, 0.5, 0.5]}))
    enc = load_encoder(str(tmp_path / "m"))
    assert enc.preprocess.mean == (0.1, 0.2, 0.3) and enc.preprocess.std == (0.5, 0.5, 0.5)


def test_qwen2_vl_tower_dynamic_resolution(tmp_path: Path) -> None:
    _tiny_qwen_tower(tmp_path / "qwen")
    enc = load_encoder(str(tmp_path / "qwen"))
    [out] = enc.encode([sample_paths()[0].read_bytes()])
    rows, cols = out.grid
    assert out.embedding.shape == (rows * cols, 48) and rows * cols > 16
    assert torch.isfinite(out.embedding).all()


def test_bad_directories(tmp_path: Path) -> None:
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ConfigError, match="not supported"):
        load_encoder(str(tmp_path / "x"))
    # A config without weights must fail locally, never reach for the network.
    _tiny_clip(tmp_path / "noweights")
    for f in (tmp_path / "noweights").glob("*.safetensors"):
        os.remove(f)
    with pytest.raises(ConfigError, match="cannot load"):
        load_encoder(str(tmp_path / "noweights"))


def test_qwen2_vl_full_checkpoint_uses_its_vision_weights(tmp_path: Path) -> None:
    torch.manual_seed(0)
    cfg = transformers.Qwen2VLConfig(
        text_config=dict(hidden_size=48, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, bos_token_id=1, eos_token_id=2,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 2, 2]}),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=48, num_heads=4, patch_size=14))
    full = transformers.Qwen2VLForConditionalGeneration(cfg)
    full.save_pretrained(tmp_path / "full")
    tower = full.model.visual if hasattr(full, "model") and hasattr(full.model, "visual") else full.visual
    tower.save_pretrained(tmp_path / "tower")  # the same weights, saved as a stand-alone tower
    image = [sample_paths()[0].read_bytes()]
    a = load_encoder(str(tmp_path / "full")).encode(image)[0]
    b = load_encoder(str(tmp_path / "tower")).encode(image)[0]
    torch.testing.assert_close(a.embedding, b.embedding)
