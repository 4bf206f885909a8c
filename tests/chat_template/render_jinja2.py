#!/usr/bin/env python3
"""Renders chat requests with Python jinja2 configured as transformers'
apply_chat_template configures it (the reference for dflash's template engine).

Usage: render_jinja2.py TOKENIZER_DIR < requests.jsonl > rendered.jsonl
Each output line is the rendered text as a JSON string, or {"error": ...}.
"""
import json
import os
import sys
from datetime import datetime

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class AssistantTracker(Extension):
    # {% generation %} ... {% endgeneration %} renders its body unchanged.
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def strftime_now(format):
    return datetime.now().strftime(format)


def load(tokenizer_dir):
    cfg_path = os.path.join(tokenizer_dir, "tokenizer_config.json")
    cfg = json.load(open(cfg_path, encoding="utf-8")) if os.path.exists(cfg_path) else {}
    jinja_path = os.path.join(tokenizer_dir, "chat_template.jinja")
    if os.path.exists(jinja_path):
        source = open(jinja_path, encoding="utf-8").read()
    else:
        source = cfg["chat_template"]
        if isinstance(source, list):
            source = next(t["template"] for t in source if t["name"] == "default")
    special = {}
    for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
        v = cfg.get(key)
        if isinstance(v, dict):
            v = v.get("content")
        if v is not None:
            special[key] = v
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[AssistantTracker, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source), special


def main():
    template, special = load(sys.argv[1])
    for line in sys.stdin:
        req = json.loads(line)
        kwargs = dict(special)
        kwargs.update({"tools": None, "documents": None, "add_generation_prompt": False})
        kwargs.update(req)
        try:
            out = template.render(**kwargs)
        except Exception as e:  # noqa: BLE001 - every failure is reported, not raised
            out = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(out, ensure_ascii=False))


if __name__ == "__main__":
    main()
