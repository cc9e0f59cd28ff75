"""vLLM's runtime LoRA routes: ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``.

Installed only with ``--allow-runtime-lora-updating`` (or the environment
variable vLLM reads, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=true``), and like every
API route behind ``--api-key``. An adapter loads onto the first served model
started with ``--enable-lora``, on every data-parallel replica; requests then
name it as their ``model``.
"""

from __future__ import annotations

import asyncio

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from ..core.lora import LoRAError, LoRARequest, load_adapter
from .errors import APIError
from .models import ModelRegistry


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


def install_lora_routes(app: FastAPI, models: ModelRegistry) -> None:
    lock = asyncio.Lock()  # one load or unload at a time: ids and names stay unique

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        async with lock:
            base = models.lora_base()
            if body.lora_name in models.adapters or body.lora_name in models.models:
                raise APIError(400, f"the LoRA adapter '{body.lora_name}' has already been loaded", "lora_name")
            # Each engine is changed on its own thread (AsyncLLM.call), never from here.
            replicas = base.llm.replicas
            seen = [await r.call(lambda e: (e.lora.next_id(), e.lora.max_rank, e.lora.num_layers)) for r in replicas]
            # An id no engine has seen: a reload under an old name is another adapter (own prefix-cache blocks).
            request = LoRARequest(body.lora_name, max(next_id for next_id, _, _ in seen), body.lora_path)
            _, max_rank, num_layers = seen[0]
            registered = []
            try:  # read and checked off the event loop; the engines only take the result
                adapter = await asyncio.to_thread(load_adapter, body.lora_path, body.lora_name, max_rank, num_layers)
                for r in replicas:
                    await r.call(lambda e: e.lora.register(request, adapter))
                    registered.append(r)
            except LoRAError as exc:
                for r in registered:
                    await r.call(lambda e: e.lora.unregister(body.lora_name))
                raise APIError(400, str(exc), "lora_path") from None
            models.add_adapter(base, request)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        async with lock:
            adapter = models.adapters.get(body.lora_name)
            if adapter is None:
                raise APIError(404, f"the LoRA adapter '{body.lora_name}' is not loaded", "lora_name")
            if body.lora_int_id is not None and body.lora_int_id != adapter.lora.lora_int_id:
                raise APIError(400, f"the LoRA adapter '{body.lora_name}' has id {adapter.lora.lora_int_id}, "
                                    f"not {body.lora_int_id}", "lora_int_id")
            del models.adapters[body.lora_name]
            for r in adapter.base.llm.replicas:
                await r.call(lambda e: e.lora.unregister(body.lora_name))  # running requests finish with it
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
