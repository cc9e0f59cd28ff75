"""What one rank runs, whichever process it lives in (the engine's, a worker's, a Ray
actor's): its backend on its device, its shard of the model, and a step's forward from
host inputs. The engine, the worker loop and the draft-model proposer all build and
step models through these functions."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...dispatch import Ops
from ...registry import get_backend, registry
from ..args import EngineArgs
from ..distributed import DistributedState, StepInput
from ..loader import load_model
from ..lora import add_lora, lora_targets
from ..lowering import TP_GROUP, lower
from ..memory import trim_heap
from ..kv_groups import plan_kv_groups
from ..model_runner import CARRIED, ModelRunner
from ..loader.pooling_config import read_pooling_config
from ..models.llava import align_layout
from ..models.pooling import POOLING_ARCHITECTURES, align_sources, build_pooling
from ..multimodal import VisionEncoder
from ..parallel import shard_graph


@dataclass
class ModelParts:
    """One rank's model: what `build_model` makes for the engine and for a worker rank."""

    loaded: Any  # LoadedModel, without weights
    graph: Any
    program: Any
    runner: ModelRunner
    dtype: str
    max_model_len: int
    lora_targets: dict  # `lora.lora_targets` of the whole model; empty without LoRA
    pooling: Any = None  # a pooling model's `PoolingConfig` (embeddings, scores); None: a generating model


def build_model(a: EngineArgs, backend, ops: Ops, dist: DistributedState | None, load_tokenizer: bool) -> ModelParts:
    """Load the checkpoint's config, build and (on a tensor-parallel rank) shard the
    graph, lower it for `backend`, and load this rank's weights into a runner."""
    reg = registry()
    m = load_model(a.model, load_weights=False, load_tokenizer=load_tokenizer, supported_architectures=reg.models)
    name = a.dtype
    pooling = pooling_runner(a.runner, m.architecture, m.source)
    if a.dtype == "auto":
        stored = m.config.get("dtype") or m.config.get("torch_dtype")
        name = backend.auto_dtype(str(stored).removeprefix("torch.") if stored else None, str(m.dtype))
        if pooling:
            name = backend.pooling_dtype(name)
        if name != str(m.dtype):
            logging.getLogger("infer").info("dtype auto: serving %s on backend '%s' (it runs it faster than %s%s)",
                                            name, backend.name, m.dtype,
                                            "; a pooling model's embeddings stay within ~0.9995 cosine" if pooling
                                            else "")
    if name not in backend.dtypes:
        raise ValueError(f"dtype {name} is not supported by backend '{backend.name}' "
                         f"(supported: {', '.join(backend.dtypes)})")
    if pooling:
        if dist is not None or a.enable_lora:
            raise ValueError(f"{m.architecture}: pooling models run on one rank without LoRA for now "
                             "(tensor/pipeline parallelism and --enable-lora are for generating models)")
        pooling = read_pooling_config(m.source)
        graph = build_pooling({**m.config, "infer_pooling": {"method": pooling.method}})
    else:
        graph = reg.models[m.architecture](m.config)
    if graph.encoder is not None:
        if dist is not None or a.enable_lora:
            raise ValueError(f"{m.architecture}: vision-language models run on one rank without LoRA for now "
                             "(tensor/pipeline parallelism and --enable-lora are for text models)")
        align_layout(graph, m.weight_names)
    align_sources(graph, m.weight_names)  # a bare backbone saved without its class's prefix
    targets = lora_targets(graph) if a.enable_lora else {}
    if dist is not None:
        if dist.config.pipeline_parallel_size > 1:
            graph = graph.stage(*dist.stage_layers(graph.num_layers))
        graph = shard_graph(graph, dist.tp_rank, dist.config.tensor_parallel_size)
    if a.enable_lora:
        add_lora(graph, a.max_loras, a.max_lora_rank)
    program = lower(graph, fuses=lambda op, attrs: bool(ops.fuses(op, **attrs)))
    model_len = graph.config.max_position_embeddings
    if a.max_model_len is not None and a.max_model_len > model_len:
        raise ValueError(f"max_model_len={a.max_model_len} exceeds the model's max_position_embeddings={model_len}")
    max_model_len = a.max_model_len or model_len
    if pooling and pooling.max_seq_length and not a.max_model_len:  # sentence-transformers' own cap
        max_model_len = min(max_model_len, pooling.max_seq_length)
    # 'auto' keeps stored quantized weights where the backend's quantized kernels
    # pay (always for 16-bit activations; for float32 only where they are exact).
    keep = a.quantization == "fp8" or (a.quantization == "auto" and backend.keeps_quantized(name))
    weights = m.lazy_weights(progress=a.show_progress, quantized=keep)
    # Sliding-window layers get block tables of their own (not across pipeline stages yet: a
    # stage's pool would hold pages of groups it has no layer of).
    staged = dist is not None and dist.config.pipeline_parallel_size > 1
    windows = {n.layer: n.attrs.get("sliding_window") for n in graph.nodes if n.op == "attention"}
    kv_groups = plan_kv_groups(windows, hybrid=not (a.disable_hybrid_kv_cache_manager or staged))
    runner = ModelRunner(program, backend, ops, weights, name, max_model_len, quantization=a.quantization,
                         kv_cache_dtype=a.kv_cache_dtype, groups={TP_GROUP: dist.tp_group} if dist else None,
                         kv_groups=kv_groups)
    if graph.encoder is not None:  # the vision tower: its own program, the same checkpoint and backend
        vision = ModelRunner(lower(graph.encoder, fuses=lambda op, attrs: bool(ops.fuses(op, **attrs))), backend, ops,
                             weights, name, graph.encoder.config.max_position_embeddings)
        vision.allocate_kv_caches(0, 16)  # no cache: it binds the program
        runner.encoder = VisionEncoder(vision, a.encoder_cache_rows)
    weights.close()
    runner.load_report = weights.report()
    for line in runner.load_report:
        if line.startswith("warning: "):
            logging.getLogger("infer").warning(line.removeprefix("warning: "))
        else:
            logging.getLogger("infer").info(line)
    del weights  # the checkpoint (a GGUF reader holds its whole vocabulary) goes before the KV pool comes
    trim_heap()
    return ModelParts(m, graph, program, runner, name, max_model_len, targets, pooling or None)


def pooling_runner(runner: str, architecture: str, source=None) -> bool:
    """Whether `architecture` (of the checkpoint at `source`) is served as a pooling model under
    `runner` (EngineArgs.runner). 'auto' also pools a causal LM saved by sentence-transformers
    (a Pooling module in its modules.json: Qwen3-Embedding's way)."""
    if runner == "pooling":
        return True
    if architecture in POOLING_ARCHITECTURES:
        if runner == "generate":
            raise ValueError(f"{architecture} has no language-model head to generate with; serve it with "
                             "--runner pooling (embeddings, scores)")
        return True
    if runner == "auto" and source is not None and read_pooling_config(source).method is not None:
        logging.getLogger("infer").info("%s: a sentence-transformers embedding model (modules.json): serving it as "
                                        "a pooling model (--runner generate to generate instead)", architecture)
        return True
    return False


def execute_step(runner: ModelRunner, step: StepInput, dist: DistributedState | None = None):
    """One step's forward on this rank from host inputs (a worker's, or the driver's).

    A pipeline stage after the first receives the previous stage's residual
    stream, one before the last sends its own on; the last stage's logits go
    to the rank(s) that sample (`DistributedState.share_logits`)."""
    be = runner.backend
    move_blocks(runner, step.tier_ops, step.block_copies)
    staged = dist is not None and dist.config.pipeline_parallel_size > 1
    carry = None
    if staged and not dist.is_first_stage:
        shape = (len(step.input_ids), runner.config.hidden_size)
        carry = dist.recv_carry(be, CARRIED, shape, runner.dtype)
    lora = None if step.lora_indices is None else be.asarray(step.lora_indices)
    images = runner.encoder.step_inputs(step.images) if step.images else None
    out = runner.forward(be.asarray(step.input_ids), be.asarray(step.positions), be.asarray(step.sample_rows),
                         runner.prepare_metadata(step.meta), carry, lora, inputs=images)
    if not staged:
        return out
    if not dist.is_last_stage:
        dist.send_carry(out.carry)
    logits = dist.share_logits(be, out.logits, (len(step.sample_rows), runner.config.vocab_size))
    return dataclasses.replace(out, logits=logits, carry=None)


def move_blocks(runner: ModelRunner, tier_ops, copies) -> None:
    """A step's block moves before its forward: the copies to and from the host tier,
    then the copy-on-write block copies."""
    if tier_ops:
        runner.kv_tier.apply(runner.backend, runner.kv_caches, tier_ops)
    copy_blocks(runner, copies)


def rank_path(path: str | None, dist: DistributedState | None) -> str | None:
    """This rank's file of the host tier: ranks hold different KV shards."""
    if path is None or dist is None or dist.config.world_size == 1:
        return path
    return f"{path}.rank{dist.rank}"


def copy_blocks(runner: ModelRunner, copies) -> None:
    """The scheduler's copy-on-write block copies, (src, dst) pairs, in every layer's cache."""
    if copies:
        src, dst = (np.array(x, dtype=np.int64) for x in zip(*copies))
        for cache in runner.kv_caches:
            runner.backend.copy_blocks(cache, src, dst)


def device_index(a: EngineArgs, local_rank: int) -> int:
    """Which of this node's accelerators a rank uses: the replica's ranks on this node
    come after the earlier data-parallel replicas' (one device per rank)."""
    per_node = a.tensor_parallel_size * a.pipeline_parallel_size // max(a.nnodes, 1)
    return a.data_parallel_rank * per_node + local_rank


def rank_backend(a: EngineArgs, local_rank: int):
    """The backend on this rank's device: ``<type>:<device_index>`` on an accelerator without --device."""
    backend = get_backend(a.backend, device=a.device)
    index = device_index(a, local_rank)
    device = backend.rank_device(index) if a.device is None and index else None
    return get_backend(a.backend, device=device) if device is not None else backend
