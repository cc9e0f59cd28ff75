"""`infer bench throughput` / `benchmarks/throughput.py`: the workload, the report, the script end to end."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import require_smollm2

from infer.bench import BenchConfig, add_bench_parser, config_from_args, make_workload
from infer.bench.workload import engine_kwargs

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="infer")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["bench", "throughput", *argv])


# -- the workload ---------------------------------------------------------------------
def test_prompts_have_the_exact_lengths_drawn_from_the_seed():
    cfg = BenchConfig(num_prompts=32, min_len=20, max_len=200, seed=3)
    a, b = make_workload(cfg, 1000, [0, 1, 2]), make_workload(cfg, 1000, [0, 1, 2])
    lengths = [len(p) for p in a.prompts]
    assert len(lengths) == 32 and min(lengths) >= 20 and max(lengths) <= 200 and len(set(lengths)) > 1
    assert a.prompts == b.prompts and a.prefill_prompts == b.prefill_prompts
    assert make_workload(BenchConfig(seed=4), 1000, []).prompts != a.prompts


def test_prompts_avoid_special_tokens_and_stay_in_the_vocabulary():
    work = make_workload(BenchConfig(num_prompts=8), 50, [0, 1, 2, 49])
    ids = {t for p in work.prompts + work.decode_prompts + work.prefill_prompts for t in p}
    assert ids <= set(range(3, 49))


def test_probe_prompts_are_fresh_so_no_prefix_cache_hit():
    work = make_workload(BenchConfig(repeats=3), 49152, [])
    assert len({tuple(p) for p in work.prefill_prompts}) == 3 and all(len(p) == 512 for p in work.prefill_prompts)
    assert len({tuple(p) for p in work.decode_prompts}) == 3


def test_kv_pool_holds_every_prompt_and_its_output_at_once():
    cfg = BenchConfig()
    work = make_workload(cfg, 49152, [])
    kw = engine_kwargs(cfg, work, block_size=16, kv_bytes_per_token=100)
    need = sum(-(-(len(p) + cfg.output_len) // 16) * 16 for p in work.prompts)
    assert kw["kv_cache_memory"] >= need * 100
    assert kw["max_num_seqs"] >= cfg.num_prompts and kw["max_num_batched_tokens"] >= cfg.prefill_len
    assert kw["max_model_len"] >= cfg.max_len + cfg.output_len and kw["show_progress"] is False


# -- options ----------------------------------------------------------------------------
def test_quick_shrinks_the_run_and_explicit_options_win():
    cfg = config_from_args(parse("--quick", "--output-len", "5"))
    assert (cfg.num_prompts, cfg.output_len, cfg.repeats) == (4, 5, 1)
    assert config_from_args(parse()).num_prompts == 32
    assert config_from_args(parse()).dtype == "float32" and config_from_args(parse("--dtype", "auto")).dtype == "auto"


def test_bad_lengths_are_refused_with_the_option_names(capsys):
    args = parse("--min-len", "50", "--max-len", "10")
    assert args.func(args) == 2
    assert "--min-len 50 / --max-len 10" in capsys.readouterr().err


# -- end to end ----------------------------------------------------------------------------
def check_report(r: dict, num_prompts: int, output_len: int) -> None:
    inf, hf, ratios, mach = r["infer"], r["transformers"], r["ratios"], r["machine"]
    assert r["workload"]["num_prompts"] == num_prompts and r["workload"]["output_tokens"] == num_prompts * output_len
    for t in (inf["workload"], hf["batch"], hf["single"]):
        assert 0 < t["output_tok_s"] < t["total_tok_s"] and t["elapsed_s"] > 0
        assert math.isclose(t["output_tok_s"] * t["elapsed_s"], num_prompts * output_len, rel_tol=1e-6)
    for side in (inf, hf):
        assert side["decode"]["decode_tok_s"] > 0 and side["prefill"]["prefill_tok_s"] > 0
        mem = side["memory"]
        assert 0 < mem["baseline_rss"] <= mem["peak_rss"] and mem["loaded_rss"] <= mem["peak_rss"]
    assert mach["bandwidth_gbs"] > 0 and mach["matmul_gflops"] > 0
    assert math.isclose(mach["decode_limit_tok_s"], mach["bandwidth_gbs"] * 1e9 / r["model"]["decode_bytes_per_token"])
    peak = mach["gemm"][mach["dtype"]]["peak_gflops"]
    assert peak >= mach["gemm"][mach["dtype"]]["model_256_rows_gflops"] > 0 and mach["gemm_peak_gflops"] == peak
    assert math.isclose(mach["prefill_limit_tok_s"], peak * 1e9 / r["model"]["prefill_flops_per_token"])
    roof = mach["workload_roofline"]
    assert math.isclose(roof["seconds"], roof["prefill_s"] + roof["decode_s"]) and roof["decode_s"] > 0
    assert math.isclose(ratios["workload_of_roofline"], inf["workload"]["output_tok_s"] / roof["output_tok_s"])
    # the ratios are the measured numbers divided, not separate measurements
    assert math.isclose(ratios["workload_vs_hf_batch"], inf["workload"]["output_tok_s"] / hf["batch"]["output_tok_s"])
    assert math.isclose(ratios["decode_vs_hf"], inf["decode"]["decode_tok_s"] / hf["decode"]["decode_tok_s"])
    assert math.isclose(ratios["prefill_vs_hf"], inf["prefill"]["prefill_tok_s"] / hf["prefill"]["prefill_tok_s"])
    assert math.isclose(ratios["peak_rss_over_weights_kv"],
                        inf["memory"]["peak_rss"] / (inf["memory"]["weights_bytes"] + inf["memory"]["kv_pool_bytes"]))
    for t in r["targets"].values():
        assert t["met"] == (t["value"] <= t["target"] if t["op"] == "<=" else t["value"] >= t["target"])
    assert len(r["targets"]) == 5
    assert 0 <= ratios["greedy_agreement"]["first_token"] <= 1


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256, max_position_embeddings=256)
    model = transformers.LlamaForCausalLM(cfg).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.08)
    path = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(path)
    return path


def test_quick_run_on_a_tiny_model_writes_json_and_png(tiny_llama, tmp_path, capsys):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    args = parse("--quick", "--model", str(tiny_llama), "--json", str(out), "--png", str(png))
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    for text in ("output tok/s", "decode tok/s", "prefill tok/s", "load average", "targets", "roofline", "GEMM peak"):
        assert text in printed
    check_report(json.loads(out.read_text()), num_prompts=4, output_len=8)
    assert png.read_bytes().startswith(PNG_MAGIC)


@pytest.mark.slow
def test_script_quick_run_on_smollm2(tmp_path):
    require_smollm2()
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "throughput.py"), "--quick", "--json", str(out),
                           "--png", str(png)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "transformers batch 32" in proc.stdout
    r = json.loads(out.read_text())
    check_report(r, num_prompts=4, output_len=8)
    assert r["config"]["model"] == "smollm2" and r["engine_args"]["resolved"]["backend"] == "torch"
    # same weights, same ids, greedy fp32: the peer really is the same model (a wrong one agrees
    # on ~0; a tiny random model's top-2 logits are too close to ask this of it)
    assert r["ratios"]["greedy_agreement"]["first_token"] >= 0.75
    assert png.read_bytes().startswith(PNG_MAGIC)


def test_workload_roofline_is_prefill_at_the_gemm_peak_then_steps_bound_by_flops_or_bytes():
    from infer.bench.workload import workload_roofline

    costs = dict(body_params=1e6, head_params=2e5, attn_flops_per_query_key=100.0, weights_read_bytes=2.4e6,
                 kv_bytes_per_token=10.0)
    prompts = [10, 30]
    prefill = (2e6 * 40 + 2 * 2e5 * 2 + 100 * (55 + 465)) / 1e9  # 1 GFLOP/s
    roof = workload_roofline(costs, prompts, 3, gemm_gflops=1.0, bandwidth_gbs=1e-3)  # 1 MB/s: bytes bound
    assert math.isclose(roof["prefill_s"], prefill)
    steps = [(2.4e6 + 10 * (40 + 2 * i)) / 1e6 for i in (1, 2)]
    assert math.isclose(roof["decode_s"], sum(steps)) and math.isclose(roof["output_tok_s"], 6 / (prefill + sum(steps)))
    fast_memory = workload_roofline(costs, prompts, 3, gemm_gflops=1.0, bandwidth_gbs=1e6)  # FLOPs bound
    flops = [2 * 2 * 1.2e6 + 100 * (40 + 2 * i) for i in (1, 2)]
    assert math.isclose(fast_memory["decode_s"], sum(flops) / 1e9)
