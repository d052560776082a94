"""/v1/chat/completions driven by the official `openai` client on a live server with a real Ray and ONE real vLLM
CPU engine (shared by the module): a tiny Llama trained here to call an `add` tool, answer the tool's result and
greet, served as a job's checkpoint. Answers (plain, tool calls, after a tool result; streamed and not) are
checked against the HF model's greedy decode of the same checkpoint, logprobs against its log-softmax; then n and
seeds, stop strings, token limits, concurrent requests sharing the engine, model resolution across tenants with
checkpoint permissions, the chat-engine quota, the 4xx answers in OpenAI's shape, and the idle stop."""

from __future__ import annotations

import json
import re
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from api_helpers import ThreadedServer

from api.app import create_app
from rl_service.control.quota import ChatSettings, TenantQuota
from rl_service.control.service import Principal, TaperService
from rl_service.control.settings import TaperSettings
from rl_service.control.store import Store
from rl_service.spec import JobSpec
from rollout_workers.chat import ChatFormat, tool_call_text

ADD = {"name": "add", "description": "Add two integers.",
       "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                      "required": ["a", "b"]}}
TOOLS = [{"type": "function", "function": ADD}]
ASK = [{"role": "user", "content": "What is 2 plus 3?"}]
CALLED = {"role": "assistant", "content": None,
          "tool_calls": [{"id": "call_1", "type": "function",
                          "function": {"name": "add", "arguments": json.dumps({"a": 2, "b": 3})}}]}
AFTER_TOOL = [*ASK, CALLED, {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
HELLO = [{"role": "user", "content": "Say hello."}]
# (messages, tools, what the model is trained to answer)
CONVERSATIONS = [(ASK, [ADD], tool_call_text("add", {"a": 2, "b": 3})),
                 (AFTER_TOOL, [ADD], "The answer is 5."),
                 (HELLO, None, "Hello there, friend!")]
LIMITS = ChatSettings(max_model_len=512, kv_cache_gib=0.25, max_num_seqs=32, max_completion_tokens=64, max_n=4,
                      idle_timeout_s=3600)


def _template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if k != "tool_call_id"}
        if m.get("content") is None:
            m["content"] = ""
        out.append(m)
    return out


@pytest.fixture(scope="module")
def chat_model_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama trained to answer CONVERSATIONS (teacher forcing on the answers until greedy is exact)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    chat = ChatFormat(tok)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    seqs = []
    for messages, tools, answer in CONVERSATIONS:
        prompt = chat.render_prompt(_template(messages), tools)[1]
        target = chat.encode(answer) + [tok.eos_token_id]
        seqs.append((torch.tensor([prompt + target]), len(prompt), torch.tensor(target)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(150):
        opt.zero_grad()
        loss = sum(torch.nn.functional.cross_entropy(model(ids).logits[0, n - 1:-1], target) for ids, n, target in seqs)
        loss.backward()
        opt.step()
    out = tmp_path_factory.mktemp("chat-tiny")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def hf(chat_model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chat_model_dir)
    return AutoModelForCausalLM.from_pretrained(chat_model_dir, dtype=torch.float32).eval(), ChatFormat(tok)


def hf_greedy(hf: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
              max_new: int = 64) -> tuple[list[int], list[float], int]:
    """(sampled ids, their log-softmax, prompt length) of HF's greedy decode."""
    model, chat = hf
    prompt = chat.render_prompt(_template(messages), tools)[1]
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new, output_logits=True,
                             return_dict_in_generate=True, eos_token_id=chat.stop_token_ids, pad_token_id=0)
    ids = out.sequences[0, len(prompt):].tolist()
    logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, ids, strict=False)]
    return ids, logprobs, len(prompt)


@pytest.fixture(scope="module")
def live(chat_model_dir: Path, redis_server_url: str, ray_local: Any,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    import redis

    redis.Redis.from_url(redis_server_url).flushdb()
    tmp = tmp_path_factory.mktemp("chat-service")
    store = Store(redis_server_url)
    service = TaperService(store, tmp, submit_rate_per_minute=1000, base_models={"chat-tiny": chat_model_dir})
    job, _ = store.submit_job("alpha", JobSpec(total_steps=4), str(tmp / "jobs"))
    step_dir = Path(job.work_dir) / "checkpoints" / "step-3"
    shutil.copytree(chat_model_dir, step_dir)
    store.add_checkpoint(job.id, 3, step_dir.resolve().as_uri())
    app = create_app(service, TaperSettings(max_request_bytes=64_000, data_dir=tmp, chat=LIMITS))
    with ThreadedServer(app) as server:
        keys = {t: store.create_api_key(t) for t in ("alpha", "beta")}
        clients = {t: openai.OpenAI(api_key=k, base_url=f"{server.url}/v1", max_retries=0, timeout=300)
                   for t, k in keys.items()}
        yield {"app": app, "store": store, "service": service, "url": server.url, "keys": keys, "job": job.id,
               "model": f"{job.id}:3", "engines": app.state.chat_engines, **clients}


def test_greedy_answers_equal_the_hf_greedy_decode(live, hf) -> None:
    client, model = live["alpha"], live["model"]
    # a tool call
    r = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, temperature=0, logprobs=True,
                                       top_logprobs=2)
    ids, logprobs, prompt_len = hf_greedy(hf, ASK, [ADD])
    choice = r.choices[0]
    assert (r.object, choice.finish_reason, choice.message.role) == ("chat.completion", "tool_calls", "assistant")
    assert hf[1].decode(ids[:-1]) == tool_call_text("add", {"a": 2, "b": 3})  # the model learned its answer
    call = choice.message.tool_calls[0]
    assert (call.type, call.function.name, json.loads(call.function.arguments)) == ("function", "add", {"a": 2, "b": 3})
    assert call.id.startswith("call_") and choice.message.content is None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (prompt_len, len(ids))
    assert r.usage.total_tokens == prompt_len + len(ids)
    got = choice.logprobs.content
    assert len(got) == len(ids) - 1  # the end-of-turn token is not part of the message
    assert [e.logprob for e in got] == pytest.approx(logprobs[:-1], abs=1e-3)
    assert "".join(e.token for e in got) == hf[1].decode(ids[:-1])
    for e in got:
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token  # greedy: the sampled one is the top
        assert e.bytes == list(e.token.encode())
    # the conversation goes on after the tool's result (the client sends back the call as it got it)
    messages = [*ASK, choice.message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "5"}]
    r2 = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, temperature=0)
    ids2, _, _ = hf_greedy(hf, AFTER_TOOL, [ADD])
    assert r2.choices[0].message.content == hf[1].decode(ids2[:-1]) == "The answer is 5."
    assert r2.choices[0].finish_reason == "stop" and r2.choices[0].message.tool_calls is None
    # plain content, no tools
    r3 = client.chat.completions.create(model=model, messages=HELLO, temperature=0, max_completion_tokens=40)
    ids3, _, _ = hf_greedy(hf, HELLO, None)
    assert r3.choices[0].message.content == hf[1].decode(ids3[:-1]) == "Hello there, friend!"
    # with tools the model was not asked to use: tool_choice none leaves its text as the content
    r4 = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="none", temperature=0)
    assert r4.choices[0].message.content == tool_call_text("add", {"a": 2, "b": 3})
    assert r4.choices[0].finish_reason == "stop"


def test_streaming_sends_openai_chunks(live, hf) -> None:
    client, model = live["alpha"], live["model"]
    chunks = list(client.chat.completions.create(model=model, messages=HELLO, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    ids, _, prompt_len = hf_greedy(hf, HELLO, None)
    assert {c.object for c in chunks} == {"chat.completion.chunk"} and len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == hf[1].decode(ids[:-1])
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1  # token by token, not at once
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert chunks[-1].choices == [] and (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == \
        (prompt_len, len(ids))
    assert all(c.usage is None for c in chunks[:-1])

    # a streamed tool call: the markup never shows as content; the call comes as tool_calls deltas
    with client.chat.completions.stream(model=model, messages=ASK, tools=TOOLS, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    assert not any(getattr(e, "type", "") == "content.delta" and "<tool" in e.delta for e in events)
    call = final.choices[0].message.tool_calls[0]
    assert (call.function.name, json.loads(call.function.arguments)) == ("add", {"a": 2, "b": 3})
    assert final.choices[0].finish_reason == "tool_calls"

    # the wire: server-sent events, each `data: {...}`, ending with `data: [DONE]`
    with httpx.stream("POST", f"{live['url']}/v1/chat/completions", timeout=120,
                      headers={"Authorization": f"Bearer {live['keys']['alpha']}"},
                      json={"model": model, "messages": HELLO, "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    assert json.loads(lines[0][6:])["choices"][0]["delta"] == {"role": "assistant", "content": "", "refusal": None}


def test_n_seeds_stop_and_token_limits(live) -> None:
    client, model = live["alpha"], live["model"]
    ask = dict(model=model, messages=HELLO, temperature=1.8, n=4, seed=11, max_completion_tokens=12)
    first, again = client.chat.completions.create(**ask), client.chat.completions.create(**ask)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2, 3]
    assert texts == [c.message.content for c in again.choices]  # same seed, same answers
    assert len(set(texts)) > 1  # the choices are sampled independently
    other = client.chat.completions.create(**{**ask, "seed": 12})
    assert [c.message.content for c in other.choices] != texts

    stopped = client.chat.completions.create(model=model, messages=HELLO, temperature=0, stop=[" friend"])
    assert (stopped.choices[0].message.content, stopped.choices[0].finish_reason) == ("Hello there,", "stop")
    for field in ("max_completion_tokens", "max_tokens"):  # the deprecated name still works
        cut = client.chat.completions.create(model=model, messages=HELLO, temperature=0, **{field: 2})
        assert (cut.choices[0].finish_reason, cut.usage.completion_tokens) == ("length", 2)


def test_concurrent_requests_share_one_engine(live) -> None:
    client, model = live["alpha"], live["model"]
    results: list[str | None] = [None] * 8

    def ask(i: int) -> None:
        r = client.chat.completions.create(model=model, messages=HELLO, temperature=0)
        results[i] = r.choices[0].message.content

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == ["Hello there, friend!"] * 8
    # the job id alone names its newest checkpoint: the same weights, the same engine
    assert client.chat.completions.create(model=live["job"], messages=HELLO, temperature=0).choices[0].message.content \
        == "Hello there, friend!"
    assert live["engines"].started == 1 and live["engines"].running("alpha") == [model]


def _error(exc: openai.APIStatusError) -> dict[str, Any]:
    body = exc.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_models_tenants_and_permissions(live) -> None:
    engines, store, model = live["engines"], live["store"], live["model"]
    alpha, beta = Principal("alpha"), Principal("beta")
    assert engines.resolve(alpha, "base:chat-tiny") == str(Path(live["service"].files.base_models["chat-tiny"]).resolve())
    assert engines.resolve(alpha, "tiny") == "preset:tiny"
    # another tenant's checkpoint is a model that does not exist, as OpenAI answers
    for ref in (model, live["job"]):
        with pytest.raises(openai.NotFoundError) as e:
            live["beta"].chat.completions.create(model=ref, messages=HELLO)
        err = _error(e.value)
        assert (err["param"], err["type"]) == ("model", "invalid_request_error") and "does not exist" in err["message"]
    # its owner lets beta use it (issue 56's checkpoint permissions): beta's request resolves to the same weights
    perms = f"{live['url']}/v1/fine_tuning/checkpoints/{model}/permissions"
    owner = {"Authorization": f"Bearer {live['keys']['alpha']}"}
    grant = httpx.post(perms, json={"project_ids": ["beta"]}, headers=owner).json()
    assert engines.resolve(beta, model) == engines.resolve(alpha, model)
    store.set_quota("beta", TenantQuota(max_chat_engines=0))  # proves the permitted request got past the 404
    with pytest.raises(openai.RateLimitError) as e:
        live["beta"].chat.completions.create(model=model, messages=HELLO)
    assert _error(e.value)["param"] == "model" and "max_chat_engines" in _error(e.value)["message"]
    assert httpx.delete(f"{perms}/{grant['data'][0]['id']}", headers=owner).status_code == 200
    with pytest.raises(openai.NotFoundError):
        live["beta"].chat.completions.create(model=model, messages=HELLO)
    for unknown in ("job-0123456789abcdef", f"{live['job']}:9", "base:nope", "gpt-4o", "../etc"):
        with pytest.raises(openai.NotFoundError) as e:
            live["alpha"].chat.completions.create(model=unknown, messages=HELLO)
        assert _error(e.value)["param"] == "model"


def test_quota_refuses_another_engine_while_all_are_busy(live, hf) -> None:
    client, model, store = live["alpha"], live["model"], live["store"]
    store.set_quota("alpha", TenantQuota(max_chat_engines=1))
    try:
        eos = hf[1].eos_token_id  # never end: the stream stays busy for its 64 tokens
        stream = client.chat.completions.create(model=model, messages=HELLO, stream=True, temperature=0,
                                                logit_bias={str(eos): -100})
        next(iter(stream))
        with pytest.raises(openai.RateLimitError) as e:
            client.chat.completions.create(model="base:chat-tiny", messages=HELLO)
        assert _error(e.value)["param"] == "model"
        rest = list(stream)
        assert [c.choices[0].finish_reason for c in rest if c.choices and c.choices[0].finish_reason] == ["length"]
    finally:
        store.delete_quota("alpha")
    assert live["engines"].started == 1


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"messages": HELLO, "temperature": "hot"}, 400, "temperature"),
    ({"messages": HELLO, "n": 0}, 400, "n"),
    ({"messages": HELLO, "n": 5}, 400, "n"),  # over the operator's max_n
    ({"messages": HELLO, "max_completion_tokens": 65}, 400, "max_completion_tokens"),  # over the operator's bound
    ({"messages": HELLO, "max_tokens": 1000}, 400, "max_tokens"),
    ({"messages": HELLO, "response_format": {"type": "json_object"}}, 400, "response_format"),  # not served
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages.0"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages.0.content"),
    ({"messages": HELLO, "tools": [{"type": "function", "function": {"name": "bad name"}}]}, 400,
     "tools.0.function.name"),
    ({"messages": HELLO, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"messages": HELLO, "top_logprobs": 2}, 422, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "word " * 1000}]}, 400, "messages"),  # over the context
])
def test_bad_input_is_a_4xx_in_openai_shape(live, body, status, param) -> None:
    r = httpx.post(f"{live['url']}/v1/chat/completions", json={"model": live["model"], **body}, timeout=120,
                   headers={"Authorization": f"Bearer {live['keys']['alpha']}"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] is not None and err["param"].startswith(param), err
    assert err["type"] == "invalid_request_error" and err["message"]
    if "word " in json.dumps(body):
        assert err["code"] == "context_length_exceeded" and "maximum context length is 512" in err["message"]


def test_oversize_body_and_missing_key(live) -> None:
    r = httpx.post(f"{live['url']}/v1/chat/completions", timeout=60,
                   headers={"Authorization": f"Bearer {live['keys']['alpha']}"},
                   json={"model": live["model"], "messages": [{"role": "user", "content": "x" * 70_000}]})
    assert r.status_code == 413 and r.json()["error"]["param"] == "body"
    r = httpx.post(f"{live['url']}/v1/chat/completions", json={"model": live["model"], "messages": HELLO})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_the_guide_snippet_runs(live, capsys: pytest.CaptureFixture[str]) -> None:
    """docs/chat-completions.md's snippet, pointed at this server, key and checkpoint."""
    guide = (Path(__file__).resolve().parents[2] / "docs" / "chat-completions.md").read_text()
    code = re.search(r"```python\n(.*?)```", guide, re.DOTALL).group(1)
    code, subs = re.subn(r'OpenAI\(base_url=.*\)\n', f"OpenAI(base_url={live['url'] + '/v1'!r}, "
                                                     f"api_key={live['keys']['alpha']!r})\n", code)
    code, more = re.subn(r'^MODEL = .*$', f"MODEL = {live['model']!r}", code, flags=re.MULTILINE)
    assert subs == more == 1
    exec(compile(code, "docs/chat-completions.md", "exec"), {})
    answer, hello, usage = capsys.readouterr().out.splitlines()
    assert (answer, hello) == ("The answer is 5.", "Hello there, friend!") and re.fullmatch(r"\d+ tokens", usage)


def test_an_idle_engine_is_stopped(live) -> None:
    import ray

    engines = live["engines"]
    actor = next(iter(engines._engines.values())).actor
    assert engines.reap() == []  # used a moment ago
    assert engines.reap(now=engines._clock() + LIMITS.idle_timeout_s + 1) == [live["model"]]
    assert engines.running() == []
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(actor.ping.remote(), timeout=60)
