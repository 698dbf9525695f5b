"""API keys (deployments/auth.py): Bearer keys on every endpoint but /health and /metrics, a separate
admin key for /flush_cache, OpenAI-style 401s; over real HTTP on a secured app."""
from __future__ import annotations

import httpx
import openai
import pytest

from deployments.auth import KeyCheck
from serve_helpers import BASE, run_app, serve_config_args, start_ray, stop_ray

pytestmark = pytest.mark.slow
KEY, ADMIN = "sk-test-user-key", "sk-test-admin-key"
URL = f"{BASE}/secured"


@pytest.fixture(scope="module")
def secured():
    start_ray()
    run_app(serve_config_args(api_key=KEY, admin_api_key=ADMIN, ingress_replicas=1,
                              engine={"max_total_tokens": 2048}),
            name="secured", route_prefix="/secured")
    yield
    stop_ray()


def get(path: str, key: str | None = None, method: str = "GET", **kw) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.request(method, URL + path, headers=headers, timeout=60, **kw)


@pytest.mark.parametrize("path, method", [("/v1/models", "GET"), ("/v1/stats", "GET"),
                                          ("/get_model_info", "GET"), ("/generate", "POST"),
                                          ("/v1/completions", "POST"), ("/flush_cache", "POST")])
@pytest.mark.parametrize("key", [None, "sk-wrong"])
def test_missing_or_wrong_key_is_401(secured, path, method, key):
    r = get(path, key, method, json={"text": "x"})
    assert r.status_code == 401
    assert r.json()["error"]["type"] == "authentication_error"
    assert r.headers["www-authenticate"] == "Bearer"
    assert KEY not in r.text and ADMIN not in r.text


def test_health_is_open_and_the_key_opens_the_rest(secured):
    assert get("/health").status_code == 200
    assert get("/metrics").text.count('model_name="radixserve-demo"')  # open, as vLLM's
    assert get("/v1/models", KEY).json()["data"][0]["id"] == "radixserve-demo"
    client = openai.OpenAI(base_url=f"{URL}/v1", api_key=KEY, max_retries=0)
    assert client.completions.create(model="radixserve-demo", prompt="hi", max_tokens=2).usage
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{URL}/v1", api_key="sk-wrong", max_retries=0).models.list()


def test_flush_cache_takes_only_the_admin_key(secured):
    assert get("/flush_cache", KEY, "POST").status_code == 401
    assert get("/flush_cache", ADMIN, "POST").status_code == 200


def test_keys_from_the_environment(monkeypatch):
    monkeypatch.setenv("RADIXSERVE_API_KEY", "from-env")
    check = KeyCheck()
    check.configure(None, None)
    assert check.allows("/v1/models", "Bearer from-env")
    assert not check.allows("/v1/models", "Bearer other") and not check.allows("/v1/models", None)
    assert check.allows("/flush_cache", "Bearer from-env")  # no admin key: the API key
    check.configure("from-arg", None)  # an app arg wins over the environment
    assert check.allows("/v1/models", "bearer from-arg") and not check.allows("/x", "Bearer from-env")
    monkeypatch.delenv("RADIXSERVE_API_KEY")
    check.configure(None, None)
    assert check.allows("/v1/models", None)  # no key anywhere: open


def test_no_middleware_relays_the_streamed_body():
    """Starlette's BaseHTTPMiddleware (what `@app.middleware("http")` makes) relays every
    chunk of a streamed response between two tasks: measured at ~35% of the ingress's CPU
    per streamed token (scripts/bench_serve_path.py). The ingress's middlewares are plain
    ASGI."""
    from starlette.middleware.base import BaseHTTPMiddleware

    from deployments.ingress import api

    assert api.user_middleware, "the ingress has its auth and metrics middlewares"
    assert not [m for m in api.user_middleware if issubclass(m.cls, BaseHTTPMiddleware)]
