"""Each app answers the other task's endpoints with a clear 400 (not a 404): a generation
request sent to an embedding model, or an embedding request sent to a generation model,
says which task the model serves and what to run instead."""
from __future__ import annotations

from fastapi import FastAPI

from deployments.errors import APIError

POOLING_PATHS = {"/v1/embeddings": "embed", "/v1/rerank": "score", "/rerank": "score",
                 "/v1/score": "score", "/score": "score"}


def task_error(path: str, served: str) -> APIError:
    # `path` carries the app's route prefix (/embed/v1/rerank): matched by its end.
    wanted = next((task for p, task in POOLING_PATHS.items() if path.endswith(p)), "generate")
    return APIError.bad_request(
        f"{path} needs a model served with task '{wanted}'; this model serves task '{served}' "
        f"(set the engine's `task` when the model has a pooling head or config, and serve it as "
        f"an app of its own)", code="wrong_task")


def install_pooling_refusals(api: FastAPI) -> None:
    """The generation app's answer to the pooling endpoints."""
    for path in POOLING_PATHS:
        api.add_api_route(path, _refuse("generate", path), methods=["POST"], include_in_schema=False)


def _refuse(served: str, path: str):
    async def refuse():
        raise task_error(path, served)
    return refuse
