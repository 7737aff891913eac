"""The trained tiny family shipped under models/: loads through the normal loader, speculation is lossless on it,
and its drafts are accepted on code it never saw."""

from __future__ import annotations

import json

import pytest

from deployments.engine.engine import Engine
from deployments.engine.request import SamplingParams
from tests.helpers import ROOT
from workers.config import EngineConfig, SpeculativeConfig

MODELS = ROOT / "models"
TARGET, DRAFT, EAGLE3 = MODELS / "specserve-tiny", MODELS / "specserve-tiny-draft", MODELS / "specserve-tiny-eagle3"

# held-out style: not stdlib source
PROMPTS = [
    "def parse_requirements(path):\n    \"\"\"Read a requirements file and return the package names.\"\"\"\n",
    "class LRUCache:\n    def __init__(self, capacity):\n        self.capacity = capacity\n",
    "import json\nimport sys\n\n\ndef main(argv):\n    if len(argv) < 2:\n",
]


@pytest.fixture(scope="module")
def plain():
    eng = Engine(EngineConfig(model=str(TARGET), device="cpu", max_model_len=1024))
    return eng, [o.token_ids for o in eng.generate(PROMPTS, SamplingParams(max_tokens=48, temperature=0.0))]


def test_family_is_within_size_limits():
    files = [f for d in (TARGET, DRAFT, EAGLE3) for f in d.glob("*.safetensors")]
    assert files and all(f.stat().st_size <= 15 * 2**20 for f in files)
    assert sum(f.stat().st_size for f in files) <= 60 * 2**20
    cfg = json.loads((TARGET / "config.json").read_text())
    assert cfg["max_position_embeddings"] >= 1024 and cfg["vocab_size"] == 8192


@pytest.mark.parametrize("method,model", [("eagle3", EAGLE3), ("draft", DRAFT), ("ngram", None)])
def test_speculation_is_lossless_and_accepts(plain, method, model):
    _, ref = plain
    spec = SpeculativeConfig(method=method, model=str(model) if model else None, num_steps=4)
    eng = Engine(EngineConfig(model=str(TARGET), device="cpu", max_model_len=1024, speculative_config=spec))
    out = eng.generate(PROMPTS, SamplingParams(max_tokens=48, temperature=0.0))
    assert [o.token_ids for o in out] == ref
    drafts = sum(o.spec["num_drafts"] for o in out)
    accept = 1 + sum(o.spec["num_accepted_tokens"] for o in out) / drafts
    if method != "ngram":
        assert accept > 1.8, accept  # trained drafts really predict the target


def test_generates_python_looking_text(plain):
    eng, ref = plain
    text = eng.tokenizer.decode(ref[0])
    assert any(tok in text for tok in ("return", "=", "(", ":")), text
