"""Train the project's small byte-level BPE tokenizer and save it into model/tokenizer/.

The corpus is the shipped text file model/tokenizer/corpus.txt plus deterministic synthetic text
(arithmetic, JSON, Python, chat transcripts with tool calls), so the calculator/python/retrieval
tool traffic tokenises compactly. Run: python scripts/train_tokenizer.py [--vocab-size 1536]
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Iterator
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

REPO_ROOT = Path(__file__).resolve().parents[1]
TOKENIZER_DIR = REPO_ROOT / "model" / "tokenizer"
CORPUS_FILE = TOKENIZER_DIR / "corpus.txt"

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Control tokens: stripped by decode(skip_special_tokens=True).
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END]
# Tool-call markup: single ids, but kept in decoded text so tool parsers can see them.
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

# ChatML. Tools go into the system prompt as one-line signatures (`name(arg: type, opt?: type): description`,
# short enough for the tiny model's context); assistant tool calls render
# as <tool_call>{"name": ..., "arguments": {...}}</tool_call>; tool results as role "tool".
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools' }}"
    "{%- for tool in tools %}"
    "{%- if tool.function is defined %}{%- set tool = tool.function %}{%- endif %}"
    "{%- set params = tool.parameters.properties if tool.parameters is defined and tool.parameters.properties "
    "is defined else {} %}"
    "{%- set required = tool.parameters.required if tool.parameters is defined and tool.parameters.required "
    "is defined else [] %}"
    "{{- '\\n' + tool.name + '(' }}"
    "{%- for name, schema in params.items() %}"
    "{{- (', ' if not loop.first else '') ~ name ~ ('' if name in required else '?') ~ ': ' "
    "~ ('any' if schema.type is not defined else schema.type if schema.type is string "
    "else schema.type | join('|')) }}"
    "{%- endfor %}"
    "{{- ')' ~ (': ' ~ tool.description if tool.description is defined else '') }}"
    "{%- endfor %}"
    "{{- '\\nCall a tool as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>.<|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}"
    "{%- if not loop.first %}"
    "{{- '<|im_start|>system\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- elif message['role'] == 'user' %}"
    "{{- '<|im_start|>user\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message['content'] %}{{- message['content'] }}{%- endif %}"
    "{%- if message['tool_calls'] is defined and message['tool_calls'] %}"
    "{%- for tool_call in message['tool_calls'] %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{%- if (message['content'] and loop.first) or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
    "{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}</tool_call>' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|im_start|>tool\\n<tool_response>' + message['content'] + '</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- raise_exception('unknown message role: ' + message['role']) }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_WORDS = (
    "the a of to and in is for on with as by at from that this it be are was answer result number "
    "document search query tool call python calculator value sum total list file error step first "
    "then next final compute check find return print true false none city year population price"
).split()
_CITIES = ["Paris", "Tokyo", "Ottawa", "Nairobi", "Lima", "Oslo", "Cairo", "Delhi", "Madrid", "Seoul"]


def _tool_call(name: str, arguments: dict) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def _turn(role: str, content: str) -> str:
    return f"{IM_START}{role}\n{content}{IM_END}\n"


def _arithmetic(rng: random.Random) -> tuple[str, str]:
    a, b, c = rng.randint(0, 999), rng.randint(1, 99), rng.randint(0, 9999)
    op1, op2 = rng.choice("+-*/"), rng.choice("+-*")
    expression = f"({a} {op1} {b}) {op2} {c}" if rng.random() < 0.5 else f"{a} {op1} {b}"
    return expression, str(round(eval(expression), 4))  # noqa: S307 - our own generated digits and operators


def _synthetic_documents(rng: random.Random, count: int) -> Iterator[str]:
    for _ in range(count):
        kind = rng.randrange(5)
        if kind == 0:
            expression, value = _arithmetic(rng)
            yield (_turn("user", f"What is {expression}?")
                   + _turn("assistant", _tool_call("calculator", {"expression": expression}))
                   + _turn("tool", f"<tool_response>{value}</tool_response>")
                   + _turn("assistant", f"The answer is {value}."))
        elif kind == 1:
            n = rng.randint(2, 30)
            code = rng.choice([f"print(sum(range({n})))", f"print([i * i for i in range({n})])",
                               f"import math\nprint(math.factorial({n % 12}))", f"print({n} ** 2 % 7)"])
            output = str(eval(code.split("print", 1)[1].split("\n")[0], {"math": __import__("math")}))  # noqa: S307
            yield (_turn("user", f"Use python to compute this for n = {n}.")
                   + _turn("assistant", "Let me run it.\n" + _tool_call("python", {"code": code}))
                   + _turn("tool", f"<tool_response>{output}\n</tool_response>")
                   + _turn("assistant", f"The program printed {output}."))
        elif kind == 2:
            city = rng.choice(_CITIES)
            population = rng.randint(100_000, 20_000_000)
            hits = {"results": [{"doc_id": f"doc-{rng.randint(1, 500)}",
                                 "text": f"{city} has a population of {population:,} people.",
                                 "score": round(rng.random(), 3)}]}
            yield (_turn("user", f"How many people live in {city}?")
                   + _turn("assistant", _tool_call("search", {"query": f"population of {city}", "top_k": 3}))
                   + _turn("tool", "<tool_response>" + json.dumps(hits) + "</tool_response>")
                   + _turn("assistant", f"About {population:,} people live in {city}."))
        elif kind == 3:
            record = {"id": rng.randint(0, 10_000), "name": rng.choice(_WORDS), "score": round(rng.uniform(-5, 5), 3),
                      "tags": rng.sample(_WORDS, 3), "ok": rng.random() < 0.5, "parent": None}
            yield json.dumps(record) + "\n"
        else:
            yield " ".join(rng.choice(_WORDS) for _ in range(rng.randint(8, 30))).capitalize() + ".\n"


def corpus(seed: int = 0, synthetic_documents: int = 20000) -> Iterator[str]:
    """Yield the training text: the shipped file (several passes, it is small) and synthetic documents."""
    text = CORPUS_FILE.read_text(encoding="utf-8")
    for _ in range(4):
        yield from text.split("\n\n")
    yield from _synthetic_documents(random.Random(seed), synthetic_documents)


def _without_tool_markup(text: str) -> str:
    """Tool tags become added tokens after training; keep BPE merges from spending vocabulary on them."""
    for token in TOOL_TOKENS:
        text = text.replace(token, " ")
    return text


def train(vocab_size: int, output_dir: Path) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    # Digits split one by one: arithmetic stays learnable and numbers tokenise predictably.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(TOOL_TOKENS),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tokenizer.train_from_iterator((_without_tool_markup(text) for text in corpus()), trainer=trainer)
    # Tool markup: single ids (the last ones), but not special, so decoded text keeps it for tool parsers.
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in TOOL_TOKENS])
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=PAD_TOKEN,
        eos_token=IM_END,
        unk_token=None,
        bos_token=None,
        additional_special_tokens=[IM_START],
        model_max_length=1 << 20,
        clean_up_tokenization_spaces=False,
    )
    wrapped.chat_template = CHAT_TEMPLATE
    output_dir.mkdir(parents=True, exist_ok=True)
    wrapped.save_pretrained(str(output_dir))
    _write_portable_metadata(output_dir)
    return wrapped


def _write_portable_metadata(output_dir: Path) -> None:
    """Keep the chat template inside tokenizer_config.json and write special_tokens_map.json, so loaders
    of older and newer transformers versions (and vLLM) all find the same template and tokens."""
    config_path = output_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["chat_template"] = CHAT_TEMPLATE
    config["additional_special_tokens"] = [IM_START]
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (output_dir / "chat_template.jinja").unlink(missing_ok=True)
    special_tokens = {"eos_token": IM_END, "pad_token": PAD_TOKEN, "additional_special_tokens": [IM_START]}
    (output_dir / "special_tokens_map.json").write_text(json.dumps(special_tokens, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--vocab-size", type=int, default=1536)
    parser.add_argument("--output-dir", type=Path, default=TOKENIZER_DIR)
    args = parser.parse_args()
    tokenizer = train(args.vocab_size, args.output_dir)
    print(f"saved {len(tokenizer)} tokens to {args.output_dir}")


if __name__ == "__main__":
    main()
