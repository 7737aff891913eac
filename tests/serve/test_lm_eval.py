"""EleutherAI lm-evaluation-harness against the served tiny checkpoint, as a user runs it: its ``local-completions``
model on a small local task (a task YAML and a JSON-lines dataset written here; no hub download), generate_until and
loglikelihood (multiple choice), one request at a time and in batches of 4 (batched prompts). The loglikelihoods
equal lm-eval's own ``hf`` model on the same checkpoint in fp32."""

from __future__ import annotations

import json

import pytest

from tests.serve.conftest import second_app

pytest.importorskip("lm_eval")

MC_DOCS = [
    {"question": "def main():", "choices": [" return 0", " pass", " print(x)"], "label": 1},
    {"question": "import os\nimport", "choices": [" sys", " json", " re"], "label": 0},
    {"question": "x = 1\ny =", "choices": [" 2", " x + 1", " None"], "label": 0},
    {"question": "for i in range(10):", "choices": ["\n    print(i)", " pass", "\n    continue"], "label": 2},
    {"question": "class A:", "choices": [" pass", "\n    def f(self):"], "label": 0},
]
GEN_DOCS = [{"question": q, "answer": "x"} for q in ("def f(a, b):", "import numpy", "while True:", "if x:")]


def write_tasks(root) -> None:
    for name, docs in (("mc", MC_DOCS), ("gen", GEN_DOCS)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    common = "dataset_path: json\ntest_split: test\ndoc_to_text: \"{{question}}\"\n"
    (root / "specserve_mc.yaml").write_text(
        "task: specserve_mc\n" + common + f"dataset_kwargs:\n  data_files:\n    test: {root / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{label}}\"\n"
        "metric_list:\n  - metric: acc\n")
    (root / "specserve_gen.yaml").write_text(
        "task: specserve_gen\n" + common + f"dataset_kwargs:\n  data_files:\n    test: {root / 'gen.jsonl'}\n"
        "output_type: generate_until\ndoc_to_target: \"{{answer}}\"\n"
        "generation_kwargs:\n  until: [\"\\n\\n\"]\n  max_gen_toks: 8\n  do_sample: false\n  temperature: 0\n"
        "metric_list:\n  - metric: exact_match\n")


def run(model, model_args: dict, task_manager, batch_size: int) -> dict:
    import lm_eval

    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["specserve_mc", "specserve_gen"],
                                  task_manager=task_manager, batch_size=batch_size, log_samples=True,
                                  bootstrap_iters=0)
    lls = [[resp[0][0] for resp in s["resps"]] for s in sorted(out["samples"]["specserve_mc"],
                                                                 key=lambda s: s["doc_id"])]
    gens = [s["resps"][0][0] for s in sorted(out["samples"]["specserve_gen"], key=lambda s: s["doc_id"])]
    return {"lls": lls, "gens": gens}


def test_lm_eval_local_completions_equals_its_hf_model(server, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from lm_eval.tasks import TaskManager

    write_tasks(tmp_path)
    tasks = TaskManager(include_path=str(tmp_path), include_defaults=False)
    target = server["target"]
    ref = run("hf", {"pretrained": target, "dtype": "float32", "device": "cpu"}, tasks, 1)
    with second_app(server, "lmeval", {}):
        args = {"model": "lmeval", "base_url": f"{server['base']}/lmeval/v1/completions", "tokenizer": target,
                "tokenizer_backend": "huggingface", "tokenized_requests": True, "max_length": 256, "max_retries": 1}
        served = {bs: run("local-completions", args, tasks, bs) for bs in (1, 4)}
    for bs, got in served.items():
        assert [len(x) for x in got["lls"]] == [len(d["choices"]) for d in MC_DOCS]
        for g, w in zip(got["lls"], ref["lls"]):
            assert g == pytest.approx(w, abs=1e-4), bs
        assert got["gens"] == served[1]["gens"]  # batched prompts answer as single ones
    assert len({round(x, 3) for row in ref["lls"] for x in row}) > 5 and any(ref["gens"])  # (not degenerate)
    assert served[1]["gens"] == ref["gens"]  # greedy, fp32: the same text as transformers'
