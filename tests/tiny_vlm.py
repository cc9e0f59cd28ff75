"""Tiny random vision-language models saved as directories with their real processor classes:
the oracles of the VLM tests (transformers' generate on the same weights and pixels)."""

from __future__ import annotations

import torch
import transformers
from tokenizers import processors

from tiny_pooling import word_tokenizer

IMAGE_TOKEN = "<image>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def llava_tokenizer():
    tok = word_tokenizer("qwen")
    # A chat model's tokenizer adds nothing around a sequence (the embedding models' one appends EOS).
    tok.backend_tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _randomize(model):
    for name, p in model.named_parameters():  # larger weights than the init, so errors are not hidden
        p.data.normal_(0, 0.08)
        if "norm" in name.lower() and name.endswith("weight"):
            p.data.add_(1.0)
    return model.eval()


def save_llava(path: str, tower: str = "clip", image_size: int = 32, patch_size: int = 8,
               feature_layer: int = -2, strategy: str = "default", vision_kw: dict | None = None,
               text_kw: dict | None = None) -> str:
    """A LLaVA-1.5-shaped model: a CLIP (or SigLIP) tower, the two-layer GELU projector, a Llama LM
    (tiny sizes unless `vision_kw` / `text_kw` say otherwise)."""
    vsize = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4) | (vision_kw or {})
    tsize = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2) | (text_kw or {})
    tok = llava_tokenizer()
    if tower == "clip":
        vision = transformers.CLIPVisionConfig(image_size=image_size, patch_size=patch_size, projection_dim=32, **vsize)
        images = transformers.CLIPImageProcessor(size={"shortest_edge": image_size},
                                                 crop_size={"height": image_size, "width": image_size})
    else:
        vision = transformers.SiglipVisionConfig(image_size=image_size, patch_size=patch_size, **vsize)
        images = transformers.SiglipImageProcessor(size={"height": image_size, "width": image_size})
    text = transformers.LlamaConfig(**tsize, vocab_size=len(tok),
                                    max_position_embeddings=512, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
                                    bos_token_id=None, pad_token_id=tok.pad_token_id)
    cfg = transformers.LlavaConfig(vision_config=vision, text_config=text,
                                   image_token_index=tok.convert_tokens_to_ids(IMAGE_TOKEN),
                                   vision_feature_layer=feature_layer, vision_feature_select_strategy=strategy,
                                   projector_hidden_act="gelu", image_seq_length=(image_size // patch_size) ** 2)
    torch.manual_seed(0)
    model = _randomize(transformers.LlavaForConditionalGeneration(cfg))
    model.generation_config.eos_token_id = text.eos_token_id
    model.save_pretrained(path)
    tokens = (image_size // patch_size) ** 2 + (1 if strategy == "full" and tower == "clip" else 0)
    proc = transformers.LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=patch_size,
                                       vision_feature_select_strategy=strategy, chat_template=CHAT_TEMPLATE,
                                       num_additional_image_tokens=1 if tower == "clip" else 0)
    proc.save_pretrained(path)
    return path


def image(seed: int, size=(40, 30)):
    """A random RGB picture."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
