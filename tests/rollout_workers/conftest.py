"""Fixtures for rollout_workers tests: the chat format, a real HTTP tool server on 127.0.0.1, a tiny Llama
that always calls a tool (the real vLLM engine on the random tiny Llama, shared by the session, is
`vllm_engine` in tests/conftest.py)."""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # scripted_engine helper


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


class ToolServerState:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.in_flight = 0
        self.max_in_flight = 0
        self.flaky_failures_left = 0
        self.requests: list[dict[str, Any]] = []


def _make_handler(state: ToolServerState) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _send(self, code: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self) -> None:  # noqa: N802 - http.server naming
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with state.lock:
                state.requests.append({"path": self.path, "received_at": time.monotonic(), **body})
                state.in_flight += 1
                state.max_in_flight = max(state.max_in_flight, state.in_flight)
            try:
                code, answer = self._answer(body)
            finally:
                # leave the count before the client can see the answer and send its next request
                with state.lock:
                    state.in_flight -= 1
            self._send(code, answer)

        def _answer(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
            if self.path == "/call":
                tool, args = body["tool"], body["arguments"]
                if tool == "add":
                    return 200, {"result": str(args["a"] + args["b"])}
                if tool == "slow":
                    time.sleep(float(args.get("seconds", 0.05)))
                    return 200, {"result": "done"}
                if tool == "flaky":
                    with state.lock:
                        fail = state.flaky_failures_left > 0
                        state.flaky_failures_left -= 1
                    return (503, {}) if fail else (200, {"result": "ok"})
                if tool == "leaky":  # an error status whose body must never reach a trajectory
                    return 400, {"detail": "SECRET-TOKEN-4711 internal stack trace"}
                return 200, {"error": f"no tool {tool}"}
            if self.path == "/outcome":
                return 200, {"reward": 1.0 if body.get("final_answer") == "7" else 0.0}
            return 404, {}

    return Handler


@pytest.fixture(scope="module")
def tool_server() -> Iterator[tuple[str, ToolServerState]]:
    state = ToolServerState()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _make_handler(state))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", state
    server.shutdown()
    server.server_close()


PROBE_CALL = '<tool_call>{"name": "probe", "arguments": {}}</tool_call>'


@pytest.fixture(scope="session")
def tool_calling_llama_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """A tiny Llama that calls `probe` (helper_envs.ProbeEnv) on every turn, for real-engine tests that need
    tool calls (a random model never writes one). The call is one added token, so a next-token table can
    write it: after the assistant header's newline the model writes that token, after anything else its
    end-of-turn token. Its one layer adds nothing (zero output projections), so the logits read only the
    current token's embedding; each embedding is one of three directions."""
    import torch
    from tokenizers import AddedToken
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.add_tokens([AddedToken(PROBE_CALL, special=False, normalized=False)])
    call_id = tok.convert_tokens_to_ids(PROBE_CALL)
    (newline,) = tok.encode("\n", add_special_tokens=False)
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=2048, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        emb[:, 0] = 1.0  # any token ...
        emb[newline] = torch.eye(64)[1]  # ... but the newline ...
        emb[call_id] = torch.eye(64)[2]  # ... and the call
        head[call_id, 1] = 10.0  # newline -> the call
        head[tok.eos_token_id, 0] = head[tok.eos_token_id, 2] = 10.0  # call or anything else -> end of turn
    out = tmp_path_factory.mktemp("tool-calling-llama")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
