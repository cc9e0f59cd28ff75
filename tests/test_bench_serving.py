"""benchmarks/serving.py drives an OpenAI server with text prompts of a set token length."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import require_smollm2

BENCH = Path(__file__).parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))
import serving  # noqa: E402


def _args(**kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    serving.add_workload_args(p)
    args = p.parse_args([])
    vars(args).update(kw)
    return args


def test_text_prompts_have_about_the_asked_length_and_ids_prompts_the_exact_one():
    require_smollm2()
    from infer.core.loader import open_checkpoint

    tok = open_checkpoint("smollm2").load_tokenizer()
    prompts, eos = serving.make_prompts(_args(num_prompts=6, input_len=64))
    assert eos == tok.eos_token_id and len(prompts) == 6 and len(set(prompts)) == 6
    for p in prompts:
        assert isinstance(p, str) and "\ufffd" not in p
        # decoded text re-encodes to about the drawn ids (neighbours may merge)
        assert 56 <= len(tok.encode(p, add_special_tokens=False)) <= 72
    assert prompts == serving.make_prompts(_args(num_prompts=6, input_len=64))[0]  # the seed decides
    ids, eos = serving.make_prompts(_args(num_prompts=3, input_len=10, dataset="random-ids"))
    assert eos is None and [len(x) for x in ids] == [10, 10, 10]


@pytest.mark.slow
def test_a_launched_server_generates_every_asked_token(tmp_path):
    require_smollm2()
    out = tmp_path / "run.json"
    res = subprocess.run([sys.executable, str(BENCH / "serving.py"), "--launch", "--model smollm2 --max-model-len 256",
                          "--num-prompts", "4", "--input-len", "24", "--output-len", "6", "--max-concurrency", "2",
                          "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["summary"]["completed"] == 4 and report["summary"]["failed"] == 0
    assert [r["output_tokens"] for r in report["requests"]] == [6] * 4  # ignore_eos and the eos bias
    assert all(len(r["itl"]) == 5 and r["ttft"] > 0 for r in report["requests"])
