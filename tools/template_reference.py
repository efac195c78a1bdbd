#!/usr/bin/env python3
"""Golden chat-template renders for `crates/lily-template` (the reference Lily must match byte for byte).

For every test checkpoint directory in `crates/lily-template/tests/data/models/` and every OpenAI chat request in
`crates/lily-template/tests/data/requests/*.json`, this renders the prompt with transformers' own machinery,
`AutoTokenizer.from_pretrained(dir).apply_chat_template(..., tokenize=False)`, after the same request
preprocessing that Lily (and vLLM) does, and writes

    tests/data/expected/<model>/<request>.txt          the prompt text, or
    tests/data/expected/<model>/<request>.error.json   {"kind": ..., "message": ...} when rendering fails:
        kind "raise_exception": the template called raise_exception(message) (jinja2 TemplateError itself)
        kind "template":        another error while rendering (undefined attribute, type error, ...)
        kind "request":         the request was rejected before rendering (empty conversation, ...)

It also (re)writes the test checkpoint directories themselves, so everything derives from:
    crates/lily-template/src/qwen3_6.jinja              the built-in (official Qwen3.6) template
    crates/lily-template/tests/data/templates/*.jinja   the Lily test templates
    tests/fixtures/tiny-a/hf/tokenizer.json             a small tokenizer, only so that AutoTokenizer loads

Model directories:
    builtin  tokenizer_config.json without a chat template (Lily falls back to its built-in Qwen3.6 template;
             the reference passes that text as `chat_template=`)
    qwen36   tokenizer_config.json whose "chat_template" is the official Qwen3.6 template, plus the model-specific
             `*_token` entries the real Qwen3.6 config has (they become template variables)
    qwen35   chat_template.jinja with the official Qwen3.5 template (differs from 3.6: no preserve_thinking, and
             non-string tool arguments go through `|string`, i.e. Python str(): True/None/1e-05), next to a
             tokenizer_config.json whose own (wrong) "chat_template" must lose to chat_template.jinja
    variant  tokenizer_config.json with the list-of-{name, template} form ("default" and "tool_use"), an
             AddedToken-style bos_token, and a Lily test template exercising many Jinja features

Usage: python3 tools/template_reference.py   (transformers 5.24, jinja2 3.1.6; CPU only, deterministic)
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import jinja2
import transformers
from transformers import AutoTokenizer

ROOT = Path(__file__).resolve().parent.parent
CRATE = ROOT / "crates" / "lily-template"
DATA = CRATE / "tests" / "data"
TOKENIZER_JSON = ROOT / "tests" / "fixtures" / "tiny-a" / "hf" / "tokenizer.json"

QWEN36 = (CRATE / "src" / "qwen3_6.jinja").read_text(encoding="utf-8")


def qwen35_template() -> str:
    """The official Qwen3.5 template (Qwen/Qwen3.5-27B tokenizer_config.json, as quoted verbatim in public code):
    identical to the Qwen3.6 one except for these two lines."""
    t = QWEN36
    swaps = [
        (
            "{%- if (preserve_thinking is defined and preserve_thinking is true) or (loop.index0 > ns.last_query_index) %}",
            "{%- if loop.index0 > ns.last_query_index %}",
        ),
        (
            "{%- set args_value = args_value | string if args_value is string else args_value | tojson | safe %}",
            "{%- set args_value = args_value | tojson | safe if args_value is mapping or (args_value is sequence and args_value is not string) else args_value | string %}",
        ),
    ]
    for old, new in swaps:
        assert t.count(old) == 1, old
        t = t.replace(old, new)
    return t.rstrip("\n")  # as stored in tokenizer_config.json: no trailing newline


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")


def build_models() -> dict[str, str | None]:
    """Writes tests/data/models/*; returns {model: chat_template to pass explicitly, or None}."""
    models = DATA / "models"
    if models.exists():
        shutil.rmtree(models)
    base = {
        "backend": "tokenizers",
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "model_max_length": 262144,
        "pad_token": "<|endoftext|>",
        "tokenizer_class": "TokenizersBackend",
    }

    def make(name: str, config: dict, files: dict[str, str] | None = None) -> None:
        d = models / name
        d.mkdir(parents=True)
        write_json(d / "tokenizer_config.json", config)
        shutil.copyfile(TOKENIZER_JSON, d / "tokenizer.json")
        for fname, text in (files or {}).items():
            (d / fname).write_text(text, encoding="utf-8")

    make("builtin", dict(base))
    make(
        "qwen36",
        {
            **base,
            "chat_template": QWEN36,
            "audio_bos_token": "<|audio_start|>",
            "audio_eos_token": "<|audio_end|>",
            "audio_token": "<|audio_pad|>",
            "image_token": "<|image_pad|>",
            "video_token": "<|video_pad|>",
            "vision_bos_token": "<|vision_start|>",
            "vision_eos_token": "<|vision_end|>",
        },
    )
    make(
        "qwen35",
        {**base, "chat_template": "WRONG: chat_template.jinja takes priority over this"},
        {"chat_template.jinja": qwen35_template()},
    )
    variant = (DATA / "templates" / "variant.jinja").read_text(encoding="utf-8")
    tool_use = (DATA / "templates" / "variant_tool_use_header.jinja").read_text(encoding="utf-8") + variant
    make(
        "variant",
        {
            **base,
            "bos_token": {
                "__type": "AddedToken",
                "content": "<|bos|>",
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            },
            "unk_token": None,
            "chat_template": [
                {"name": "default", "template": variant},
                {"name": "tool_use", "template": tool_use},
            ],
        },
    )
    return {"builtin": QWEN36, "qwen36": None, "qwen35": None, "variant": None}


def write_random_requests(n: int = 40, seed: int = 20250301) -> None:
    """Writes requests/rNN_random.json: seeded random conversations (system/developer, multi-part content, tools,
    tool calls with string or object arguments of every JSON type, several tool results, reasoning in history as
    reasoning_content or a <think> split, both kwargs, with and without the generation prompt, prefills)."""
    import random

    rng = random.Random(seed)
    words = [
        "alpha", "Zürich", "東京", "naïve", "<tag>", "a & b", "it's", '"quoted"', "back\\slash", "🚀", "tab\there",
        "new\nline", "  padded  ", "</think>", "<tool_response>", "{json}", "100%", "Ωmega", "مرحبا", "x",
    ]

    def text(lo=1, hi=8):
        return " ".join(rng.choice(words) for _ in range(rng.randint(lo, hi)))

    def value(depth=0):
        kinds = ["str", "int", "float", "bool", "null", "list", "dict"] if depth < 2 else ["str", "int", "float", "bool"]
        k = rng.choice(kinds)
        if k == "str":
            return text(0, 4)
        if k == "int":
            return rng.choice([0, 1, -7, 42, 2**40, 10**15])
        if k == "float":
            return rng.choice([0.5, 3.0, -2.25, 1e-06, 123456.789, 1e17, 0.1])
        if k == "bool":
            return rng.random() < 0.5
        if k == "null":
            return None
        if k == "list":
            return [value(depth + 1) for _ in range(rng.randint(0, 3))]
        return {rng.choice(["k", "key", "ключ", "b", "a"]) + str(i): value(depth + 1) for i in range(rng.randint(0, 3))}

    tool_pool = [
        {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city <today> & 'tomorrow'",
         "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "default": 1}},
                        "required": ["city"]}}},
        {"type": "function", "function": {"name": "run_sql", "description": "Run SQL; returns rows as JSON ✓",
         "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "params": {"type": "array", "items": {}},
                        "opts": {"type": "object", "properties": {"timeout": {"type": "number", "default": 2.5}}}}}}},
        {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}},
        {"type": "function", "function": {"name": "mixed_order", "parameters": {"type": "object", "required": ["z"],
         "properties": {"z": {"enum": ["a", 1, None, True]}}}, "description": "Mixed enum."}},
    ]

    def content(allow_parts=True):
        if allow_parts and rng.random() < 0.25:
            return [{"type": "text", "text": text()} for _ in range(rng.randint(1, 3))]
        return text()

    for old in (DATA / "requests").glob("r*_random.json"):
        old.unlink()
    for i in range(1, n + 1):
        messages = []
        r = rng.random()
        if r < 0.45:
            messages.append({"role": "system", "content": content()})
        elif r < 0.5:
            messages.append({"role": "developer", "content": text()})
        tools = rng.sample(tool_pool, rng.randint(1, len(tool_pool))) if rng.random() < 0.5 else None
        call_id = 0
        for _turn in range(rng.randint(1, 3)):
            messages.append({"role": "user", "content": content()})
            for _step in range(rng.randint(0, 2)):
                msg = {"role": "assistant", "content": text(0, 6) if rng.random() < 0.7 else None}
                rr = rng.random()
                if rr < 0.35:
                    msg["reasoning_content"] = text(0, 6)
                elif rr < 0.5 and msg["content"] is not None:
                    msg["content"] = "<think>\n" + text() + "\n</think>\n\n" + msg["content"]
                calls = []
                if tools and rng.random() < 0.6:
                    for _c in range(rng.randint(1, 3)):
                        call_id += 1
                        args = {rng.choice(["city", "query", "params", "opts", "z", "n"]) + str(j): value()
                                for j in range(rng.randint(0, 3))}
                        calls.append({"id": f"call_{call_id}", "type": "function", "function": {
                            "name": rng.choice(tools)["function"]["name"],
                            "arguments": json.dumps(args, ensure_ascii=rng.random() < 0.5) if rng.random() < 0.6 else args}})
                    msg["tool_calls"] = calls
                messages.append(msg)
                for c in calls:
                    messages.append({"role": "tool", "tool_call_id": c["id"], "content": content()})
        body = {"messages": messages}
        if tools is not None:
            body["tools"] = tools
        kwargs = {}
        for name in ("enable_thinking", "preserve_thinking"):
            x = rng.random()
            if x < 0.3:
                kwargs[name] = True
            elif x < 0.6:
                kwargs[name] = False
        if kwargs:
            body["chat_template_kwargs"] = kwargs
        if messages[-1]["role"] == "assistant" and rng.random() < 0.3 and isinstance(messages[-1].get("content"), str):
            body["add_generation_prompt"] = False
            body["continue_final_message"] = True
        elif rng.random() < 0.2:
            body["add_generation_prompt"] = False
        write_json(DATA / "requests" / f"r{i:02d}_random.json", body)


class RequestError(ValueError):
    pass


def preprocess_messages(messages: list) -> list:
    """vLLM's `_postprocess_messages` (vllm/entrypoints/chat_utils): assistant tool-call `arguments` given as JSON
    strings become objects; null/empty arguments, invalid JSON and JSON that is not an object become {}; an empty
    `tool_calls` list is dropped. (Null fields are dropped by apply_chat_template itself.)"""
    out = json.loads(json.dumps(messages))  # deep copy, order kept
    for m in out:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError("each message must be an object with a string 'role'")
        if m["role"] != "assistant" or "tool_calls" not in m:
            continue
        calls = m["tool_calls"]
        if not isinstance(calls, list):
            continue
        if not calls:
            m.pop("tool_calls")
            continue
        for item in calls:
            if not isinstance(item, dict):
                raise RequestError("assistant tool_calls entries must be objects")
            fn = item.get("function")
            if item.get("type", "function") != "function" or not isinstance(fn, dict):
                raise RequestError("only tool_calls of type 'function' are supported")
            args = fn.get("arguments")
            if args:
                if not isinstance(args, dict):
                    if isinstance(args, str):
                        try:
                            args = json.loads(args)
                        except json.JSONDecodeError:
                            args = None
                    if not isinstance(args, dict):
                        args = {}
                fn["arguments"] = args
            else:
                fn["arguments"] = {}
    return out


def render(tok, chat_template: str | None, body: dict):
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise RequestError("request has no 'messages' array")
    messages = preprocess_messages(messages)
    kwargs = dict(body.get("chat_template_kwargs") or {})
    return tok.apply_chat_template(
        messages,
        tools=body.get("tools"),
        documents=body.get("documents"),
        chat_template=chat_template,
        add_generation_prompt=kwargs.pop("add_generation_prompt", body.get("add_generation_prompt", True)),
        continue_final_message=kwargs.pop("continue_final_message", body.get("continue_final_message", False)),
        tokenize=False,
        **kwargs,
    )


def main() -> int:
    print(f"transformers {transformers.__version__}, jinja2 {jinja2.__version__}")
    explicit = build_models()
    write_random_requests()
    requests = sorted((DATA / "requests").glob("*.json"))
    expected = DATA / "expected"
    if expected.exists():
        shutil.rmtree(expected)
    counts = {"ok": 0, "error": 0}
    for model, chat_template in explicit.items():
        tok = AutoTokenizer.from_pretrained(str(DATA / "models" / model))
        outdir = expected / model
        outdir.mkdir(parents=True)
        for req in requests:
            body = json.loads(req.read_text(encoding="utf-8"))
            try:
                text = render(tok, chat_template, body)
            except jinja2.exceptions.TemplateError as e:
                kind = "raise_exception" if type(e) is jinja2.exceptions.TemplateError else "template"
                err = {"kind": kind, "message": str(e)}
            except (RequestError, ValueError) as e:
                err = {"kind": "request", "message": str(e)}
            except (TypeError, AttributeError, KeyError, IndexError) as e:
                err = {"kind": "template", "message": f"{type(e).__name__}: {e}"}
            else:
                (outdir / f"{req.stem}.txt").write_bytes(text.encode("utf-8"))
                counts["ok"] += 1
                continue
            write_json(outdir / f"{req.stem}.error.json", err)
            counts["error"] += 1
            print(f"  {model}/{req.stem}: {err['kind']}: {err['message'][:100]}")
    print(f"{len(requests)} requests x {len(explicit)} models: {counts['ok']} rendered, {counts['error']} errors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
