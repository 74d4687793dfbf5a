"""The BFCL side of logitdiff's bridge to the Berkeley Function Calling Leaderboard.

Run by the python of BFCL's own venv (``scripts/setup_bfcl.sh``), never imported by
logitdiff: ``python -I bfcl_runner.py``, one process per grading session, JSON lines on
stdin/stdout (one request, one reply). It imports nothing of logitdiff, and logitdiff
imports nothing of it; :mod:`logitdiff.workload.bfcl` starts it and speaks the protocol:

``{"op": "load", "category": C}``
    -> ``{"ok": true, "items": [{"id", "messages", "tools", "prompt_messages", "ground_truth",
    "names"}]}``: the
    category's entries as BFCL's generation step loads them (``load_dataset_entry``, with
    its language hint), ``messages`` the question's first turn, ``tools`` the functions
    through BFCL's own conversion for OpenAI function-calling models (``convert_to_tool``
    with ``GORILLA_TO_OPENAPI``, ``ModelStyle.OPENAI_COMPLETIONS``: ``dict`` -> ``object``,
    ``float`` -> ``number``, ``.`` in names -> ``_``), ``prompt_messages`` the first turn as
    BFCL's prompting mode sends it to a model without function calling (its OSS handler's
    ``_pre_query_processing_prompting``: ``system_prompt_pre_processing_chat_model`` puts
    BFCL's default system prompt, the function docs in its JSON doc format, first),
    ``ground_truth`` the possible answer's list (None for irrelevance), ``names`` each
    function's name -> its tool's name.
``{"op": "grade", "category": C, "id": ID, "result": R, "tool_form": F}``
    -> ``{"ok": true, "valid": bool, "error": [str], "error_type": str, "decoded": ...}``:
    BFCL's own evaluation of one entry (``eval_runner._evaluate_single_ast_entry``, or
    ``_evaluate_single_relevance_entry`` for irrelevance), given ``R`` in the form BFCL
    stores an OpenAI function-calling model's result: ``[{name: arguments_json}]`` when the
    model called tools, its text otherwise. BFCL's OpenAI handler's ``decode_ast`` decodes
    it, exactly as ``bfcl evaluate`` would. With ``F`` = ``"bfcl_prompt"``, ``R`` is the
    model's text answer to the prompting-mode prompt, decoded as BFCL's OSS (prompting)
    handler decodes one (``default_decode_ast_prompting``), the checker set for a prompting
    model (function names as BFCL wrote them, ``.`` kept).

Anything that goes wrong answers ``{"ok": false, "error": one line}``. BFCL prints while
importing, so the protocol uses a duplicate of the original stdout and fd 1 points at stderr.
"""

import copy
import json
import os
import sys
import traceback

# the OpenAI function-calling model whose checker settings apply: tools offered with "." in
# names turned to "_" (BFCL's convert_to_tool for OpenAI), so the checker must map them back
CHECKER_MODEL = "gpt-4o-2024-11-20-FC"
# a prompting-mode model served by BFCL's OSS handler, whose checker settings apply to answers
# to the plain prompt: names as offered (no "_" -> "." mapping), BFCL's default prompting decoder
PROMPTING_CHECKER_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
BFCL_PROMPT = "bfcl_prompt"  # logitdiff's contracts.ToolForm.BFCL_PROMPT (this file imports nothing of logitdiff)
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
        from bfcl_eval.model_handler.local_inference.base_oss_handler import OSSHandler
        from bfcl_eval.model_handler.utils import convert_to_tool, system_prompt_pre_processing_chat_model
        from bfcl_eval.utils import load_dataset_entry, load_ground_truth_entry

        if not MODEL_CONFIG_MAPPING[CHECKER_MODEL].underscore_to_dot:
            raise RuntimeError(f"{CHECKER_MODEL}: BFCL no longer maps '_' back to '.' for it")
        prompting = MODEL_CONFIG_MAPPING[PROMPTING_CHECKER_MODEL]
        if prompting.is_fc_model or prompting.underscore_to_dot or not issubclass(prompting.model_handler, OSSHandler) \
                or prompting.model_handler.decode_ast is not OSSHandler.decode_ast:
            raise RuntimeError(f"{PROMPTING_CHECKER_MODEL}: no longer a prompting model with BFCL's default decoder")
        self.to_prompt = system_prompt_pre_processing_chat_model
        self.runner = eval_runner
        self.language, self.return_format = Language.PYTHON, ReturnFormat.PYTHON
        self.load_entries, self.load_truth = load_dataset_entry, load_ground_truth_entry
        self.to_tools = lambda functions: convert_to_tool(functions, GORILLA_TO_OPENAPI, ModelStyle.OPENAI_COMPLETIONS)

        class OpenAIFunctionCallingDecoder:
            """BFCL's OpenAI handler's decode_ast, without the API client its constructor opens."""

            is_fc_model = True
            decode_ast = OpenAICompletionsHandler.decode_ast

        class PromptingDecoder:
            """BFCL's OSS (prompting) handler's decode_ast, without the server client its constructor opens."""

            is_fc_model = False
            decode_ast = OSSHandler.decode_ast

        self.decoder = OpenAIFunctionCallingDecoder()
        self.prompting_decoder = PromptingDecoder()
        self.graded = {}  # category -> ({id: the entry as the evaluator loads it}, {id: possible answer})

    def load(self, category):
        entries = self.load_entries(category, include_prereq=False)
        truth = {} if category in IRRELEVANCE else {t["id"]: t["ground_truth"] for t in self.load_truth(category)}
        items = []
        for e in entries:
            if e["id"] not in truth and category not in IRRELEVANCE:
                raise RuntimeError(f"{category}: entry {e['id']!r} has no possible answer")
            tools = self.to_tools(e["function"])
            # as the OSS handler's _pre_query_processing_prompting does (it edits the entry in place: a copy)
            prompt = self.to_prompt(copy.deepcopy(e["question"][0]), copy.deepcopy(e["function"]), e["id"])
            items.append({"id": e["id"], "messages": e["question"][0], "tools": tools, "prompt_messages": prompt,
                          "ground_truth": truth.get(e["id"]),
                          "names": {f["name"]: t["function"]["name"] for f, t in zip(e["function"], tools)}})
        return {"items": items}

    def _graded(self, category):
        if category not in self.graded:
            # as bfcl evaluate loads them: no language hint in the function docs
            entries = self.load_entries(category, include_prereq=False, include_language_specific_hint=False)
            truth = {} if category in IRRELEVANCE else {t["id"]: t["ground_truth"] for t in self.load_truth(category)}
            self.graded[category] = ({e["id"]: e for e in entries}, truth)
        return self.graded[category]

    def grade(self, category, item_id, result, tool_form=None):
        entries, truth = self._graded(category)
        if item_id not in entries:
            raise RuntimeError(f"{category}: no entry {item_id!r}")
        prompting = tool_form == BFCL_PROMPT
        if prompting and not isinstance(result, str):
            raise RuntimeError(f"{category} {item_id}: a prompting-mode answer is the model's text")
        decoder = self.prompting_decoder if prompting else self.decoder
        model = PROMPTING_CHECKER_MODEL if prompting else CHECKER_MODEL
        if category in IRRELEVANCE:
            r = self.runner._evaluate_single_relevance_entry(decoder, item_id, result, entries[item_id], model, category)
        else:
            r = self.runner._evaluate_single_ast_entry(decoder, item_id, result, truth[item_id], entries[item_id],
                                                        model, category, language=self.language,
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
                reply = bfcl.grade(req["category"], req["id"], req["result"], req.get("tool_form"))
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
