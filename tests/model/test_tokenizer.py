import json

import pytest

from model.tokenizer import (
    IM_END,
    IM_START,
    PAD_TOKEN,
    TOKENIZER_DIR,
    TOOL_CALL_END,
    TOOL_CALL_START,
    TOOL_RESPONSE_END,
    TOOL_RESPONSE_START,
    load_tokenizer,
)

MARKUP = [PAD_TOKEN, IM_START, IM_END, TOOL_CALL_START, TOOL_CALL_END, TOOL_RESPONSE_START, TOOL_RESPONSE_END]
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def test_shipped_files_are_small_and_complete():
    names = {path.name for path in TOKENIZER_DIR.iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= names
    assert sum(path.stat().st_size for path in TOKENIZER_DIR.iterdir() if path.is_file()) < 2_000_000
    assert "chat_template" in json.loads((TOKENIZER_DIR / "tokenizer_config.json").read_text())


@pytest.mark.parametrize(
    "text",
    ["Hello, world!  Tabs\tand\nnewlines.", "print(sum(range(10)))  # 45", '{"a": [1, 2.5, null]}', "naïve café 東京 🙂"],
)
def test_round_trip(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert tokenizer.decode(ids) == text


def test_markup_tokens_are_single_ids(tokenizer):
    ids = [tokenizer(token, add_special_tokens=False).input_ids for token in MARKUP]
    assert all(len(single) == 1 for single in ids), ids
    assert len({single[0] for single in ids}) == len(MARKUP)
    assert tokenizer.eos_token == IM_END and tokenizer.pad_token == PAD_TOKEN
    assert max(single[0] for single in ids) < len(tokenizer)


def test_decoding_keeps_tool_markup_but_drops_control_tokens(tokenizer):
    text = f'{IM_START}assistant\n{TOOL_CALL_START}{{"name": "calculator"}}{TOOL_CALL_END}{IM_END}'
    decoded = tokenizer.decode(tokenizer(text, add_special_tokens=False).input_ids, skip_special_tokens=True)
    assert decoded == 'assistant\n<tool_call>{"name": "calculator"}</tool_call>'


def test_chat_template_renders_tools_and_tool_calls(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 17*23?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "17*23"}}}]},
        {"role": "tool", "content": "391"},
        {"role": "assistant", "content": "The answer is 391."},
    ]
    rendered = tokenizer.apply_chat_template(messages, tools=[CALCULATOR], tokenize=False)
    assert rendered.startswith(f"{IM_START}system\nBe brief.\n\n# Tools")
    assert "\ncalculator(expression: string): Evaluate an arithmetic expression.\n" in rendered
    assert (f'{IM_START}assistant\n{TOOL_CALL_START}{{"name": "calculator", "arguments": {{"expression": "17*23"}}}}'
            f"{TOOL_CALL_END}{IM_END}\n") in rendered
    assert f"{IM_START}tool\n{TOOL_RESPONSE_START}391{TOOL_RESPONSE_END}{IM_END}\n" in rendered
    assert rendered.endswith(f"{IM_START}assistant\nThe answer is 391.{IM_END}\n")
    prompt = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert prompt == f"{IM_START}system\nBe brief.{IM_END}\n{IM_START}user\nWhat is 17*23?{IM_END}\n{IM_START}assistant\n"


def test_tool_signatures_mark_optional_parameters_and_odd_types(tokenizer):
    tool = {"name": "fetch", "parameters": {"type": "object", "required": ["url"], "properties": {
        "url": {"type": "string"}, "retries": {"type": ["integer", "null"]}, "body": {}}}}
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=[tool], tokenize=False)
    assert "\nfetch(url: string, retries?: integer|null, body?: any)\n" in rendered


def test_string_arguments_are_rendered_verbatim(tokenizer):
    messages = [{"role": "assistant", "content": "Let me check.", "tool_calls": [
        {"function": {"name": "python", "arguments": '{"code": "print(1)"}'}},
        {"name": "search", "arguments": {"query": "x"}}]}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert rendered == (f'{IM_START}assistant\nLet me check.\n{TOOL_CALL_START}{{"name": "python", "arguments": '
                        f'{{"code": "print(1)"}}}}{TOOL_CALL_END}\n{TOOL_CALL_START}{{"name": "search", "arguments": '
                        f'{{"query": "x"}}}}{TOOL_CALL_END}{IM_END}\n')


def test_tool_traffic_tokenises_compactly(tokenizer):
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "(12 + 7) * 3"}}</tool_call>'
    assert len(tokenizer(call, add_special_tokens=False).input_ids) < len(call) / 2.5


def test_training_script_reproduces_the_shipped_tokenizer(tmp_path):
    import importlib.util

    script = TOKENIZER_DIR.parents[1] / "scripts" / "train_tokenizer.py"
    spec = importlib.util.spec_from_file_location("train_tokenizer", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.train(vocab_size=1536, output_dir=tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tmp_path / name).read_bytes() == (TOKENIZER_DIR / name).read_bytes(), name
