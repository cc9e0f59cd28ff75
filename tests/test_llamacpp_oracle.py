"""llama.cpp itself as the oracle for GGUF K-quant files it wrote.

llama-cpp-python (pinned) is built from its sdist into a venv of its own under
the test cache (``$INFER_TEST_CACHE``, default ``~/.cache/infer-tests``) and
reused while it imports. Its quantizer turns the bundled SmolLM2 GGUF into
Q4_K_M and Q6_K files; its greedy continuations of a few prompts (argmax of
llama.cpp's own logits) are what infer must reproduce on the same files,
token ids compared. A second test bounds the peak RSS of loading and
generating with those files, which a load that dequantizes the weights
would break.

The build happens once per cache (several minutes on 2 cores). A build that
fails (no network, no compiler) fails the tests rather than skipping them.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import require_smollm2

pytestmark = pytest.mark.slow

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
# For the machine (-march=native) but never AMX: ggml's AMX matmul segfaults on
# the first decode on some CPUs that have it. An explicit -mno-* beats what
# -march=native turns on, whatever the order, so ggml's __AMX_INT8__ path is
# not compiled. LLAVA_BUILD=OFF skips the multimodal library, which these tests do not load.
CMAKE_ARGS = "-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
FTYPES = {"Q4_K_M": 15, "Q6_K": 18}  # llama_ftype values
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are", "Water boils at a temperature of", "To make a cup of tea, first",
           "The largest planet in the solar system", "Machine learning is"]
NEW_TOKENS, COMPARED, MIN_AGREEING = 24, 8, 7
# llama.cpp computes with Q8-quantized activations and an f16 KV cache: its
# log-probs differ from exact math on the same weights (infer's cpu_ref) by
# up to ~0.7 among the top 20. Where its own top-2 logits are closer than this,
# either token is right.
TIE = 0.5
# Peak RSS above a bare `import torch` interpreter, as a multiple of the file's size:
# about 2.4x (Q4_K_M) and 2.0x (Q6_K) kept quantized; dequantized at load
# (`quantization="none"`, fp32) 7.3x and 5.6x.
MAX_RSS_RATIO = {"Q4_K_M": 3.0, "Q6_K": 2.5}


def cache_dir() -> Path:
    root = os.environ.get("INFER_TEST_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "infer-tests"
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def locked(path: Path):
    """One xdist worker builds; the other waits for it and then reuses what it built."""
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _cpu_key() -> str:
    """What -march=native sees: a venv built on one CPU may not run on another sharing the cache."""
    flags = ""
    with contextlib.suppress(OSError):
        flags = next((line for line in open("/proc/cpuinfo") if line.startswith(("flags", "Features"))), "")
    key = f"{LLAMA_CPP_PYTHON} {CMAKE_ARGS} {NO_AMX} {platform.machine()} {sys.version_info[:2]} {flags}"
    return hashlib.sha256(key.encode()).hexdigest()[:12]


CHECK = ("import llama_cpp; info = llama_cpp.llama_print_system_info().decode(); "
         "assert 'AMX_INT8 = 1' not in info, info; print(llama_cpp.__version__, info)")


def _works(python: Path) -> str | None:
    if not python.exists():
        return None
    res = subprocess.run([str(python), "-c", CHECK], capture_output=True, text=True, cwd="/")
    return res.stdout.strip() if res.returncode == 0 else None


def build_llama_cpp_python() -> Path:
    """The interpreter of a venv holding llama-cpp-python, built here if the cache has none that works
    (``$INFER_LLAMA_CPP_PYTHON`` names one built elsewhere instead)."""
    if given := os.environ.get("INFER_LLAMA_CPP_PYTHON"):
        if not _works(Path(given)):
            pytest.fail(f"INFER_LLAMA_CPP_PYTHON={given} does not import llama_cpp (built without AMX)", pytrace=False)
        return Path(given)
    cache = cache_dir()
    venv = cache / f"llama-cpp-python-{LLAMA_CPP_PYTHON.split('==')[1]}-{_cpu_key()}"
    python = venv / "bin" / "python"
    with locked(cache / "llama-cpp-python.lock"):
        if _works(python):
            return python
        shutil.rmtree(venv, ignore_errors=True)
        start = time.monotonic()
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        env = os.environ | {"CMAKE_ARGS": CMAKE_ARGS, "CFLAGS": NO_AMX, "CXXFLAGS": NO_AMX,
                            "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 2)}
        # --no-cache-dir: pip's wheel cache is keyed by the sdist, not by CMAKE_ARGS, so it
        # could hand back a wheel built with other flags (AMX on).
        log = venv / "build.log"
        with open(log, "w") as out:
            res = subprocess.run([str(python), "-m", "pip", "install", "--no-cache-dir", "--no-binary",
                                  "llama-cpp-python", LLAMA_CPP_PYTHON], env=env, stdout=out, stderr=subprocess.STDOUT)
        if res.returncode:
            tail = log.read_text()[-3000:]
            shutil.rmtree(venv, ignore_errors=True)
            pytest.fail(f"building {LLAMA_CPP_PYTHON} failed (exit {res.returncode}; it needs PyPI and a C++ "
                        f"compiler):\n{tail}", pytrace=False)
        info = _works(python)
        if not info:
            res = subprocess.run([str(python), "-c", CHECK], capture_output=True, text=True, cwd="/")
            pytest.fail(f"{LLAMA_CPP_PYTHON} built but does not import cleanly:\n{res.stderr[-3000:]}", pytrace=False)
        (venv / "built.txt").write_text(f"{time.monotonic() - start:.0f} s\n{info}\n")
        print(f"\nbuilt {LLAMA_CPP_PYTHON} in {time.monotonic() - start:.0f} s: {info}", file=sys.stderr)
        return python


# Runs under llama-cpp-python's interpreter: quantize, then greedy-decode each prompt
# by argmax over llama.cpp's logits (no sampler in the way), EOS not special.
# One thread: ggml's threads spin at every barrier, and on a 2-core machine that
# other jobs kept busy two threads ran it 30x slower (206 s, not 6). One thread
# gives the same tokens and logits.
ORACLE = r"""
import ctypes, json, os, sys
import numpy as np
import llama_cpp
from llama_cpp import Llama

src, out_dir, spec = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
result = {}
for name, ftype in spec["ftypes"].items():
    dst = os.path.join(out_dir, f"smollm2-{name}.gguf")
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype, p.allow_requantize, p.nthread = ftype, True, 1
    rc = llama_cpp.llama_model_quantize(src.encode(), (dst + ".part").encode(), ctypes.byref(p))
    assert rc == 0, f"llama_model_quantize({name}) returned {rc}"
    os.replace(dst + ".part", dst)
    llm = Llama(model_path=dst, n_ctx=256, n_threads=1, n_threads_batch=1, verbose=False)
    rows = []
    for prompt in spec["prompts"]:
        llm.reset()
        ids = llm.tokenize(prompt.encode(), add_bos=True, special=False)
        llm.eval(ids)
        tokens, margins = [], []
        for _ in range(spec["n"]):
            # the logits of the last token evaluated (the only row llama-cpp-python asks for)
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits(llm.ctx), shape=(llm.n_vocab(),)).astype(np.float64)
            top2 = np.argsort(logits)[-2:]
            tokens.append(int(top2[1]))
            margins.append(float(logits[top2[1]] - logits[top2[0]]))
            llm.eval([tokens[-1]])
        rows.append({"prompt_ids": [int(t) for t in ids], "tokens": tokens, "margins": margins})
    result[name] = {"path": dst, "rows": rows}
    del llm
print(json.dumps(result))
"""


@pytest.fixture(scope="session")
def llama_cpp_oracle() -> dict:
    """{ftype: {"path": GGUF llama.cpp wrote, "rows": [{prompt_ids, tokens, margins}]}}, cached
    beside the venv under a key of everything that decides it."""
    require_smollm2()
    from infer.core.loader import resolve_model_path

    python = build_llama_cpp_python()
    src = resolve_model_path("smollm2")[0]
    spec = {"ftypes": FTYPES, "prompts": PROMPTS, "n": NEW_TOKENS}
    digest = hashlib.sha256(src.read_bytes())
    digest.update(json.dumps(spec).encode() + str(python).encode() + ORACLE.encode())
    out = cache_dir() / f"smollm2-oracle-{digest.hexdigest()[:12]}"
    with locked(cache_dir() / "smollm2-oracle.lock"):
        done = out / "oracle.json"
        if not done.exists():
            out.mkdir(exist_ok=True)
            start = time.monotonic()
            res = subprocess.run([str(python), "-c", ORACLE, str(src), str(out), json.dumps(spec)],
                                 capture_output=True, text=True, cwd="/")
            assert res.returncode == 0, f"llama.cpp quantize/generate failed:\n{res.stderr[-3000:]}"
            done.write_text(res.stdout.strip().splitlines()[-1])
            print(f"\nllama.cpp quantized and decoded in {time.monotonic() - start:.0f} s", file=sys.stderr)
        return json.loads(done.read_text())


def _infer_greedy(path: str, rows: list[dict], backend: str, n: int) -> list[list[int]]:
    from infer import LLM, SamplingParams

    llm = LLM(path, backend=backend, max_model_len=256, show_progress=False)
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": r["prompt_ids"]} for r in rows], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _agreement(ours: list[list[int]], rows: list[dict], n: int) -> tuple[int, int, str]:
    """(prompts whose first `n` tokens equal llama.cpp's, prompts that equal them or part
    only at one of llama.cpp's near-ties, where the others part)."""
    exact, agree, notes = 0, 0, []
    for i, (got, row) in enumerate(zip(ours, rows)):
        want = row["tokens"][:n]
        if got[:n] == want:
            exact, agree = exact + 1, agree + 1
            continue
        at = next(j for j, (a, b) in enumerate(zip(got, want)) if a != b)
        tie = row["margins"][at] < TIE
        agree += tie
        notes.append(f"prompt {i} ({PROMPTS[i]!r}) parts at token {at}: infer {got[at]}, llama.cpp {want[at]} "
                     f"(llama.cpp's top-2 margin there {row['margins'][at]:.3f}{': a tie' if tie else ''})")
    return exact, agree, "\n".join(notes)


@pytest.mark.parametrize("ftype", list(FTYPES))
def test_greedy_tokens_agree_with_llama_cpp(llama_cpp_oracle, ftype):
    """infer's default backend on llama.cpp's own K-quant file: llama.cpp's greedy tokens,
    up to near-ties of llama.cpp's own logits, for all but one prompt."""
    oracle = llama_cpp_oracle[ftype]
    ours = _infer_greedy(oracle["path"], oracle["rows"], "auto", NEW_TOKENS)
    exact, agree, notes = _agreement(ours, oracle["rows"], COMPARED)
    print(f"\n{ftype}: first {COMPARED} greedy tokens equal llama.cpp's for {exact}/{len(PROMPTS)} prompts, "
          f"up to a near-tie for {agree}/{len(PROMPTS)}\n{notes}")
    assert agree >= MIN_AGREEING, notes


@pytest.mark.parametrize("ftype", list(FTYPES))
def test_teacher_forced_top1_agrees_with_llama_cpp_where_it_is_decisive(llama_cpp_oracle, ftype):
    """Along llama.cpp's own greedy sequences (so one early parting does not hide the rest),
    infer's next token equals llama.cpp's wherever llama.cpp does not call it a tie (all but
    2% of those positions)."""
    from infer import LLM, SamplingParams

    oracle = llama_cpp_oracle[ftype]
    llm = LLM(oracle["path"], max_model_len=256, show_progress=False)
    cases = [(row["prompt_ids"] + row["tokens"][:j], row["tokens"][j], row["margins"][j])
             for row in oracle["rows"] for j in range(NEW_TOKENS)]
    outs = llm.generate([{"prompt_token_ids": ids} for ids, _, _ in cases],
                        SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    got = [o.outputs[0].token_ids[0] for o in outs]
    decisive = [(g, want, m) for g, (_, want, m) in zip(got, cases) if m >= TIE]
    wrong = [(want, g, round(m, 3)) for g, want, m in decisive if g != want]
    print(f"\n{ftype}: teacher-forced top-1 equals llama.cpp's at {sum(g == w for g, (_, w, _) in zip(got, cases))}"
          f"/{len(cases)} positions, {len(decisive) - len(wrong)}/{len(decisive)} where llama.cpp's margin >= {TIE}")
    assert len(decisive) >= len(cases) // 2 and len(wrong) <= len(decisive) // 50, f"(llama.cpp, infer, margin): {wrong}"


@pytest.mark.parametrize("ftype", list(FTYPES))
def test_cpu_ref_greedy_tokens_agree_with_llama_cpp(llama_cpp_oracle, ftype):
    """The NumPy reference backend too (two prompts: it is the slow, plain one)."""
    oracle = llama_cpp_oracle[ftype]
    rows = oracle["rows"][:2]
    ours = _infer_greedy(oracle["path"], rows, "cpu_ref", COMPARED)
    _, agree, notes = _agreement(ours, rows, COMPARED)
    assert agree == len(rows), notes


# VmHWM, not ru_maxrss: ru_maxrss survives exec, so a child of the (large) pytest
# process would report the parent's peak at fork.
PEAK = "print(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM:')))"
RSS_CHILD = r"""
import sys
import torch
from infer import LLM, SamplingParams
llm = LLM(sys.argv[1], max_num_seqs=1, kv_cache_memory=32 << 20, max_model_len=512, show_progress=False)
llm.generate(["The history of the printing press begins"],
             SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
""" + PEAK


def _peak_rss_kib(*args: str) -> int:
    res = subprocess.run([sys.executable, "-c", *args], capture_output=True, text=True, check=True)
    return int(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("ftype", list(FTYPES))
def test_peak_rss_stays_near_the_file_size(llama_cpp_oracle, ftype):
    """Loading and generating keeps the K-quant weights quantized: a fresh interpreter's
    peak RSS above a bare `import torch` one, over the file size, stays under a bound that
    a dequantize-at-load breaks. KV pool 32 MiB, as benchmarks/quant.py's decode."""
    path = llama_cpp_oracle[ftype]["path"]
    bare = _peak_rss_kib("import torch\n" + PEAK)
    peak = _peak_rss_kib(RSS_CHILD, path)
    ratio = (peak - bare) * 1024 / os.path.getsize(path)
    print(f"\n{ftype}: peak RSS {peak / 1024:.0f} MiB, bare torch {bare / 1024:.0f} MiB, "
          f"{ratio:.2f}x the {os.path.getsize(path) / 2**20:.0f} MiB file above bare torch")
    assert ratio <= MAX_RSS_RATIO[ftype], f"{ratio:.2f}x > {MAX_RSS_RATIO[ftype]}x"
