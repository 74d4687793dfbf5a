"""The bundled model's build-time code (training/tasks.py, training/train_tiny.py) for the tests
that grade its tool calls or check the trainer. That code lives outside the installed package,
so it is loaded by path here (under its own module names: train_tiny's ``import tasks`` then
finds the one loaded here)."""

import importlib.util
import sys
from pathlib import Path

TRAINING = Path(__file__).resolve().parents[1] / "training"


def training_module(name: str):
    """training/NAME.py as the module NAME, loaded once."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, TRAINING / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # before exec: dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


tasks = training_module("tasks")
TOOLS = tasks.TOOLS
TOOLS_BY_NAME = tasks.TOOLS_BY_NAME
tool_call_text = tasks.tool_call_text
parse_tool_call = tasks.parse_tool_call
