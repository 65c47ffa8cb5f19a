"""``--model DIR``: tiny random-weight transformers models written by the test, loaded offline.

Each model directory holds what ``save_pretrained`` writes for the model (safetensors) and for its image processor
(``preprocessor_config.json``). The reference is transformers itself: ``AutoImageProcessor`` and the model class
loaded from the same directory, fed the same image bytes opened with Pillow, the way a transformers user does it.
Both run float32 on the CPU with the same batch, so the comparison is exact (``torch.equal``): any difference in
the pixels the tower sees (resize, crop, alpha, patch order) shows up, however small.
"""

from __future__ import annotations

import functools
import io
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tensorwire.encoder import SAMPLES_DIR, load_encoder, sample_paths
from tensorwire.errors import ConfigError, InvalidPayload, Reason, UnsafeWeights

transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

KINDS = ("clip", "siglip", "qwen")
SCENE = SAMPLES_DIR / "scene_2048x1365.jpg"  # the 2048x1365 sample the finding used (a JPEG, RGB)
SQUARE = SAMPLES_DIR / "checker_448.png"


def _processor_class(name: str) -> Any:
    # transformers 5 splits image processors by backend (torchvision or PIL); 4.x has one (PIL) class per name.
    # The class only writes preprocessor_config.json here; AutoImageProcessor picks the backend when loading.
    return getattr(transformers, f"{name}Pil", None) or getattr(transformers, name)


def _save_clip(path: Path) -> None:
    cfg = transformers.CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=56, patch_size=14
    )
    torch.manual_seed(0)
    transformers.CLIPVisionModel(cfg).save_pretrained(path)
    # CLIP's own recipe: shortest edge to 56, then a 56x56 center crop.
    _processor_class("CLIPImageProcessor")(
        size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56}
    ).save_pretrained(path)


def _save_siglip(path: Path) -> None:
    cfg = transformers.SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=56, patch_size=14
    )
    torch.manual_seed(1)
    transformers.SiglipVisionModel(cfg).save_pretrained(path)
    # SigLIP's recipe: resize to the square (no crop), mean/std 0.5.
    _processor_class("SiglipImageProcessor")(size={"height": 56, "width": 56}).save_pretrained(path)


def _qwen_processor(path: Path) -> None:
    # max_pixels well below tensorwire's own PreprocessConfig default (1280*28*28): the directory's value must win.
    # It also keeps the tower's attention small on 2 cores (<= 1024 patches).
    _processor_class("Qwen2VLImageProcessor")(min_pixels=56 * 56, max_pixels=256 * 28 * 28).save_pretrained(path)


def _save_qwen_tower(path: Path) -> None:
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    torch.manual_seed(2)
    cfg = Qwen2VLVisionConfig(depth=2, embed_dim=32, hidden_size=48, num_heads=4, patch_size=14)
    Qwen2VisionTransformerPretrainedModel._from_config(cfg).save_pretrained(path)
    _qwen_processor(path)


SAVERS = {"clip": _save_clip, "siglip": _save_siglip, "qwen": _save_qwen_tower}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    for kind, save in SAVERS.items():
        save(root / kind)
    return {kind: root / kind for kind in KINDS}


@pytest.fixture(scope="module")
def encoders(model_dirs: dict[str, Path]) -> dict[str, Any]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return {kind: load_encoder(str(path)) for kind, path in model_dirs.items()}


@pytest.fixture(scope="module")
def images() -> dict[str, bytes]:
    # A non-square RGBA PNG made here: transparency is where Pillow's convert("RGB") (drop alpha) and the
    # processors' convert_to_rgb (composite onto white) part ways.
    yy, xx = torch.meshgrid(torch.arange(170), torch.arange(300), indexing="ij")
    rgba = torch.stack([xx % 256, yy * 3 % 256, (xx + yy) % 256, (xx * 7 + yy) % 256], dim=-1).to(torch.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgba.numpy(), "RGBA").save(buf, format="PNG")
    return {"square": SQUARE.read_bytes(), "scene": SCENE.read_bytes(), "rgba_300x170": buf.getvalue()}


@functools.cache
def _reference_model(kind: str, path: Path) -> tuple[Any, Any]:
    """transformers' own image processor and model for the directory (loaded once per module run)."""
    proc = transformers.AutoImageProcessor.from_pretrained(path, local_files_only=True)
    if kind == "qwen":
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

        return proc, Qwen2VisionTransformerPretrainedModel.from_pretrained(path, local_files_only=True).eval()
    cls = transformers.CLIPVisionModel if kind == "clip" else transformers.SiglipVisionModel
    return proc, cls.from_pretrained(path, local_files_only=True).eval()


def _reference(kind: str, path: Path, data: list[bytes]) -> list[torch.Tensor]:
    """transformers' processor + model on ``data`` as one request (per image for the Qwen2-VL tower)."""
    proc, model = _reference_model(kind, path)
    pil = [Image.open(io.BytesIO(d)) for d in data]
    with torch.inference_mode():
        if kind == "qwen":
            out = []
            for img in pil:
                inputs = proc(images=[img], return_tensors="pt")
                res = model(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"])
                out.append(res if isinstance(res, torch.Tensor) else res.pooler_output)
            return out
        hidden = model(pixel_values=proc(images=pil, return_tensors="pt")["pixel_values"]).last_hidden_state
        return list(hidden[:, 1:] if kind == "clip" else hidden)


def _old_squash(data: bytes, side: int, mean: Any, std: Any) -> torch.Tensor:
    """What the loader did before: RGB without alpha, bicubic resize to side x side whatever the aspect, normalize."""
    img = Image.open(io.BytesIO(data)).convert("RGB").resize((side, side), Image.Resampling.BICUBIC)
    x = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).view(side, side, 3).permute(2, 0, 1)
    return (x.float() / 255 - torch.tensor(mean).view(3, 1, 1)) / torch.tensor(std).view(3, 1, 1)


@pytest.mark.parametrize("name", ["square", "scene", "rgba_300x170"])
@pytest.mark.parametrize("kind", KINDS)
def test_output_equals_transformers_processor_and_model(
    kind: str, name: str, model_dirs: dict[str, Path], encoders: dict[str, Any], images: dict[str, bytes]
) -> None:
    [out] = encoders[kind].encode([images[name]])
    [expected] = _reference(kind, model_dirs[kind], [images[name]])
    assert out.embedding.shape == expected.shape
    assert torch.equal(out.embedding, expected), (kind, name, (out.embedding - expected).abs().max().item())
    rows, cols = out.grid
    assert out.position_ids.shape == (rows * cols, 2) and rows * cols == expected.shape[0]
    assert out.position_ids[-1].tolist() == [rows - 1, cols - 1]
    w, h = Image.open(io.BytesIO(images[name])).size
    assert out.original_size == (h, w)


def test_qwen_grid_follows_the_directory_processor(encoders: dict[str, Any], images: dict[str, bytes]) -> None:
    # 2048x1365 under the directory's max_pixels (256*28*28): 19x13 tokens, aspect kept; with tensorwire's own
    # default max_pixels it would have been 1280 tokens' worth (about 44x29).
    [out] = encoders["qwen"].encode([images["scene"]])
    assert out.grid == (13, 19)


def test_one_request_with_several_images_equals_the_batched_reference(
    model_dirs: dict[str, Path], encoders: dict[str, Any], images: dict[str, bytes]
) -> None:
    data = [images["scene"], images["square"], images["rgba_300x170"]]
    for kind in KINDS:
        out = encoders[kind].encode(data)
        for got, expected in zip(out, _reference(kind, model_dirs[kind], data), strict=True):
            assert torch.equal(got.embedding, expected), kind


def test_old_square_squash_differs_from_the_model_processor_on_non_square_images(
    model_dirs: dict[str, Path], encoders: dict[str, Any], images: dict[str, bytes]
) -> None:
    # The finding: squashing to the square is right only where the processor does the same for that image.
    proc, model = _reference_model("clip", model_dirs["clip"])
    with torch.inference_mode():
        for name, differs in (("square", False), ("scene", True), ("rgba_300x170", True)):
            squashed = model(pixel_values=_old_squash(images[name], 56, proc.image_mean, proc.image_std)[None])
            old = squashed.last_hidden_state[0, 1:]
            [new] = encoders["clip"].encode([images[name]])
            gap = (old - new.embedding).abs().max().item()
            assert (gap > 0.05) is differs, (name, gap)


def test_pickled_weights_are_refused_naming_the_file(tmp_path: Path) -> None:
    src = tmp_path / "src"
    _save_clip(src)
    model = transformers.CLIPVisionModel.from_pretrained(src, local_files_only=True)
    pkl = tmp_path / "pickled"
    pkl.mkdir()
    for name in ("config.json", "preprocessor_config.json"):
        (pkl / name).write_bytes((src / name).read_bytes())
    torch.save(model.state_dict(), pkl / "pytorch_model.bin")  # what older save_pretrained wrote
    with pytest.raises(UnsafeWeights) as info:
        load_encoder(str(pkl))
    assert isinstance(info.value, ConfigError) and info.value.reason is Reason.UNSAFE_WEIGHTS
    msg = str(info.value)
    assert "pytorch_model.bin" in msg and "safetensors only" in msg and "save_pretrained" in msg
    # Next to safetensors, a pickle is ignored, never opened (this one is not even a valid pickle).
    (src / "pytorch_model.bin").write_bytes(b"not a pickle")
    assert load_encoder(str(src)).hidden_size == 32


def test_serve_encoder_refuses_pickled_weights(tmp_path: Path) -> None:
    from tensorwire.service._child import Child

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "clip_vision_model"}))
    torch.save({"w": torch.zeros(1)}, model / "pytorch_model.bin")
    child = Child("encoder", ["serve-encoder", "--model", str(model), "--metrics-port", "-1"], tmp_path)
    try:
        with pytest.raises(RuntimeError, match="exited with 2 before READY"):  # a config error, not a crash
            child.ready(timeout_s=120)
        log = child.log_path.read_text()
        assert "pytorch_model.bin" in log and "safetensors only" in log, log[-2000:]
    finally:
        child.terminate(grace_s=5)


def test_directory_processor_is_required_and_must_fit_the_tower(tmp_path: Path) -> None:
    _save_clip(tmp_path / "noproc")
    (tmp_path / "noproc" / "preprocessor_config.json").unlink()
    with pytest.raises(ConfigError, match="preprocessor_config.json"):
        load_encoder(str(tmp_path / "noproc"))
    _save_clip(tmp_path / "mismatch")
    _processor_class("CLIPImageProcessor")(
        size={"shortest_edge": 64}, crop_size={"height": 64, "width": 64}
    ).save_pretrained(tmp_path / "mismatch")
    with pytest.raises(ConfigError, match=r"3, 64, 64.*takes \[n, 3, 56, 56\]"):
        load_encoder(str(tmp_path / "mismatch"))


def test_bad_input_and_bad_directories(tmp_path: Path, encoders: dict[str, Any]) -> None:
    with pytest.raises(InvalidPayload):
        encoders["clip"].encode([b"garbage"])
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ConfigError, match="not supported"):
        load_encoder(str(tmp_path / "x"))
    # A hub id is not a directory here: refused locally, never looked up on the network.
    with pytest.raises(ConfigError, match="no config.json"):
        load_encoder("openai/clip-vit-base-patch32")
    _save_clip(tmp_path / "noweights")
    for f in (tmp_path / "noweights").glob("*.safetensors"):
        os.remove(f)
    with pytest.raises(ConfigError, match="no weights"):
        load_encoder(str(tmp_path / "noweights"))


def test_qwen2_vl_full_checkpoint_uses_its_vision_weights(tmp_path: Path) -> None:
    torch.manual_seed(0)
    cfg = transformers.Qwen2VLConfig(
        text_config=dict(
            hidden_size=48,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=128,
            bos_token_id=1,
            eos_token_id=2,
            rope_scaling={"type": "mrope", "mrope_section": [2, 2, 2]},
        ),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=48, num_heads=4, patch_size=14),
    )
    full = transformers.Qwen2VLForConditionalGeneration(cfg)
    full.save_pretrained(tmp_path / "full")
    tower = full.model.visual if hasattr(full, "model") and hasattr(full.model, "visual") else full.visual
    tower.save_pretrained(tmp_path / "tower")  # the same weights, saved as a stand-alone tower
    for d in ("full", "tower"):
        _qwen_processor(tmp_path / d)
    image = [sample_paths()[0].read_bytes()]
    a = load_encoder(str(tmp_path / "full")).encode(image)[0]
    b = load_encoder(str(tmp_path / "tower")).encode(image)[0]
    torch.testing.assert_close(a.embedding, b.embedding, rtol=0, atol=0)
