"""The BFCL side of logitdiff's bridge to the Berkeley Function Calling Leaderboard.

Run by the python of BFCL's own venv (``scripts/setup_bfcl.sh``), never imported by
logitdiff: ``python -I bfcl_runner.py``, one process per grading session, JSON lines on
stdin/stdout (one request, one reply). It imports nothing of logitdiff, and logitdiff
imports nothing of it; :mod:`logitdiff.workload.bfcl` starts it and speaks the protocol:

``{"op": "load", "category": C}``
    -> ``{"ok": true, "items": [{"id", "messages", "tools", "ground_truth", "names"}]}``: the
    category's entries as BFCL's generation step loads them (``load_dataset_entry``, with
    its language hint), ``messages`` the question's first turn, ``tools`` the functions
    through BFCL's own conversion for OpenAI function-calling models (``convert_to_tool``
    with ``GORILLA_TO_OPENAPI``, ``ModelStyle.OPENAI_COMPLETIONS``: ``dict`` -> ``object``,
    ``float`` -> ``number``, ``.`` in names -> ``_``), ``ground_truth`` the possible
    answer's list (None for irrelevance), ``names`` each function's name -> its tool's name.
``{"op": "grade", "category": C, "id": ID, "result": R}``
    -> ``{"ok": true, "valid": bool, "error": [str], "error_type": str, "decoded": ...}``:
    BFCL's own evaluation of one entry (``eval_runner._evaluate_single_ast_entry``, or
    ``_evaluate_single_relevance_entry`` for irrelevance), given ``R`` in the form BFCL
    stores an OpenAI function-calling model's result: ``[{name: arguments_json}]`` when the
    model called tools, its text otherwise. BFCL's OpenAI handler's ``decode_ast`` decodes
    it, exactly as ``bfcl evaluate`` would.

Anything that goes wrong answers ``{"ok": false, "error": one line}``. BFCL prints while
importing, so the protocol uses a duplicate of the original stdout and fd 1 points at stderr.
"""

import json
import os
import sys
import traceback

# the OpenAI function-calling model whose checker settings apply: tools offered with "." in
# names turned to "_" (BFCL's convert_to_tool for OpenAI), so the checker must map them back
CHECKER_MODEL = "gpt-4o-2024-11-20-FC"
IRRELEVANCE = ("irrelevance", "live_irrelevance")


def _open_protocol():
    out = os.fdopen(os.dup(1), "w", encoding="utf-8", buffering=1)
    os.dup2(2, 1)  # whatever BFCL or its SDKs print goes to stderr, not into the protocol
    sys.stdout = sys.stderr
    return out


class Bfcl:
    def __init__(self):
        from bfcl_eval.constants.enums import Language, ModelStyle, ReturnFormat
        from bfcl_eval.constants.model_config import MODEL_CONFIG_MAPPING
        from bfcl_eval.constants.type_mappings import GORILLA_TO_OPENAPI
        from bfcl_eval.eval_checker import eval_runner
        from bfcl_eval.model_handler.api_inference.openai_completion import OpenAICompletionsHandler
        from bfcl_eval.model_handler.utils import convert_to_tool
        from bfcl_eval.utils import load_dataset_entry, load_ground_truth_entry

        if not MODEL_CONFIG_MAPPING[CHECKER_MODEL].underscore_to_dot:
            raise RuntimeError(f"{CHECKER_MODEL}: BFCL no longer maps '_' back to '.' for it")
        self.runner = eval_runner
        self.language, self.return_format = Language.PYTHON, ReturnFormat.PYTHON
        self.load_entries, self.load_truth = load_dataset_entry, load_ground_truth_entry
        self.to_tools = lambda functions: convert_to_tool(functions, GORILLA_TO_OPENAPI, ModelStyle.OPENAI_COMPLETIONS)

        class OpenAIFunctionCallingDecoder:
            """BFCL's OpenAI handler's decode_ast, without the API client its constructor opens."""

            is_fc_model = True
            decode_ast = OpenAICompletionsHandler.decode_ast

        self.decoder = OpenAIFunctionCallingDecoder()
        self.graded = {}  # category -> ({id: the entry as the evaluator loads it}, {id: possible answer})

    def load(self, category):
        entries = self.load_entries(category, include_prereq=False)
        truth = {} if category in IRRELEVANCE else {t["id"]: t["ground_truth"] for t in self.load_truth(category)}
        items = []
        for e in entries:
            if e["id"] not in truth and category not in IRRELEVANCE:
                raise RuntimeError(f"{category}: entry {e['id']!r} has no possible answer")
            tools = self.to_tools(e["function"])
            items.append({"id": e["id"], "messages": e["question"][0], "tools": tools, "ground_truth": truth.get(e["id"]),
                          "names": {f["name"]: t["function"]["name"] for f, t in zip(e["function"], tools)}})
        return {"items": items}

    def _graded(self, category):
        if category not in self.graded:
            # as bfcl evaluate loads them: no language hint in the function docs
            entries = self.load_entries(category, include_prereq=False, include_language_specific_hint=False)
            truth = {} if category in IRRELEVANCE else {t["id"]: t["ground_truth"] for t in self.load_truth(category)}
            self.graded[category] = ({e["id"]: e for e in entries}, truth)
        return self.graded[category]

    def grade(self, category, item_id, result):
        entries, truth = self._graded(category)
        if item_id not in entries:
            raise RuntimeError(f"{category}: no entry {item_id!r}")
        if category in IRRELEVANCE:
            r = self.runner._evaluate_single_relevance_entry(self.decoder, item_id, result, entries[item_id],
                                                              CHECKER_MODEL, category)
        else:
            r = self.runner._evaluate_single_ast_entry(self.decoder, item_id, result, truth[item_id], entries[item_id],
                                                        CHECKER_MODEL, category, language=self.language,
                                                        return_format=self.return_format, has_tool_call_tag=False)
        decoded = r.get("model_result_decoded", r.get("decoded_result"))
        return {"valid": bool(r["valid"]), "error": [str(x) for x in r.get("error", [])],
                "error_type": str(r.get("error_type", "")), "decoded": decoded if isinstance(decoded, list) else None}


def main():
    protocol = _open_protocol()
    try:
        bfcl = Bfcl()
        protocol.write(json.dumps({"ok": True, "ready": True}) + "\n")
    except Exception as e:
        traceback.print_exc()
        protocol.write(json.dumps({"ok": False, "error": f"bfcl_eval does not import: {type(e).__name__}: {e}"}) + "\n")
        return 1
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            if req.get("op") == "load":
                reply = bfcl.load(req["category"])
            elif req.get("op") == "grade":
                reply = bfcl.grade(req["category"], req["id"], req["result"])
            else:
                raise RuntimeError(f"unknown op {req.get('op')!r}")
            reply["ok"] = True
        except Exception as e:
            traceback.print_exc()
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        protocol.write(json.dumps(reply) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
