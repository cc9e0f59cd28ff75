"""Shared by the server tests: a tiny random Llama with a real byte-level BPE
tokenizer and chat template, and a real `infer serve` process on a free port."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = ["The quick brown fox jumps over the lazy dog.", "Once upon a time there was a tiny model.",
          "Paris is the capital of France; Berlin is the capital of Germany.",
          "Ünïcödé text, emoji 🙂 and 日本語 make the byte-level tokenizer work.", "def f(x): return x + 1"] * 20
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def make_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (vocab 320) trained on CORPUS, with a ChatML template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>",
                                                eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    return fast


def make_tiny_model_dir(path: Path, seed: int = 0, max_positions: int = 256) -> Path:
    """Save a tiny random Llama, its tokenizer (vocab 320) and a ChatML template to `path`."""
    fast = make_tokenizer()
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                                   bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id)
    model = transformers.LlamaForCausalLM(cfg).eval()
    for p in model.parameters():  # larger than the init so greedy outputs vary with the prompt
        p.data.normal_(0, 0.1)
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return path


class Server:
    """`infer serve ...` as a child process; `url` once it listens."""

    def __init__(self, args: list[str], api_key: str | None = None, timeout: float = 120.0,
                 env: dict[str, str] | None = None):
        env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", **(env or {}))
        cmd = [sys.executable, "-m", "infer.cli", "serve", "--port", "0", "--uvicorn-log-level", "warning", *args]
        if api_key:
            cmd += ["--api-key", api_key]
        self.api_key = api_key
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.log: list[str] = []
        deadline = time.time() + timeout
        self.url = None
        while time.time() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.log.append(line)
            m = re.search(r"on (http://[\d.]+:\d+)", line)
            if m:
                self.url = m.group(1)
                break
        if self.url is None:
            self.proc.kill()
            raise RuntimeError("infer serve did not start:\n" + "".join(self.log) + self.proc.stdout.read())
        # Drain the rest of the output so a full pipe never blocks the server.
        import threading

        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=60, **kwargs)

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics, keyed by its full text name with labels."""
        text = httpx.get(self.url + "/metrics", timeout=30).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


def metric(samples: dict[str, float], name: str, model: str, **labels: str) -> float:
    """One sample: name{model_name=model, labels...}; prometheus orders labels by name."""
    pairs = sorted({"model_name": model, **labels}.items())
    return samples.get(name + "{" + ",".join(f'{k}="{v}"' for k, v in pairs) + "}", 0.0)


def wait_idle(server: Server, model: str, timeout: float = 30.0) -> dict[str, float]:
    """Metrics once the model has nothing running or waiting and every KV block is free."""
    deadline = time.time() + timeout
    while True:
        m = server.metrics()
        idle = all(metric(m, f"infer:{g}", model) == 0 for g in
                   ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"))
        if idle or time.time() > deadline:
            return m
        time.sleep(0.05)
