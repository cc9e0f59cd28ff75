"""The plugin registry: finds backends, architectures and output parsers through pluggy, and
instantiates backends by name (`infer.dispatch.Ops` resolves their primitives)."""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass, field
from typing import Any

import pluggy

from .primitives.backend import PLUGIN_API_VERSION, SUPPORTED_API_VERSIONS, Backend
from .primitives.hookspecs import ENTRY_POINT_GROUP, PROJECT_NAME, InferHookSpec
from .primitives.types import Support

# In-tree plugins register through the same hooks as third-party ones.
BUILTIN_PLUGINS = (
    "infer.backends.cpu_ref",
    "infer.backends.torch_native",
    "infer.backends.cuda",
    "infer.backends.ascend",
    "infer.core.models",
    "infer.server.tool_parsers",
    "infer.server.reasoning",
    "infer.core.speculative",
)
# `--backend auto` takes the first available of these.
AUTO_ORDER = ("cuda", "ascend", "torch")


class BackendUnavailableError(RuntimeError):
    pass


@dataclass
class BackendInfo:
    name: str
    cls: type[Backend] | None
    plugin: str
    available: Support
    description: str = ""


@dataclass
class Registry:
    pm: pluggy.PluginManager
    backends: dict[str, BackendInfo] = field(default_factory=dict)
    models: dict[str, Any] = field(default_factory=dict)
    tool_parsers: dict[str, type] = field(default_factory=dict)
    reasoning_parsers: dict[str, type] = field(default_factory=dict)
    spec_proposers: dict[str, type] = field(default_factory=dict)
    # Plugins that failed to load: name -> reason. Reported, never fatal.
    broken: dict[str, str] = field(default_factory=dict)


def _plugin_label(pm: pluggy.PluginManager, plugin: object) -> str:
    return pm.get_name(plugin) or getattr(plugin, "__name__", repr(plugin))


def _availability(cls: type[Backend]) -> Support:
    if getattr(cls, "api_version", None) not in SUPPORTED_API_VERSIONS:
        versions = ", ".join(f"v{v}" for v in SUPPORTED_API_VERSIONS)
        return Support(False, f"built for plugin API v{getattr(cls, 'api_version', '?')}, infer speaks {versions} "
                              f"(v{PLUGIN_API_VERSION} is current)")
    try:
        return cls.is_available()
    except Exception as exc:  # a plugin's probe must not take the registry down
        return Support(False, f"is_available() raised {type(exc).__name__}: {exc}")


def build_registry(entry_points: bool = True) -> Registry:
    pm = pluggy.PluginManager(PROJECT_NAME)
    pm.add_hookspecs(InferHookSpec)
    reg = Registry(pm)
    for modname in BUILTIN_PLUGINS:
        pm.register(importlib.import_module(modname), name=modname)
    if entry_points:
        _load_entry_points(reg)
    for plugin, classes in _per_plugin(reg, "infer_register_backends"):
        for cls in classes or ():
            label = _plugin_label(pm, plugin)
            if not (isinstance(cls, type) and issubclass(cls, Backend) and cls.name):
                reg.broken[label] = f"registered {cls!r}, which is not a named Backend subclass"
                continue
            if cls.name in reg.backends:
                reg.broken[label] = f"backend name '{cls.name}' already registered by {reg.backends[cls.name].plugin}"
                continue
            reg.backends[cls.name] = BackendInfo(cls.name, cls, label, _availability(cls), cls.description)
    for _, models in _per_plugin(reg, "infer_register_models"):
        reg.models.update(models or {})
    reg.tool_parsers = _named_classes(reg, "infer_register_tool_parsers", "tool parser")
    reg.reasoning_parsers = _named_classes(reg, "infer_register_reasoning_parsers", "reasoning parser")
    reg.spec_proposers = _named_classes(reg, "infer_register_spec_proposers", "speculative method")
    return reg


def _named_classes(reg: Registry, hook_name: str, what: str) -> dict[str, type]:
    """{name: class} from every plugin's `hook_name`; a name taken by an earlier plugin
    (in-tree ones come first) keeps its class and the later plugin is reported."""
    found: dict[str, type] = {}
    owner: dict[str, str] = {}
    for plugin, classes in _per_plugin(reg, hook_name):
        label = _plugin_label(reg.pm, plugin)
        for name, cls in (classes or {}).items():
            if not isinstance(cls, type):
                reg.broken[label] = f"registered {what} '{name}' as {cls!r}, which is not a class"
            elif name in found:
                reg.broken[label] = f"{what} name '{name}' already registered by {owner[name]}"
            else:
                found[name], owner[name] = cls, label
    return found


def _per_plugin(reg: Registry, hook_name: str):
    """Call a hook plugin by plugin, so a result can be traced to its plugin
    and a plugin whose hook raises is reported instead of taking infer down."""
    for impl in getattr(reg.pm.hook, hook_name).get_hookimpls():
        try:
            result = impl.function()
        except Exception as exc:
            reg.broken[_plugin_label(reg.pm, impl.plugin)] = f"{hook_name}() raised {type(exc).__name__}: {exc}"
            continue
        yield impl.plugin, result


def _load_entry_points(reg: Registry) -> None:
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if reg.pm.get_plugin(ep.name) is not None:
            continue
        try:
            reg.pm.register(ep.load(), name=ep.name)
        except Exception as exc:
            reg.broken[ep.name] = f"entry point {ep.value} failed to load: {type(exc).__name__}: {exc}"


@functools.lru_cache(maxsize=1)
def registry() -> Registry:
    """The process-wide registry (the only global state in infer)."""
    return build_registry()


def get_backend(name: str = "auto", device: str | None = None) -> Backend:
    """An instance of backend `name` ('auto': cuda, then ascend, then torch)."""
    reg = registry()
    if name == "auto":
        for candidate in AUTO_ORDER:
            info = reg.backends.get(candidate)
            # An available backend with a note (cuda under TRITON_INTERPRET=1) runs for testing only:
            # asked for by name it runs, but `auto` never picks it.
            if info and info.available and not info.available.reason:
                return info.cls(device=device)
        raise BackendUnavailableError("no backend available for 'auto'; run `infer backends` to see why")
    info = reg.backends.get(name)
    if info is None:
        known = ", ".join(sorted(reg.backends)) or "none"
        raise BackendUnavailableError(f"unknown backend '{name}' (known: {known}); run `infer backends`")
    if not info.available:
        raise BackendUnavailableError(f"backend '{name}' unavailable: {info.available.reason}")
    return info.cls(device=device)


def _lookup(classes: dict[str, type], what: str, name: str) -> type:
    if name not in classes:
        raise ValueError(f"unknown {what} '{name}' (known: {', '.join(sorted(classes)) or 'none'})")
    return classes[name]


def get_tool_parser(name: str) -> type:
    """The tool parser class registered as `name`; ValueError lists the known names."""
    return _lookup(registry().tool_parsers, "tool parser", name)


def get_reasoning_parser(name: str) -> type:
    """The reasoning parser class registered as `name`; ValueError lists the known names."""
    return _lookup(registry().reasoning_parsers, "reasoning parser", name)


def get_spec_proposer(method: str) -> type:
    """The draft proposer class registered for speculative `method`; ValueError lists the known ones."""
    return _lookup(registry().spec_proposers, "speculative method", method)
