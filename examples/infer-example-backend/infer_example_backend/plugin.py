"""The plugin module named by the `infer` entry point: pluggy hooks only.

Hooks must stay cheap (they run whenever infer builds its registry), so the
model builder imports the Llama graph only when a model is actually built.
"""

from infer.primitives import hookimpl

from .backend import ExampleBackend


def build_example_llama(config: dict):
    """`ExampleLlamaForCausalLM`: the Llama graph under a new architecture name."""
    from infer.core.models import build_llama

    return build_llama(config)


@hookimpl
def infer_register_backends():
    return [ExampleBackend]


@hookimpl
def infer_register_models():
    return {"ExampleLlamaForCausalLM": build_example_llama}
