"""Architectures as graph builders, registered through the `infer_register_models` hook."""

from ...primitives.hookspecs import hookimpl
from .llama import ARCHITECTURES, build_llama
from .deepseek import ARCHITECTURES as DEEPSEEK_ARCHITECTURES, build_deepseek
from .moe import ARCHITECTURES as MOE_ARCHITECTURES, build_moe
from .pooling import POOLING_ARCHITECTURES, build_pooling
from .llava import VLM_ARCHITECTURES, build_llava


def model_builders() -> dict:
    """The in-tree builders by architecture (a VLM's language model is one of them)."""
    return {arch: build_llama for arch in ARCHITECTURES} | {arch: build_moe for arch in MOE_ARCHITECTURES} | {
        arch: build_deepseek for arch in DEEPSEEK_ARCHITECTURES} | {arch: build_pooling for arch in POOLING_ARCHITECTURES} | {
        arch: build_llava for arch in VLM_ARCHITECTURES}


@hookimpl
def infer_register_models():
    return model_builders()
