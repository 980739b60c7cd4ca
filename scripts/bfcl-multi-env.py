#!/usr/bin/env python3
"""The official BFCL-v4 multi-turn environments and checker behind JSON Lines, for envace.

Run with the interpreter of .cache/bfcl/venv (scripts/fetch-bfcl builds it): one request per
line on stdin, one reply per line on stdout, nothing else on stdout (whatever the environments
print goes to stderr). Every reply has "ok"; a failed request answers {"ok": false, "error"}
and the bridge reads on.

Ops:
  {"op": "reset", "entry": {"id", "initial_config", "involved_classes"}}
      -> {"ok": true, "classes": [...]}
      Fresh instances of the entry's classes, loaded with its initial_config, made by the
      official `multi_turn_utils.execute_multi_turn_func_call` (called with no calls).
  {"op": "execute", "calls": [{"name", "arguments": {...}}]}
      -> {"ok": true, "results": ["...", ...]}
      One step's calls, converted to call strings by the official FC decoder
      (`model_handler.utils.convert_to_function_call`) and run by
      `execute_multi_turn_func_call` on the instances of the last reset: the result strings
      are the ones the official inference feeds back to a model. A call whose name or argument
      names are not identifiers is not run; its result is "Error during execution: ..." (ours).
  {"op": "score", "entry": {...}, "turns": [[[call, ...], ...], ...], "ground_truth": [[str]]}
      -> {"ok": true, "valid": bool, "error_type"?, "error_message"?, "turn"?, "details"?}
      A whole entry: per turn, per step, the calls made. Scored as the official eval runner's
      `_evaluate_single_multi_turn_entry` does (its few lines are repeated here because
      eval_runner imports pandas, which the venv does not hold): a turn count that differs from
      the ground truth's is a forced termination; calls that are not identifiers' calls and
      steps left empty are dropped; then
      the official `multi_turn_checker.multi_turn_checker` (state and response checks).
  {"op": "functions", "entry": {"id", "involved_classes", "missed_function"?}}
      -> {"ok": true, "function": [doc, ...], "missed_function": {turn: [doc, ...]},
          "additional_functions_prompt": "..."}
      What the official inference offers the model: the entry after bfcl_eval's
      `populate_test_cases_with_predefined_functions` (the classes' function docs, less those a
      miss_func entry holds back until a later turn), and the user message of such a turn
      (`DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC`). For conformance tests.
  {"op": "state"} -> {"ok": true, "state": {class: {attribute: value}}}
      The public attributes of the live instances (what the state check compares).
  {"op": "ground_truth_calls", "entry": {...}, "ground_truth": [[str]]}
      -> {"ok": true, "turns": [[call, ...], ...]}
      The ground truth's call strings as named-argument calls (positional arguments named
      from the method's signature), so they can be recorded and replayed as answers.

The official executor keeps its instances in `multi_turn_utils`' module globals, named by model,
entry id and class; a reset drops every such instance and a score drops the checker's own (not
the live ones), so an entry can be run and scored any number of times in one process. Builtins
are shadowed in that module so that a call can only reach the environments (guard_builtins).
"""

import ast
import copy
import importlib
import inspect
import json
import re
import sys
import traceback

PROTO = sys.stdout
sys.stdout = sys.stderr  # the environments print; keep the protocol channel clean

from bfcl_eval.constants.default_prompts import (  # noqa: E402
    DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC,
)
from bfcl_eval.constants.executable_backend_config import CLASS_FILE_PATH_MAPPING  # noqa: E402
from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils  # noqa: E402
from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import (  # noqa: E402
    multi_turn_checker,
)
from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_utils import (  # noqa: E402
    execute_multi_turn_func_call,
    is_empty_execute_response,
)
from bfcl_eval.model_handler.utils import convert_to_function_call  # noqa: E402
from bfcl_eval.utils import populate_test_cases_with_predefined_functions  # noqa: E402

MODEL = "envace"


class BridgeError(Exception):
    pass


def drop_instances(prefixes=("",)):
    g = vars(multi_turn_utils)
    for name in [n for n in g if n.endswith("_instance") and n.startswith(prefixes)]:
        del g[name]


def guard_builtins():
    """The official executor `eval`s `name(k=repr(v), ...)` in multi_turn_utils' globals, so a
    model could call `open(file=..., mode='w')`. Every builtin that module's own code does not
    use is shadowed there by a function raising the NameError an unknown name gives: such a call
    answers `Error during execution: name 'open' is not defined`, as an unknown name does.
    The environments' methods and the module's own code are untouched."""
    import builtins
    import types

    used = set()

    def names(code):
        used.update(code.co_names)
        for c in code.co_consts:
            if isinstance(c, types.CodeType):
                names(c)

    for obj in vars(multi_turn_utils).values():
        if isinstance(obj, types.FunctionType) and obj.__module__ == multi_turn_utils.__name__:
            names(obj.__code__)
    g = vars(multi_turn_utils)
    for name in dir(builtins):
        if name in used or name in g or not callable(getattr(builtins, name)):
            continue

        def refuse(*_args, _name=name, **_kwargs):
            raise NameError(f"name '{_name}' is not defined")

        g[name] = refuse


def long_context(entry_id):
    category = entry_id.rsplit("_", 1)[0]
    return "long_context" in category or "composite" in category


def need(obj, key, kind):
    if key not in obj:
        raise BridgeError(f"missing field `{key}`")
    if not isinstance(obj[key], kind):
        raise BridgeError(f"field `{key}` must be {kind.__name__}")
    return obj[key]


def call_string(c):
    """One call as the official FC decoder (`convert_to_function_call`) writes it. The name and
    argument names must be plain identifiers (the executor `eval`s the string); a call that
    is not one raises BridgeError, and the caller answers it as a failed call."""
    if not isinstance(c, dict) or not isinstance(c.get("name"), str):
        raise BridgeError("a call needs a string `name`")
    args = c.get("arguments", {})
    if not isinstance(args, dict):
        raise BridgeError(f"`{c['name']}`: `arguments` must be an object")
    if not c["name"].isidentifier() or not all(
        isinstance(k, str) and k.isidentifier() for k in args
    ):
        raise BridgeError(f"`{c['name']}`: function and argument names must be identifiers")
    return convert_to_function_call([{c["name"]: args}])[0]


def summarize(verdict):
    """The checker's verdict without the instance dumps: valid, error_type, error_message, the
    failing turn (`turn`; a state mismatch names none, its execution_result has one item per
    turn checked) and the differences or missing results."""
    out = {"valid": bool(verdict.get("valid"))}
    if out["valid"]:
        return out
    out["error_type"] = verdict.get("error_type", "")
    out["error_message"] = verdict.get("error_message", "")
    m = re.search(r"for turn (\d+)", out["error_message"])
    if m:
        out["turn"] = int(m.group(1))
    elif isinstance(verdict.get("execution_result"), list):
        out["turn"] = len(verdict["execution_result"]) - 1
    details = verdict.get("details") or {}
    kept = {k: details[k] for k in ("differences", "missing_items") if k in details}
    if kept:
        out["details"] = json.loads(json.dumps(kept, default=repr))
    return out


class Bridge:
    def __init__(self):
        self.entry = None

    def reset(self, req):
        entry = need(req, "entry", dict)
        need(entry, "id", str)
        classes = need(entry, "involved_classes", list)
        for c in classes:
            if c not in CLASS_FILE_PATH_MAPPING:
                raise BridgeError(f"unknown class `{c}` in involved_classes")
        drop_instances()
        self.entry = entry
        self.execute_strings([])
        return {"classes": classes}

    def execute_strings(self, strings):
        e = self.entry
        results, _ = execute_multi_turn_func_call(
            func_call_list=strings,
            initial_config=e.get("initial_config", {}),
            involved_classes=e["involved_classes"],
            model_name=MODEL,
            test_entry_id=e["id"],
            long_context=long_context(e["id"]),
            is_evaL_run=False,
        )
        return results

    def execute(self, req):
        if self.entry is None:
            raise BridgeError("execute before reset")
        results = []
        for c in need(req, "calls", list):
            try:
                s = call_string(c)
            except BridgeError as e:
                # the model's call, not the request, is malformed: a result, as BFCL's are
                results.append(f"Error during execution: {e}")
                continue
            results.extend(self.execute_strings([s]))
        return {"results": results}

    def score(self, req):
        entry = need(req, "entry", dict)
        entry_id = need(entry, "id", str)
        need(entry, "involved_classes", list)
        turns = need(req, "turns", list)
        truth = need(req, "ground_truth", list)
        if len(turns) != len(truth):
            return {
                "valid": False,
                "turn": min(len(turns), len(truth)),
                "error_message": (
                    "Model was force-terminated during inference phase. The length of the "
                    f"model result turns ({len(turns)}) does not match the length of the "
                    f"ground truth turns ({len(truth)})."
                ),
                "error_type": "multi_turn:force_terminated",
            }
        decoded = []
        for turn in turns:
            if not isinstance(turn, list):
                raise BridgeError("each turn must be a list of steps")
            steps = []
            for step in turn:
                if not isinstance(step, list):
                    raise BridgeError("each step must be a list of calls")
                strings = []
                for c in step:
                    try:
                        strings.append(call_string(c))
                    except BridgeError:
                        continue  # can only fail to run: changes no state, matches no result
                if is_empty_execute_response(strings):
                    continue  # as the official runner: an empty step is not a response
                steps.append(strings)
            decoded.append(steps)
        # the checker's instances are named `<MODEL>_eval_…` and `<MODEL>_ground_truth_eval_…`;
        # the live ones (`<MODEL>_multi_turn_…`) are kept: scoring leaves the live state alone
        scoring = (f"{MODEL}_eval_", f"{MODEL}_ground_truth_eval_")
        drop_instances(scoring)
        try:
            verdict = multi_turn_checker(
                decoded, truth, copy.deepcopy(entry), entry_id.rsplit("_", 1)[0], MODEL
            )
        finally:
            drop_instances(scoring)
        return summarize(verdict)

    def state(self, _req):
        if self.entry is None:
            raise BridgeError("state before reset")
        g = vars(multi_turn_utils)
        out = {}
        for c in self.entry["involved_classes"]:
            name = re.sub(r"[-./:]", "_", f"{MODEL}_{self.entry['id']}_{c}_instance")
            inst = g.get(name)
            out[c] = None if inst is None else {
                k: v for k, v in vars(inst).items() if not k.startswith("_")
            }
        return {"state": json.loads(json.dumps(out, default=repr))}

    def functions(self, req):
        entry = copy.deepcopy(need(req, "entry", dict))
        need(entry, "id", str)
        need(entry, "involved_classes", list)
        populate_test_cases_with_predefined_functions([entry])
        return {
            "function": entry["function"],
            "missed_function": entry.get("missed_function", {}),
            "additional_functions_prompt": DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC,
        }

    def ground_truth_calls(self, req):
        entry = need(req, "entry", dict)
        classes = need(entry, "involved_classes", list)
        truth = need(req, "ground_truth", list)
        methods = {}
        for c in classes:
            if c not in CLASS_FILE_PATH_MAPPING:
                raise BridgeError(f"unknown class `{c}` in involved_classes")
            cls = getattr(importlib.import_module(CLASS_FILE_PATH_MAPPING[c]), c)
            for name, fn in inspect.getmembers(cls, predicate=inspect.isfunction):
                if not name.startswith("_"):
                    methods[name] = fn
        turns = []
        for t, turn in enumerate(truth):
            calls = []
            for s in turn:
                try:
                    node = ast.parse(s, mode="eval").body
                except SyntaxError as e:
                    raise BridgeError(f"turn {t}: `{s}`: {e}") from None
                if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
                    raise BridgeError(f"turn {t}: `{s}` is not a plain call")
                name = node.func.id
                if name not in methods:
                    raise BridgeError(f"turn {t}: `{name}` is no method of {classes}")
                params = [p for p in inspect.signature(methods[name]).parameters if p != "self"]
                args = {}
                for i, a in enumerate(node.args):
                    args[params[i]] = ast.literal_eval(a)
                for k in node.keywords:
                    args[k.arg] = ast.literal_eval(k.value)
                calls.append({"name": name, "arguments": args})
            turns.append(calls)
        return {"turns": turns}


def main():
    guard_builtins()
    bridge = Bridge()
    ops = {
        "reset": bridge.reset,
        "execute": bridge.execute,
        "score": bridge.score,
        "ground_truth_calls": bridge.ground_truth_calls,
        "functions": bridge.functions,
        "state": bridge.state,
    }
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            if not isinstance(req, dict) or req.get("op") not in ops:
                raise BridgeError(f"unknown op (known: {', '.join(ops)})")
            reply = {"ok": True, **ops[req["op"]](req)}
        except BridgeError as e:
            reply = {"ok": False, "error": str(e)}
        except Exception as e:  # the official code raised: report it, keep serving
            traceback.print_exc(file=sys.stderr)
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        PROTO.write(json.dumps(reply, default=repr) + "\n")
        PROTO.flush()


if __name__ == "__main__":
    main()
