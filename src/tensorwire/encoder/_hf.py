"""``--model DIR``: a Hugging Face vision tower loaded from a local directory, never from the network.

Supported ``config.json`` model types:
- ``clip``, ``clip_vision_model`` (CLIPVisionModel; the CLS token is dropped so tokens match the patch grid),
- ``siglip``, ``siglip_vision_model`` (SiglipVisionModel),
- ``qwen2_vl`` (its ``vision_config``; weights under ``visual.`` or ``model.visual.``) and ``qwen2_vl_vision``
  (a tower saved on its own): dynamic resolution, output tokens after the 2x2 merger.

Images are resized to the model's square ``image_size`` for CLIP/SigLIP (their position tables are fixed),
and with Qwen2-VL's dynamic resolution otherwise. Mean/std come from ``preprocessor_config.json`` when present.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from tensorwire.encoder._base import ImageEmbedding, VisionEncoder
from tensorwire.encoder._config import PreprocessConfig
from tensorwire.encoder._preprocess import grid_position_ids, prepare
from tensorwire.errors import ConfigError, Reason

log = logging.getLogger(__name__)

_SIGLIP_MEAN_STD = ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))


def _import_transformers() -> Any:
    # Refuse the network before transformers reads its environment; a missing file must fail, not download.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        import transformers
    except ImportError as exc:
        raise ConfigError(
            "--model DIR needs Hugging Face transformers: pip install 'tensorwire[hf]'",
            reason=Reason.PROVIDER_UNAVAILABLE,
        ) from exc
    return transformers


def _mean_std(path: Path, default: tuple[tuple[float, ...], tuple[float, ...]]) -> tuple[Any, Any]:
    pre = path / "preprocessor_config.json"
    if pre.is_file():
        try:
            doc = json.loads(pre.read_text())
            if len(doc.get("image_mean", ())) == 3 and len(doc.get("image_std", ())) == 3:
                return tuple(map(float, doc["image_mean"])), tuple(map(float, doc["image_std"]))
        except (OSError, ValueError) as exc:
            log.warning("ignoring unreadable %s: %s", pre, exc)
    return default


class HFVisionEncoder(VisionEncoder):
    """A transformers vision model from ``path`` (see the module docstring for the accepted types)."""

    def __init__(self, path: str | os.PathLike[str], *, device: str = "cpu",
                 preprocess: PreprocessConfig | None = None, dtype: torch.dtype | None = None) -> None:
        root = Path(path)
        if not (root / "config.json").is_file():
            raise ConfigError(f"--model {root}: no config.json there; pass 'builtin' or a saved model directory")
        tf = _import_transformers()
        try:
            model_type = json.loads((root / "config.json").read_text()).get("model_type", "")
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--model {root}: unreadable config.json ({exc})") from exc
        base = preprocess or PreprocessConfig()
        self._dtype = dtype or (torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32)
        self._qwen = model_type in ("qwen2_vl", "qwen2_vl_vision")
        try:
            if model_type in ("clip", "clip_vision_model"):
                model = tf.CLIPVisionModel.from_pretrained(root, local_files_only=True)
                mean_std = _mean_std(root, (base.mean, base.std))
                self._drop_cls = True
            elif model_type in ("siglip", "siglip_vision_model"):
                model = tf.SiglipVisionModel.from_pretrained(root, local_files_only=True)
                mean_std = _mean_std(root, _SIGLIP_MEAN_STD)
                self._drop_cls = False
            elif self._qwen:
                model = self._load_qwen_tower(tf, root, model_type)
                mean_std = _mean_std(root, (base.mean, base.std))
                self._drop_cls = False
            else:
                raise ConfigError(
                    f"--model {root}: model_type {model_type!r} is not supported "
                    "(clip, clip_vision_model, siglip, siglip_vision_model, qwen2_vl, qwen2_vl_vision)"
                )
        except ConfigError:
            raise
        except (OSError, ValueError, KeyError) as exc:
            raise ConfigError(f"--model {root}: cannot load {model_type} weights: {exc}") from exc
        pre = PreprocessConfig(**{**base.__dict__, "mean": mean_std[0], "std": mean_std[1]})
        super().__init__(name=f"hf:{root.name}", device=device, preprocess=pre)
        # dtype applied after loading: from_pretrained's dtype keyword changed name across transformers versions.
        self.model = model.to(device=self.device, dtype=self._dtype).eval()
        cfg = self.model.config
        if self._qwen:
            self._patch = int(cfg.patch_size)
            self._merge = int(cfg.spatial_merge_size)
            self._temporal = int(cfg.temporal_patch_size)
            self._hidden = int(getattr(cfg, "hidden_size", None) or cfg.embed_dim)
        else:
            self._patch = int(cfg.patch_size)
            self._image_size = int(cfg.image_size)
            self._hidden = int(cfg.hidden_size)
        log.info("loaded %s from %s", model_type, root)

    def _load_qwen_tower(self, tf: Any, root: Path, model_type: str) -> Any:
        from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLConfig, Qwen2VLVisionConfig
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

        if model_type == "qwen2_vl_vision":
            return Qwen2VisionTransformerPretrainedModel.from_pretrained(root, local_files_only=True)
        # A full Qwen2-VL checkpoint: build only the tower and take its weights from the state dict.
        from safetensors.torch import load_file

        vcfg = Qwen2VLConfig.from_pretrained(root, local_files_only=True).vision_config
        if not isinstance(vcfg, Qwen2VLVisionConfig):
            raise ConfigError(f"--model {root}: config.json has no Qwen2-VL vision_config ({type(vcfg).__name__})")
        # transformers leaves _from_config unannotated
        tower = Qwen2VisionTransformerPretrainedModel._from_config(vcfg)  # type: ignore[no-untyped-call]
        state: dict[str, torch.Tensor] = {}
        for f in sorted(root.glob("*.safetensors")):
            for key, value in load_file(str(f)).items():
                for prefix in ("model.visual.", "visual."):
                    if key.startswith(prefix):
                        state[key[len(prefix):]] = value
        missing, unexpected = tower.load_state_dict(state, strict=False)
        if missing:
            raise ConfigError(f"--model {root}: {len(missing)} vision tower weights missing, e.g. {missing[:3]}")
        return tower

    @property
    def hidden_size(self) -> int:
        return self._hidden

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    def _encode(self, images: Sequence[bytes]) -> list[ImageEmbedding]:
        if self._qwen:
            return [self._encode_qwen(data, i) for i, data in enumerate(images)]
        size = (self._image_size, self._image_size)
        prepared = [prepare(d, self.preprocess, self._patch, index=i, fixed_size=size) for i, d in enumerate(images)]
        batch = torch.stack([p.pixels for p in prepared]).to(device=self.device, dtype=self._dtype)
        hidden = self.model(pixel_values=batch).last_hidden_state
        if self._drop_cls:
            hidden = hidden[:, 1:]
        out = []
        for i, prep in enumerate(prepared):
            pos = grid_position_ids(*prep.grid).to(self.device)
            out.append(ImageEmbedding(embedding=hidden[i].contiguous().clone(), position_ids=pos, grid=prep.grid,
                                      original_size=prep.original_size))
        return out

    def _encode_qwen(self, data: bytes, index: int) -> ImageEmbedding:
        p, m, t = self._patch, self._merge, self._temporal
        prep = prepare(data, self.preprocess, p * m, index=index)
        _, h, w = prep.pixels.shape
        gh, gw = h // p, w // p
        # Qwen2-VL's processor layout: a still image repeated over the temporal patch, patches grouped by merge unit.
        x = prep.pixels.unsqueeze(0).repeat(t, 1, 1, 1)  # [t, 3, h, w]
        x = x.reshape(1, t, 3, gh // m, m, p, gw // m, m, p)
        x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(gh * gw, 3 * t * p * p)
        grid_thw = torch.tensor([[1, gh, gw]], device=self.device)
        emb = self.model(x.to(device=self.device, dtype=self._dtype), grid_thw=grid_thw)
        if not isinstance(emb, torch.Tensor):  # newer transformers return a model output
            emb = getattr(emb, "pooler_output", None) if getattr(emb, "pooler_output", None) is not None \
                else emb.last_hidden_state
        pos = grid_position_ids(*prep.grid).to(self.device)
        return ImageEmbedding(embedding=emb.contiguous(), position_ids=pos, grid=prep.grid,
                              original_size=prep.original_size)
