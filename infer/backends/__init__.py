"""In-tree backends. Each subpackage is a pluggy plugin registered by `infer.registry`."""
