#!/usr/bin/env python3
"""make_golden.py - expected chat-template renderings for tests/test_template.c.

Renders every template in tests/data/templates/ on the conversations in
conversations.json the way HF transformers does
(transformers/utils/chat_template_utils.py: ImmutableSandboxedEnvironment with
trim_blocks, lstrip_blocks and loop controls, a tojson filter that calls
json.dumps with ensure_ascii=False, raise_exception, strftime_now), and writes
expected.json: {template file: {case name: {"out": text} | {"error": msg}}}.

strftime_now uses a fixed instant (conversations.json "now", UTC) so the
output is reproducible; the C test passes the same instant.

    pip install jinja2 && python3 tests/golden/templates/make_golden.py
"""
import json
import os
import sys
from datetime import datetime, timezone

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

HERE = os.path.dirname(os.path.abspath(__file__))


def make_env(now):
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.fromtimestamp(now, tz=timezone.utc).strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def context(case, defaults):
    # transformers: render(messages=, tools=, documents=, add_generation_prompt=,
    # **special_tokens_map, **kwargs) - later keys win, as in the C side.
    ctx = {"messages": case["messages"], "tools": case.get("tools"), "documents": None,
           "add_generation_prompt": case.get("add_generation_prompt", False)}
    ctx.update(defaults)
    ctx.update(case.get("kwargs", {}))
    return ctx


def main():
    tdir = os.path.join(HERE, "..", "..", "data", "templates")
    with open(os.path.join(HERE, "conversations.json"), encoding="utf-8") as f:
        conv = json.load(f)
    env = make_env(conv["now"])
    out = {}
    n_ok = n_err = 0
    for name in sorted(os.listdir(tdir)):
        if not name.endswith(".jinja"):
            continue
        with open(os.path.join(tdir, name), encoding="utf-8", newline="") as f:
            src = f.read()
        tmpl = env.from_string(src)
        res = {}
        for case in conv["cases"]:
            try:
                res[case["name"]] = {"out": tmpl.render(**context(case, conv["defaults"]))}
                n_ok += 1
            except Exception as e:  # raise_exception, undefined errors, type errors
                res[case["name"]] = {"error": f"{type(e).__name__}: {e}"}
                n_err += 1
        out[name] = res
    with open(os.path.join(HERE, "expected.json"), "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, indent=1, sort_keys=True)
        f.write("\n")
    print(f"{len(out)} templates, {n_ok} renderings, {n_err} errors", file=sys.stderr)


if __name__ == "__main__":
    main()
