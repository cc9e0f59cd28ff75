"""Export a lowered program to ONNX: meta-primitives as ops of the custom
domain ``infer``, view ops as standard ONNX ops.

The file documents what a backend must implement; it is not meant to run in
onnxruntime (which knows no ``infer`` ops). Weights and KV caches are graph
inputs with their shapes, so the file stays small. The KV cache of each layer
flows through ``KvWrite`` into ``Attention`` as an explicit value so the
dependency is visible.
"""

from __future__ import annotations

from .lowering import Program

DOMAIN = "infer"
DOMAIN_VERSION = 1


def _op_type(primitive: str) -> str:
    return "".join(part.capitalize() for part in primitive.split("_"))


def to_onnx(program: Program, block_size: int = 16):
    import onnx
    from onnx import TensorProto, helper

    g, cfg = program.graph, program.graph.config
    nodes, inputs, inits = [], [], []
    version: dict[str, int] = {}

    def read(name: str) -> str:
        return f"{name}.{version[name]}" if version.get(name) else name

    def write(name: str) -> str:
        version[name] = version.get(name, -1) + 1
        return read(name)

    def tensor(name, elem, shape):
        return helper.make_tensor_value_info(name, elem, [d if isinstance(d, int) else str(d) for d in shape])

    dtype = TensorProto.FLOAT
    for name, shape in (("input_ids", ["T"]), ("positions", ["T"]), ("sample_rows", ["S"]),
                        ("query_start_loc", ["B+1"]), ("seq_lens", ["B"]), ("block_table", ["B", "max_blocks"]),
                        ("slot_mapping", ["T"]), ("token_type_ids", ["T"])):
        inputs.append(tensor(name, TensorProto.INT64, shape))
        version[name] = 0
    if any(c.primitive == "merge_rows" for c in program.calls):  # a VLM: the image rows and their features
        inputs += [tensor("mm_rows", TensorProto.INT64, ["M"]), tensor("mm_embeds", dtype, ["M", cfg.hidden_size])]
        version["mm_rows"] = version["mm_embeds"] = 0
    if g.output:  # a vision tower: its patches, class-row ids and the rows its projector reads
        width = g.params["patch_embed"].shape[1]
        inputs += [tensor("patches", dtype, ["T", width]), tensor("class_ids", TensorProto.INT64, ["T"]),
                   tensor("feature_rows", TensorProto.INT64, ["M"])]
        version["patches"] = version["class_ids"] = version["feature_rows"] = 0
    for p in g.params.values():
        inputs.append(tensor(p.name, dtype, list(p.shape)))
    meta = ["query_start_loc", "seq_lens", "block_table", "slot_mapping"]
    cache_shape = ["num_blocks", block_size, cfg.num_kv_heads, cfg.head_dim]
    for layer in range(g.num_layers):
        inputs.append(tensor(f"kv_cache.{layer}", dtype, [2] + cache_shape))
        version[f"kv_cache.{layer}"] = 0
    calls = program.primitive_calls()  # a fused call is exported as the primitives it stands for
    # one table per rotary dim and rope variant (Gemma 3's local layers: cos_sin_cache.<dim>.sliding_attention)
    variant = {n.layer: n.attrs.get("rope") for n in g.nodes if n.op == "attention"}

    def table(c) -> str:
        v = variant.get(c.layer)
        return f"cos_sin_cache.{c.attrs['rotary_dim']}" + (f".{v}" if v else "")

    for name in sorted({table(c) for c in calls if c.primitive == "rotary"}):
        inputs.append(tensor(name, dtype, ["max_positions", int(name.split(".")[1])]))

    for i, c in enumerate(calls):
        args = [read(x) for x in c.inputs]
        params = [c.params[k] for k in sorted(c.params, key=lambda k: (k != "weight" and k != "table", k))]
        attrs = {k: _attr(v) for k, v in c.attrs.items() if v is not None}
        if c.primitive == "split":
            sizes = f"split_sizes.{i}"
            inits.append(helper.make_tensor(sizes, TensorProto.INT64, [len(c.attrs["sizes"])], list(c.attrs["sizes"])))
            nodes.append(helper.make_node("Split", args + [sizes], [write(o) for o in c.outputs], axis=1))
        elif c.primitive == "reshape":
            shape = f"shape.{i}"
            inits.append(helper.make_tensor(shape, TensorProto.INT64, [len(c.attrs["shape"])], list(c.attrs["shape"])))
            nodes.append(helper.make_node("Reshape", args + [shape], [write(o) for o in c.outputs]))
        elif c.primitive == "rows":
            nodes.append(helper.make_node("Gather", args, [write(o) for o in c.outputs], axis=0))
        elif c.primitive == "merge_rows":  # x[rows] = values
            axes = f"axes.{i}"
            inits.append(helper.make_tensor(axes, TensorProto.INT64, [1], [1]))
            nodes.append(helper.make_node("Unsqueeze", [args[1], axes], [f"merge_index.{i}"]))
            nodes.append(helper.make_node("ScatterND", [args[0], f"merge_index.{i}", args[2]], [write(c.outputs[0])]))
        elif c.primitive == "add":
            nodes.append(helper.make_node("Add", args, [write(o) for o in c.outputs]))
        elif c.primitive in ("scale", "soft_cap"):
            const = f"const.{i}"
            value = c.attrs["factor"] if c.primitive == "scale" else c.attrs["cap"]
            inits.append(helper.make_tensor(const, dtype, [], [float(value)]))
            if c.primitive == "scale":
                nodes.append(helper.make_node("Mul", args + [const], [write(o) for o in c.outputs]))
            else:
                nodes.append(helper.make_node("Div", args + [const], [f"capped.{i}"]))
                nodes.append(helper.make_node("Tanh", [f"capped.{i}"], [f"tanh.{i}"]))
                nodes.append(helper.make_node("Mul", [f"tanh.{i}", const], [write(o) for o in c.outputs]))
        else:
            extra, outs = [], [write(o) for o in c.outputs]
            if c.primitive == "rotary":
                extra = [table(c)]
            elif c.primitive == "kv_write":
                cache = f"kv_cache.{c.layer}"
                extra, outs = [read(cache), "slot_mapping"], [write(cache)]
            elif c.primitive == "attention":
                extra = [read(f"kv_cache.{c.layer}")] + meta
            elif c.primitive in ("encoder_attention", "pool"):  # within each sequence of the batch
                extra = ["query_start_loc"]
            nodes.append(helper.make_node(_op_type(c.primitive), args + extra + params, outs, name=f"{c.node}/{i}",
                                          domain=DOMAIN, **attrs))
    pooled = next((c for c in reversed(calls) if "pooled" in c.outputs), None)  # a pooling model's result
    output = (tensor(read("pooled"), dtype, list(pooled.shapes[pooled.outputs.index("pooled")])) if pooled
              else tensor(read(g.output), dtype, ["M", g.params["projector.down_proj"].shape[0]]) if g.output
              else tensor(read("logits"), dtype, ["S", cfg.vocab_size]))
    graph = helper.make_graph(nodes, f"infer_{g.architecture}", inputs, [output], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(DOMAIN, DOMAIN_VERSION)],
                              producer_name="infer")
    onnx.checker.check_model(model, full_check=True)
    return model


def _attr(v):
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, tuple):
        return list(v)
    return v
