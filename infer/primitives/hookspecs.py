"""pluggy hook specifications: how backends, model architectures and output parsers join infer.

A plugin is any module or object with ``@hookimpl`` functions. In-tree backends
register through these hooks exactly like third-party ones; a third-party
package exposes its plugin module under the entry-point group ``infer``::

    [project.entry-points.infer]
    mychip = "infer_mychip.plugin"
"""

from __future__ import annotations

import pluggy

PROJECT_NAME = "infer"
ENTRY_POINT_GROUP = "infer"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


class InferHookSpec:
    @hookspec
    def infer_register_backends(self) -> list[type]:
        """Return `Backend` subclasses (classes, not instances).

        Keep this hook cheap: import no device runtime here; a backend checks
        for its runtime in `Backend.is_available`.
        """

    @hookspec
    def infer_register_models(self) -> dict[str, object]:
        """Return ``{architecture name: graph builder}``.

        The architecture name is the one in a transformers ``config.json``
        ``architectures`` list (e.g. ``"LlamaForCausalLM"``).
        """

    @hookspec
    def infer_register_tool_parsers(self) -> dict[str, type]:
        """Return ``{name: ToolParser subclass}`` (`infer.server.tool_parsers`): how tool
        calls are read out of a model's text. A name already taken is reported, not replaced.
        """

    @hookspec
    def infer_register_spec_proposers(self) -> dict[str, type]:
        """Return ``{method: Proposer subclass}`` (`infer.core.speculative`): what
        ``--speculative-config '{"method": ...}'`` drafts tokens with. A method
        already taken is reported, not replaced. A proposer is built as
        ``cls(config, worker)``: the `Worker` of the rank that samples (its args,
        backend, ops, model and tokenizer, KV pool size), not the engine.
        """

    @hookspec
    def infer_register_reasoning_parsers(self) -> dict[str, type]:
        """Return ``{name: ReasoningParser subclass}`` (`infer.server.reasoning`): how
        reasoning is split from content. A name already taken is reported, not replaced.
        """
