"""Vision-language models against transformers on the same machine: images/s through the vision
encoder (tower + projector), TTFT of a one-image chat, and the encoder cache on repeated images.

    python benchmarks/vlm.py --json out.json [--images 32] [--trials 5]

The model (random weights, saved by tests/tiny_vlm.py with its real LlavaProcessor): LLaVA-shaped,
a CLIP tower of ViT-S/16's shape at 224 px (384 wide, 12 layers, 6 heads, 1536 FFN; 196 patches
and the class row, features after the second-to-last layer) and a 4-layer Llama (512 wide, 8
heads over 4 KV heads, 1408 FFN).

Rows, each in a fresh process (torch imported first):
- ``transformers``: `get_image_features` over the processor's pixels, 8 images a batch; TTFT:
  processor + `generate(max_new_tokens=1)` on the chat template's prompt, a new image each trial;
- ``infer`` (default flags) and ``infer-float32``: the engine's `VisionEncoder.encode`, 8 images
  a batch; TTFT: `LLM.chat(max_tokens=1)` with the image as a data URL, a new image each trial
  (median of `--trials`); the cache: `--images` requests cycling over 4 pictures.
"""

from __future__ import annotations

import argparse
import base64
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch  # noqa: F401  (first, as a user's script does)
from fresh import run_child, save_json

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

PEERS = ("transformers", "infer", "infer-float32")
VISION = dict(hidden_size=384, intermediate_size=1536, num_hidden_layers=12, num_attention_heads=6)
TEXT = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4)
BATCH = 8


def _url(img) -> str:
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def child(path: str, peer: str, n: int, trials: int) -> dict:
    import transformers
    from tiny_vlm import image

    proc = transformers.AutoProcessor.from_pretrained(path)
    pics = [image(i, (320, 240)) for i in range(n)]
    pixels = proc.image_processor(images=pics, return_tensors="pt")["pixel_values"]
    out: dict = {"threads": torch.get_num_threads()}
    if peer == "transformers":
        model = transformers.LlavaForConditionalGeneration.from_pretrained(path).eval()
        with torch.inference_mode():
            model.model.get_image_features(pixel_values=pixels[:BATCH])
            start = time.perf_counter()
            for i in range(0, n, BATCH):
                model.model.get_image_features(pixel_values=pixels[i:i + BATCH])
            out["encode_s"] = time.perf_counter() - start
            times = []
            for t in range(trials + 1):
                msgs = [{"role": "user", "content": [{"type": "text", "text": "what is this"},
                                                     {"type": "image", "image": image(1000 + t, (320, 240))}]}]
                start = time.perf_counter()
                inp = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True,
                                               return_tensors="pt")
                model.generate(**inp, max_new_tokens=1, do_sample=False)
                times.append(time.perf_counter() - start)
            out["ttft_s"] = statistics.median(times[1:])
        return out
    from infer import LLM, SamplingParams
    from infer.core.multimodal import ImageItem

    llm = LLM(path, backend="torch", max_model_len=512, **({} if peer == "infer" else {"dtype": "float32"}))
    enc = llm.engine.worker.runner.encoder
    items = [ImageItem(0, 196, bytes([i % 256, i // 256]), px.numpy()) for i, px in enumerate(pixels)]
    enc.encode(items[:BATCH])
    start = time.perf_counter()
    for i in range(0, n, BATCH):
        enc.encode(items[i:i + BATCH])
    out["encode_s"] = time.perf_counter() - start
    one = SamplingParams(max_tokens=1, temperature=0)
    times = []
    for t in range(trials + 1):
        msgs = [{"role": "user", "content": [{"type": "text", "text": "what is this"},
                                             {"type": "image_url", "image_url": {"url": _url(image(1000 + t, (320, 240)))}}]}]
        start = time.perf_counter()
        llm.chat(msgs, one, use_tqdm=False)
        times.append(time.perf_counter() - start)
    out["ttft_s"] = statistics.median(times[1:])
    # The encoder cache: requests cycling over 4 pictures, against as many distinct ones.
    hits, misses, encoded = enc.hits, enc.misses, enc.images_encoded
    chats = [[{"role": "user", "content": [{"type": "text", "text": f"picture {i}"},
                                           {"type": "image_url", "image_url": {"url": _url(image(2000 + i % 4, (320, 240)))}}]}]
             for i in range(n)]
    start = time.perf_counter()
    llm.chat(chats, one, use_tqdm=False)
    out["repeated_s"] = time.perf_counter() - start
    out["cache_hits"], out["cache_misses"] = enc.hits - hits, enc.misses - misses
    out["encoder_runs"] = enc.images_encoded - encoded
    out["dtype"] = llm.engine.dtype
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", nargs=4, metavar=("PATH", "PEER", "N", "TRIALS"))
    ap.add_argument("--images", type=int, default=32)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--peers", default=",".join(PEERS))
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.child:
        import json

        path, peer, n, trials = a.child
        print(json.dumps(child(path, peer, int(n), int(trials))))
        return
    from tiny_vlm import save_llava

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = save_llava(str(Path(tmp) / "llava"), image_size=224, patch_size=16, vision_kw=VISION, text_kw=TEXT)
        for peer in a.peers.split(","):
            r = results[peer] = run_child(__file__, [path, peer, str(a.images), str(a.trials)])
            line = f"{peer:14s} {a.images / r['encode_s']:7.2f} images/s  TTFT {r['ttft_s'] * 1000:7.1f} ms"
            if "cache_hits" in r:
                rate = r["cache_hits"] / max(1, r["cache_hits"] + r["cache_misses"])
                line += (f"  cache hit rate {rate:.0%} ({r['encoder_runs']} encoder runs for {a.images} requests, "
                         f"{r['repeated_s']:.2f} s) {r['dtype']}")
            print(line, flush=True)
    base = results.get("transformers")
    for peer in [p for p in results if p != "transformers" and base]:
        r = results[peer]
        print(f"{peer} / transformers: encoder {base['encode_s'] / r['encode_s']:.2f}x, "
              f"TTFT {base['ttft_s'] / r['ttft_s']:.2f}x", flush=True)
    save_json(a.json, images=a.images, **results)


if __name__ == "__main__":
    main()
