"""Settings: the frozen dataclasses every layer reads (settings.py), the option table that names
them on the command line, in env and in the config file (options.py), and the loading of those
sources (loading.py). The settings are re-exported here: `llama_grpc_server.config` is where
code outside the package, and core/, import them from."""

from llama_grpc_server.config.settings import (
    AUTO,
    RAM_TIER_AUTO,
    GpuLayers,
    ModelSettings,
    PoolSettings,
    SchedulerSettings,
    ServerSettings,
    Settings,
    available_memory_bytes,
    num_cpus,
    ram_tier_mb,
)

__all__ = [
    "AUTO",
    "RAM_TIER_AUTO",
    "GpuLayers",
    "ModelSettings",
    "PoolSettings",
    "SchedulerSettings",
    "ServerSettings",
    "Settings",
    "available_memory_bytes",
    "num_cpus",
    "ram_tier_mb",
]
