"""Confinement end to end: the engine demands the run's token, and the proxy holds it."""
from __future__ import annotations

import openai
import pytest

from gyre.env.harness import execution_key
from gyre.serving.engine import Engine, EngineConfig
from gyre.serving.tokenizer import build_tokenizer
from handlers.engines import embedded as engine_server
from handlers.engines.client import make_session
from handlers.proxy.app import start
from handlers.proxy.daemon import Config
from handlers.proxy.state import ProxyState
from tests.test_engine import build_tiny_model

SECRET = b"confinement-test-secret-0123456789"
TOKEN = "the-runs-engine-token"


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("model") / "v0")


@pytest.fixture
async def engine_url(model_dir):
    engine = Engine(EngineConfig(model_dir=model_dir, max_completion_tokens=4))
    _app, runner, url = await engine_server.serve(engine, api_key=TOKEN)
    yield url
    await runner.cleanup()


async def _chat(tok, engine_url: str, engine_token: str) -> openai.types.chat.ChatCompletion | openai.APIStatusError:
    cfg = Config(run="confine", key_secret=SECRET, engine_url=engine_url, engine_token=engine_token,
                 retry_timeout_s=5.0, shutdown_grace_s=2.0, max_completion_tokens=4)
    session = make_session()
    state = ProxyState(cfg, tok, session)
    runner, url = await start(state)
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=execution_key(SECRET, "e1"), max_retries=0)
    try:
        return await client.chat.completions.create(model="gyre", messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=4)
    except openai.APIStatusError as exc:
        return exc
    finally:
        await client.close()
        await state.drain(5)
        state.close()
        await runner.cleanup()
        await session.close()


async def test_the_proxy_reaches_a_token_demanding_engine_only_with_the_runs_token(tok, engine_url):
    ok = await _chat(tok, engine_url, TOKEN)
    assert not isinstance(ok, Exception) and ok.choices[0].finish_reason in ("stop", "length")
    assert ok.usage.completion_tokens >= 1
    refused = await _chat(tok, engine_url, "another-runs-token")
    assert isinstance(refused, openai.APIStatusError)
    # gyre's own wiring is wrong, not the harness's request: a server error, named
    assert refused.status_code == 502 and refused.body["code"] == "engine_unauthorized"
