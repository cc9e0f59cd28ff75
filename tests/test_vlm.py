"""Vision-language models against transformers: tiny random LLaVA checkpoints (CLIP and SigLIP
towers) saved with their real processor classes; greedy tokens with one and two images per
prompt equal `LlavaForConditionalGeneration.generate`'s on torch and cpu_ref; chat with image
parts; chunked prefill through image rows; the encoder cache and prefix-cache sharing by image
content; each bad input named."""

from __future__ import annotations

import base64
import io
import zlib

import pytest
import torch
import transformers

from tiny_vlm import image, save_llava

from infer import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0)


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return save_llava(str(tmp_path_factory.mktemp("vlm") / "llava"))


@pytest.fixture(scope="module")
def llava_siglip(tmp_path_factory):
    # SigLIP: a patch bias, no class row, tanh GELU; every layer's output, all rows kept
    return save_llava(str(tmp_path_factory.mktemp("vlm") / "llava-siglip"), tower="siglip", feature_layer=-1,
                      strategy="full")


def _hf(path):
    return transformers.AutoProcessor.from_pretrained(path), \
        transformers.LlavaForConditionalGeneration.from_pretrained(path).eval()


def _hf_greedy(path, text, images, n=8):
    proc, model = _hf(path)
    inp = proc(text=[text], images=images or None, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inp, max_new_tokens=n, do_sample=False)
    return out[0, inp["input_ids"].shape[1]:].tolist()


def _hf_logprobs(path, text, images):
    proc, model = _hf(path)
    inp = proc(text=[text], images=images, return_tensors="pt")
    with torch.no_grad():
        return model(**inp).logits[0, -1].float().log_softmax(-1)


PROMPTS = [("the cat <image> is", [1]), ("a dog <image> and <image> are", [2, 3]), ("<image><image> side by side", [4, 5])]


@pytest.mark.parametrize("backend", ["torch", "cpu_ref"])
def test_greedy_tokens_equal_transformers_with_one_and_two_images(llava, backend):
    llm = LLM(llava, backend=backend, dtype="float32", max_model_len=256)
    prompts = [{"prompt": t, "multi_modal_data": {"image": [image(s) for s in seeds]}} for t, seeds in PROMPTS]
    got = llm.generate(prompts, GREEDY, use_tqdm=False)
    for (text, seeds), out in zip(PROMPTS, got):
        assert out.outputs[0].token_ids == _hf_greedy(llava, text, [image(s) for s in seeds]), text


def test_logprobs_follow_the_picture_as_transformers_does(llava, llava_siglip):
    """The next-token distribution moves with the image (so the image rows are read), and equals
    transformers' for each picture: CLIP with the class row dropped, SigLIP keeping every row."""
    for path in (llava, llava_siglip):
        llm = LLM(path, backend="torch", dtype="float32", max_model_len=256)
        firsts = set()
        for seed in (1, 2, 3):
            want = _hf_logprobs(path, "the cat <image> is", [image(seed)])
            out = llm.generate([{"prompt": "the cat <image> is", "multi_modal_data": {"image": image(seed)}}],
                               SamplingParams(max_tokens=1, temperature=0, logprobs=5), use_tqdm=False)[0]
            for tok, lp in out.outputs[0].logprobs[0].items():
                assert abs(lp.logprob - float(want[tok])) < 2e-4, (path, seed, tok)
            firsts.add(tuple(want.topk(5).indices.tolist()))
        assert len(firsts) > 1, path  # different pictures, different distributions


def test_bfloat16_stays_close_to_transformers(llava):
    llm = LLM(llava, backend="torch", dtype="bfloat16", max_model_len=256)
    want = _hf_logprobs(llava, "the cat <image> is", [image(7)])
    out = llm.generate([{"prompt": "the cat <image> is", "multi_modal_data": {"image": image(7)}}],
                       SamplingParams(max_tokens=1, temperature=0, logprobs=3), use_tqdm=False)[0]
    for tok, lp in out.outputs[0].logprobs[0].items():
        assert abs(lp.logprob - float(want[tok])) < 0.1


def _data_url(img) -> str:
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_chat_with_image_parts_equals_the_processors_chat_template(llava):
    proc, model = _hf(llava)
    img = image(8)
    hf_msgs = [{"role": "user", "content": [{"type": "text", "text": "what is"}, {"type": "image", "image": img},
                                            {"type": "text", "text": "this"}]}]
    inp = proc.apply_chat_template(hf_msgs, add_generation_prompt=True, tokenize=True, return_dict=True,
                                   return_tensors="pt")
    with torch.no_grad():
        want = model.generate(**inp, max_new_tokens=8, do_sample=False)[0, inp["input_ids"].shape[1]:].tolist()
    llm = LLM(llava, backend="torch", dtype="float32", max_model_len=256)
    for part in ({"type": "image_url", "image_url": {"url": _data_url(img)}}, {"type": "image_pil", "image_pil": img}):
        msgs = [{"role": "user", "content": [{"type": "text", "text": "what is"}, part, {"type": "text", "text": "this"}]}]
        out = llm.chat(msgs, GREEDY, use_tqdm=False)[0]
        assert out.prompt_token_ids == inp["input_ids"][0].tolist()
        assert out.outputs[0].token_ids == want


def test_chunked_prefill_cuts_through_image_rows(llava):
    """An 8-token budget cuts each 16-row image over several steps; the encoder runs once per image."""
    text, seeds = PROMPTS[1]
    want = _hf_greedy(llava, text, [image(s) for s in seeds])
    llm = LLM(llava, backend="torch", dtype="float32", max_model_len=256, max_num_batched_tokens=8, max_num_seqs=4,
              enable_prefix_caching=False)
    out = llm.generate([{"prompt": text, "multi_modal_data": {"image": [image(s) for s in seeds]}}], GREEDY,
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == want
    enc = llm.engine.worker.runner.encoder
    assert enc.images_encoded == 2 and enc.misses == 2 and enc.hits >= 2


def test_prefix_cache_shares_blocks_by_image_content(llava):
    """Same picture: the second request reads the first's blocks (and its encoder output); another
    picture behind the same placeholder tokens shares only the text before it, and is still right."""
    llm = LLM(llava, backend="torch", dtype="float32", max_model_len=256, block_size=16)
    stats = llm.engine.scheduler.block_manager.prefix_cache_stats
    prefix = "the of and to in is it you that he was for on are with as " * 2  # whole blocks of text first
    text = prefix + "<image> said the man"
    first = llm.generate([{"prompt": text, "multi_modal_data": {"image": image(1)}}], GREEDY, use_tqdm=False)[0]
    hits = stats.hits
    same = llm.generate([{"prompt": text, "multi_modal_data": {"image": image(1)}}], GREEDY, use_tqdm=False)[0]
    shared = stats.hits - hits
    assert same.outputs[0].token_ids == first.outputs[0].token_ids
    at = first.prompt_token_ids.index(llm.engine.input.mm.image_token_id)
    assert shared >= (at + 16) // 16 * 16  # the text and the image's blocks
    hits = stats.hits
    other = llm.generate([{"prompt": text, "multi_modal_data": {"image": image(2)}}], GREEDY, use_tqdm=False)[0]
    assert stats.hits - hits == at // 16 * 16  # only the blocks wholly before the image
    assert other.outputs[0].token_ids == _hf_greedy(llava, text, [image(2)])
    enc = llm.engine.worker.runner.encoder
    assert enc.images_encoded == 2  # image(1) once, image(2) once


def test_bad_image_inputs_are_named(llava, tmp_path):
    llm = LLM(llava, backend="cpu_ref", dtype="float32", max_model_len=256, limit_mm_per_prompt={"image": 1})
    cases = [
        ({"prompt": "two <image> marks <image>", "multi_modal_data": {"image": image(1)}}, "2 image placeholders"),
        ({"prompt": "a <image>", "multi_modal_data": {"image": [image(1), image(2)]}}, "more than the limit of 1"),
        ({"prompt": "a <image>", "multi_modal_data": {"image": "not a picture"}}, "must be a PIL.Image"),
        ({"prompt": "a <image> b"}, "no image was given"),
        ({"prompt": "a", "multi_modal_data": {"audio": b""}}, "only 'image'"),
    ]
    for prompt, needle in cases:
        with pytest.raises((ValueError, TypeError), match=needle):
            llm.engine.add_request("bad", prompt, GREEDY)
    bad = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
    with pytest.raises(ValueError, match=r"messages\[0\].content\[0\]: the data is not a decodable image"):
        llm.chat(bad, GREEDY, use_tqdm=False)
    local = tmp_path / "x.png"
    image(1).save(local)
    far = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"file://{local}"}}]}]
    with pytest.raises(ValueError, match="allowed-local-media-path"):
        llm.chat(far, GREEDY, use_tqdm=False)
    assert not llm.engine.scheduler.requests  # nothing was queued


def test_local_files_only_under_the_allowed_path(llava, tmp_path):
    (tmp_path / "ok").mkdir()
    image(3).save(tmp_path / "ok" / "a.png")
    image(3).save(tmp_path / "b.png")
    llm = LLM(llava, backend="torch", dtype="float32", max_model_len=256, allowed_local_media_path=str(tmp_path / "ok"))
    msgs = lambda path: [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"file://{path}"}}]}]
    out = llm.chat(msgs(tmp_path / "ok" / "a.png"), GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 8
    for path in (tmp_path / "b.png", tmp_path / "ok" / ".." / "b.png"):
        with pytest.raises(ValueError, match="outside the allowed local media path"):
            llm.chat(msgs(path), GREEDY, use_tqdm=False)


def test_a_text_model_refuses_images(tmp_path):
    from server_harness import make_tiny_model_dir

    llm = LLM(str(make_tiny_model_dir(tmp_path / "text")), backend="cpu_ref", dtype="float32")
    with pytest.raises(ValueError, match="text-only model"):
        llm.engine.add_request("x", {"prompt": "hi", "multi_modal_data": {"image": image(1)}}, GREEDY)
    with pytest.raises(ValueError, match="text-only model"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_url(image(1))}}]}],
                 GREEDY, use_tqdm=False)


def test_decompression_bomb_is_refused_before_decoding():
    from PIL import Image

    from infer.core.multimodal import MAX_IMAGE_PIXELS, load_image

    big = Image.new("L", (1, 1))
    buf = io.BytesIO()
    big.save(buf, "PNG")
    data = bytearray(buf.getvalue())
    # the IHDR's width and height (bytes 16..24) say 8000 x 8000 pixels; the data stays 1 pixel
    data[16:24] = (8000).to_bytes(4, "big") * 2  # 64M: over our cap, under PIL's own
    data[29:33] = zlib.crc32(bytes(data[12:29])).to_bytes(4, "big")  # the chunk's checksum, redone
    assert 8000 * 8000 > MAX_IMAGE_PIXELS
    with pytest.raises(ValueError, match=f"limit of {MAX_IMAGE_PIXELS}"):
        load_image(bytes(data), "part")


def test_both_programs_export_to_onnx(llava):
    """The language model (its image rows as ScatterND) and the vision tower pass onnx's full check."""
    pytest.importorskip("onnx")
    import json
    from pathlib import Path

    from infer.core.lowering import lower
    from infer.core.models.llava import build_llava
    from infer.core.onnx_export import to_onnx

    graph = build_llava(json.loads((Path(llava) / "config.json").read_text()))
    lm, tower = to_onnx(lower(graph)), to_onnx(lower(graph.encoder))
    assert "ScatterND" in {n.op_type for n in lm.graph.node}
    assert {i.name for i in tower.graph.input} >= {"patches", "class_ids", "feature_rows"}
    assert tower.graph.output[0].name.startswith("image_embeds")
