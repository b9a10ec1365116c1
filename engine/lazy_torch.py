"""`torch`, imported on first use, for the Triton kernel modules.

They import torch only for their Python wrappers. The start-up's kernel-compiling child processes
(`engine.startup.kernel_compiler`) import those modules for the kernels alone, many at once while the workers
start, and torch's import would be most of each child's start. In the engine's processes torch is already
imported: the first attribute access binds it; each access costs one Python-level `__getattr__` call.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any


class _OnDemand:
    def __init__(self, name: str) -> None:
        self._name = name
        self._module: ModuleType | None = None

    def __getattr__(self, attr: str) -> Any:
        if attr in ("_name", "_module"):  # not set yet (an instance made without __init__, as copy does)
            raise AttributeError(attr)
        module = self._module
        if module is None:
            module = self._module = importlib.import_module(self._name)
        return getattr(module, attr)


torch: Any = _OnDemand("torch")
