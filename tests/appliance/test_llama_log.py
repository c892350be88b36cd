"""llama.cpp's own log goes to the appliance's log (the `llama.cpp` logger) at debug level,
not to the terminal: loading the embedded model's vocabulary, in a process of its own so
that what llama.cpp would write to file descriptor 2 is seen."""

from __future__ import annotations

import subprocess
import sys
from typing import TYPE_CHECKING

import pytest

from tests.conftest import REPO

if TYPE_CHECKING:
    from appliance.state.records import ModelRecord

pytestmark = pytest.mark.model

LOAD = """
import logging, sys
from appliance.serving.engine import LlamaVocabulary
from appliance.state.records import ModelRecord
import json
FORMAT = "%(levelname)s %(name)s: %(message)s"
logging.basicConfig(level=sys.argv[2], stream=sys.stderr, format=FORMAT)
LlamaVocabulary.load(ModelRecord(**json.loads(sys.argv[1])))
print("loaded")
"""


def _load(model: ModelRecord, level: str) -> subprocess.CompletedProcess[str]:
    record = {f: getattr(model, f) for f in model.__dataclass_fields__}
    record["path"] = str(record["path"])
    import json  # noqa: PLC0415

    return subprocess.run(
        [sys.executable, "-c", LOAD, json.dumps(record, default=str), level],
        capture_output=True, text=True, cwd=REPO, check=True, timeout=120,
    )  # fmt: skip


def test_llama_cpps_log_is_the_logs_at_debug_level(default_model: ModelRecord) -> None:
    quiet = _load(default_model, "INFO")
    assert quiet.stdout.strip() == "loaded"
    assert quiet.stderr == ""  # not a line of llama.cpp's on the terminal
    verbose = _load(default_model, "DEBUG")
    lines = verbose.stderr.splitlines()
    assert any(line.startswith("DEBUG llama.cpp: llama_model_loader") for line in lines), lines[:5]
    assert all(line.startswith("DEBUG llama.cpp: ") for line in lines), lines[:5]
