"""The contract between the core and backends: primitives, records, hooks."""

from .backend import PLUGIN_API_VERSION, Backend
from .hookspecs import ENTRY_POINT_GROUP, hookimpl
from .spec import ACTIVATIONS, PRIMITIVES, PrimitiveArgumentError
from .types import (
    FLOAT_DTYPES,
    AttentionMetadata,
    DenseWeight,
    Fp8Weight,
    Int4GroupWeight,
    Int8GroupWeight,
    SampleOutput,
    SamplingTensors,
    Support,
    WeightHandle,
    dtype_name,
)

__all__ = [
    "ACTIVATIONS",
    "ENTRY_POINT_GROUP",
    "FLOAT_DTYPES",
    "PLUGIN_API_VERSION",
    "PRIMITIVES",
    "AttentionMetadata",
    "Backend",
    "DenseWeight",
    "Fp8Weight",
    "Int4GroupWeight",
    "Int8GroupWeight",
    "PrimitiveArgumentError",
    "SampleOutput",
    "SamplingTensors",
    "Support",
    "WeightHandle",
    "dtype_name",
    "hookimpl",
]
