"""LoRA adapters over HTTP: loading and unloading at runtime with vLLM's bodies
(`POST /v1/load_lora_adapter` {lora_name, lora_path}, `/v1/unload_lora_adapter` {lora_name})
and SGLang's (`/load_lora_adapter`, `/unload_lora_adapter`), behind the admin key when one
is set (deployments/auth.py), and the adapters `/v1/models` lists.

A load or unload goes to every engine replica (Serve's broadcast; under `ingress: colocated`
to every replica of that deployment, deployments/colocated.py), so any replica can serve the
adapter afterwards; an error of any replica is the answer's (400 naming the tensor for an
adapter that cannot serve, 404 for a name no replica has). Unloading an adapter that queued
or running requests use is refused (400) by the replicas running them: the others have
unloaded it, so new requests go to the refusing ones (the router prefers replicas holding
the adapter); retry once they finish. A replica that starts later (autoscaling, a restart)
has the `lora_modules` adapters, then applies the app's record of the loads and unloads made
here (deployments/lora_registry.py), and loads others on first use from `lora_dynamic_path`;
a load broadcast while such a replica started finds it applied, and is answered as done.
"""
from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict

from deployments.errors import APIError, as_api_error
from deployments.lora_registry import UNLOADED, AppAdapters
from deployments.protocol_responses import ModelCard
from deployments.request_body import DEFAULT_MAX_BODY_BYTES, read_json_body

logger = logging.getLogger(__name__)
BROADCAST_TIMEOUT_S = 60.0  # reading an adapter from disk may take a while


class LoadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    lora_name: str
    lora_path: str


class UnloadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    lora_name: str


class LoRAAdmin:
    """The engine replicas' adapters, asked and changed through a handle to them."""

    def __init__(self) -> None:
        self.engine: Any = None
        self.record = AppAdapters()  # what replicas that start later apply

    def configure(self, engine_handle: Any) -> None:
        self.engine = engine_handle

    async def load(self, name: str, path: str) -> None:
        await self._change(name, path, "load_lora", name, path)

    async def unload(self, name: str) -> None:
        await self._change(name, UNLOADED, "unload_lora", name)

    async def _change(self, name: str, path: str | None, op: str, *args: str) -> None:
        """Record the change first (a replica starting meanwhile applies it), then make it
        on every running replica; a change that failed (the answer is an error) is taken
        back."""
        previous = await self.record.record(name, path)
        try:
            await self.run(op, *args)
        except APIError:
            await self.record.put_back(name, previous)
            raise

    async def run(self, op: str, *args: str) -> list[dict]:
        """`op` on every engine replica; their answers, or the first error as an APIError."""
        try:
            response = self.engine.broadcast("lora_admin", op, *args)
            results = await response.results_async(timeout_s=BROADCAST_TIMEOUT_S,
                                                   return_exceptions=True)
        except Exception as e:  # noqa: BLE001 - no replica running, say
            raise APIError.unavailable(f"no engine replica answered: {e}") from None
        answers = [r for r in results if isinstance(r, dict)]
        if len(answers) < len(results):
            logger.warning("%d engine replica(s) did not answer %s",
                           len(results) - len(answers), op)
        if not answers:
            raise APIError.unavailable("no engine replica answered")
        error = first_error(op, answers)
        if error is not None:
            code = "model_not_found" if error["status"] == 404 else None
            raise APIError(error["error"], error["status"], param="lora_name", code=code)
        return answers

    async def adapters(self) -> dict[str, dict]:
        """Adapters loaded on any engine replica, by name."""
        out: dict[str, dict] = {}
        for answer in await self.run("list_loras"):
            for adapter in answer["result"]:
                out.setdefault(adapter["name"], adapter)
        return out

    async def model_cards(self, base: str, max_model_len: int) -> list[ModelCard]:
        """/v1/models: the base model, then each adapter (`parent`: the base)."""
        return [ModelCard(id=base, max_model_len=max_model_len)] + [
            ModelCard(id=name, root=a["path"], parent=base, max_model_len=max_model_len)
            for name, a in (await self.adapters()).items()]

    async def model_card(self, model_id: str, base: str, max_model_len: int) -> ModelCard:
        card = next((c for c in await self.model_cards(base, max_model_len) if c.id == model_id),
                    None)
        if card is None:
            raise APIError(f"The model '{model_id}' does not exist", 404, param="model",
                           code="model_not_found")
        return card


def first_error(op: str, answers: list[dict]) -> dict | None:
    """The error that answers a broadcast of `op`, or None. An unload succeeds where any
    replica had the adapter: the others' 404 only says they never loaded it (an adapter
    loaded on first use from `lora_dynamic_path` lives on the replicas that served it)."""
    errors = [a for a in answers if "error" in a]
    if op == "unload_lora" and any("error" not in a for a in answers):
        errors = [a for a in errors if a["status"] != 404]
    return errors[0] if errors else None


async def _body(request: Request, kind: type[BaseModel]) -> Any:
    try:
        return kind.model_validate(await read_json_body(request, DEFAULT_MAX_BODY_BYTES))
    except Exception as e:  # noqa: BLE001 - pydantic's errors, as every endpoint's
        raise as_api_error(e) from None


def install_lora_api(api: FastAPI) -> LoRAAdmin:
    admin = LoRAAdmin()

    async def vllm_load(request: Request) -> PlainTextResponse:
        body = await _body(request, LoadLoRARequest)
        await admin.load(body.lora_name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def vllm_unload(request: Request) -> PlainTextResponse:
        body = await _body(request, UnloadLoRARequest)
        await admin.unload(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    async def sglang_load(request: Request) -> JSONResponse:
        body = await _body(request, LoadLoRARequest)
        await admin.load(body.lora_name, body.lora_path)
        return await _sglang_answer()

    async def sglang_unload(request: Request) -> JSONResponse:
        body = await _body(request, UnloadLoRARequest)
        await admin.unload(body.lora_name)
        return await _sglang_answer()

    async def _sglang_answer() -> JSONResponse:
        loaded = {name: a["path"] for name, a in (await admin.adapters()).items()}
        return JSONResponse({"success": True, "error_message": "", "loaded_adapters": loaded})

    for path, handler in (("/v1/load_lora_adapter", vllm_load),
                          ("/v1/unload_lora_adapter", vllm_unload),
                          ("/load_lora_adapter", sglang_load),
                          ("/unload_lora_adapter", sglang_unload)):
        api.add_api_route(path, handler, methods=["POST"])
    return admin
