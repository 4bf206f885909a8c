#!/usr/bin/env python3
"""Writes cases.jsonl: chat requests that cover what chat templates branch on
(system prompts, tools, multi-turn, think blocks, reasoning_content, tool calls
and responses, generation prompt on/off, enable_thinking on/off/absent).
Deterministic: rerunning gives the same file."""
import json
import os

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city — “quoted” & <tagged>",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name, e.g. Zürich or 東京"},
        "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search the web.\nReturns the top results.",
    "parameters": {"type": "object", "properties": {
        "query": {"type": "string"}, "limit": {"type": "integer", "minimum": 1, "maximum": 10.5},
        "filters": {"type": "array", "items": {"type": "string"}}, "safe": {"type": "boolean", "default": True},
        "extra": {"type": "null"}}, "required": ["query"]}}}


def call(name, args, as_string=False):
    return {"type": "function", "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False) if as_string else args}}


def main():
    users = ["Hi!", "What is 2+2?", "Translate 'bonjour' to English.", "  leading and trailing spaces  \n",
             "Unicode: 你好, мир, مرحبا, שלום, नमस्ते, สวัสดี, 🤷🏽‍♀️ e\u0301", "multi\nline\n\ncontent\twith tab",
             "<tool_response>\nnot really\n</tool_response>", ""]
    systems = [None, "You are a helpful assistant.", "Be terse.\n\nAlways answer in JSON.  "]
    cases = []

    def add(messages, **kw):
        cases.append({"messages": messages, **kw})

    # Single and multi-turn plain chats, generation prompt on/off, enable_thinking on/off/absent.
    for i, u in enumerate(users):
        sys_msg = systems[i % len(systems)]
        msgs = ([{"role": "system", "content": sys_msg}] if sys_msg else []) + [{"role": "user", "content": u}]
        for gen in (True, False):
            kw = {"add_generation_prompt": gen}
            if i % 3 == 1:
                kw["enable_thinking"] = False
            elif i % 3 == 2:
                kw["enable_thinking"] = True
            add(msgs, **kw)
    # Multi-turn with assistant think blocks in content and reasoning_content.
    conv = [{"role": "user", "content": "Q1"},
            {"role": "assistant", "content": "<think>\nfirst thought\n</think>\n\nA1"},
            {"role": "user", "content": "Q2"},
            {"role": "assistant", "content": "A2 plain"},
            {"role": "user", "content": "Q3"}]
    for n in range(2, len(conv) + 1):
        for think in (None, False, True):
            kw = {"add_generation_prompt": conv[n - 1]["role"] == "user"}
            if think is not None:
                kw["enable_thinking"] = think
            add(conv[:n], **kw)
    add([{"role": "system", "content": "sys"}, {"role": "user", "content": "Q"},
         {"role": "assistant", "content": "final answer", "reasoning_content": "\nhidden reasoning\n"}],
        add_generation_prompt=False)
    add([{"role": "user", "content": "Q"},
         {"role": "assistant", "content": "answer", "reasoning_content": "r1"},
         {"role": "user", "content": "again"},
         {"role": "assistant", "content": "<think>inline</think>answer 2"}], add_generation_prompt=False)
    add([{"role": "user", "content": "Q"}, {"role": "assistant", "content": "x", "reasoning_content": None}],
        add_generation_prompt=True, enable_thinking=False)
    # Tools: definitions, one and two calls, arguments as objects and as strings, tool responses.
    for tools in ([WEATHER], [WEATHER, SEARCH]):
        for sys_msg in (None, "You can call tools."):
            base = ([{"role": "system", "content": sys_msg}] if sys_msg else [])
            add(base + [{"role": "user", "content": "Weather in Paris?"}], tools=tools, add_generation_prompt=True)
            add(base + [{"role": "user", "content": "Weather in Paris?"},
                        {"role": "assistant", "content": "", "tool_calls": [call("get_weather", {"city": "Paris"})]},
                        {"role": "tool", "content": "{\"temp\": 21, \"sky\": \"clear\"}"}],
                tools=tools, add_generation_prompt=True)
            add(base + [{"role": "user", "content": "Weather in Paris and Tokyo?"},
                        {"role": "assistant", "content": "Checking both.",
                         "tool_calls": [call("get_weather", {"city": "Paris", "unit": "c"}),
                                        call("get_weather", {"city": "東京"}, as_string=True)]},
                        {"role": "tool", "content": "21C"}, {"role": "tool", "content": "18C"},
                        {"role": "assistant", "content": "Paris 21C, Tokyo 18C."},
                        {"role": "user", "content": "Thanks"}],
                tools=tools, add_generation_prompt=True, enable_thinking=False)
    add([{"role": "user", "content": "search"},
         {"role": "assistant", "content": "<think>\nneed search\n</think>\n\n",
          "tool_calls": [{"function": {"name": "search", "arguments": {"query": "dflash", "limit": 3, "safe": False,
                                                                      "filters": ["a", "b"], "extra": None}}}]},
         {"role": "tool", "content": "<tool_response>\nresult\n</tool_response>"}],
        tools=[SEARCH], add_generation_prompt=True, enable_thinking=True)
    add([{"role": "user", "content": "Q"}, {"role": "assistant", "content": None,
                                            "tool_calls": [call("search", {"query": "x"})]}],
        tools=[SEARCH], add_generation_prompt=False)
    # Templates that read other variables.
    add([{"role": "system", "content": "sys"}, {"role": "user", "content": "date?"}], add_generation_prompt=True,
        date_string="01 Jan 2026", tools_in_user_message=False, tools=[WEATHER])
    add([{"role": "user", "content": "code"}], add_generation_prompt=True, builtin_tools=["code_interpreter", "brave_search"],
        tools=None)
    add([{"role": "system", "content": "only a system message"}], add_generation_prompt=True)
    add([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "system", "content": "late system"}],
        add_generation_prompt=True)
    add([], add_generation_prompt=True)
    add([{"role": "user", "content": [{"type": "text", "text": "multimodal parts"}]}], add_generation_prompt=True)
    long = []
    for t in range(8):
        long += [{"role": "user", "content": f"turn {t}"}, {"role": "assistant", "content": f"<think>t{t}</think>reply {t}"}]
    add(long + [{"role": "user", "content": "last"}], add_generation_prompt=True)
    add([{"role": "user", "content": "numbers"},
         {"role": "assistant", "content": "", "tool_calls": [call("search", {"query": "n", "limit": 1e-7, "big": 12345678901234,
                                                                             "neg": -0.5, "nested": {"a": [1, 2.0, {"b": []}]},
                                                                             "empty": {}, "esc": "tab\there \"quote\" \\ /"})]}],
        tools=[SEARCH], add_generation_prompt=False)
    with open(os.path.join(os.path.dirname(__file__), "cases.jsonl"), "w", encoding="utf-8") as f:
        for c in cases:
            f.write(json.dumps(c, ensure_ascii=False) + "\n")
    print(len(cases), "cases")


if __name__ == "__main__":
    main()
