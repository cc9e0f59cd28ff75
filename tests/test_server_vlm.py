"""`infer serve` with a tiny LLaVA beside a text model, through the official `openai` client:
images as data URLs and as loopback http URLs give transformers' greedy tokens; bad image
parts are 400s naming the messages; the text model refuses images."""

from __future__ import annotations

import base64
import http.server
import io
import threading
import time

import openai
import pytest
import torch
import transformers

from server_harness import Server, make_tiny_model_dir
from tiny_vlm import image, save_llava


class _Pictures(http.server.BaseHTTPRequestHandler):
    """/a.png: a picture; /slow: answers after the server's timeout; /big: more bytes than the cap;
    /hop: redirects to /a.png."""

    def do_GET(self):  # noqa: N802 (http.server's name)
        if self.path == "/slow":
            time.sleep(3)
        if self.path == "/hop":
            self.send_response(302)
            self.send_header("Location", "/a.png")
            self.end_headers()
            return
        body = b"\0" * (3 * 2**20) if self.path == "/big" else self.server.png
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def _png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm-serve")
    vlm = save_llava(str(root / "llava"))
    text = make_tiny_model_dir(root / "text")
    pictures = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Pictures)
    pictures.png = _png(image(11))
    threading.Thread(target=pictures.serve_forever, daemon=True).start()
    srv = Server(["--backend", "torch", "--dtype", "float32", "--model", vlm, "--served-model-name", "vlm",
                  "--model", str(text), "--served-model-name", "text", "--limit-mm-per-prompt", '{"image": 2}'],
                 env={"INFER_IMAGE_FETCH_TIMEOUT": "1", "INFER_MAX_IMAGE_BYTES": str(2**20)})
    yield srv, vlm, f"http://127.0.0.1:{pictures.server_address[1]}"
    srv.stop()
    pictures.shutdown()


def _want(path, img) -> list[int]:
    proc = transformers.AutoProcessor.from_pretrained(path)
    model = transformers.LlavaForConditionalGeneration.from_pretrained(path).eval()
    msgs = [{"role": "user", "content": [{"type": "text", "text": "look at"}, {"type": "image", "image": img}]}]
    inp = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True,
                                   return_tensors="pt")
    with torch.no_grad():
        return model.generate(**inp, max_new_tokens=8, do_sample=False)[0, inp["input_ids"].shape[1]:].tolist()


def _ask(client, url, model="vlm", **kw):
    return client.chat.completions.create(
        model=model, max_tokens=8, temperature=0,
        messages=[{"role": "user", "content": [{"type": "text", "text": "look at"},
                                               {"type": "image_url", "image_url": {"url": url}}]}], **kw)


def test_openai_client_images_by_data_url_and_http_url(served):
    srv, vlm, pictures = served
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    tok = transformers.AutoTokenizer.from_pretrained(vlm)
    img = image(11)
    want = _want(vlm, img)
    data_url = "data:image/png;base64," + base64.b64encode(_png(img)).decode()
    for url in (data_url, pictures + "/a.png", pictures + "/hop"):
        res = _ask(client, url)
        assert res.choices[0].message.content == tok.decode(want), url
        assert res.usage.completion_tokens == len(want)
        assert res.usage.prompt_tokens > 16  # the image's 16 rows are prompt tokens
    streamed = client.chat.completions.create(
        model="vlm", max_tokens=8, temperature=0, stream=True,
        messages=[{"role": "user", "content": [{"type": "text", "text": "look at"},
                                               {"type": "image_url", "image_url": {"url": data_url}}]}])
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == tok.decode(want)


def test_bad_image_parts_are_400s_naming_the_messages(served):
    srv, _, pictures = served
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    three = [{"type": "image_url", "image_url": {"url": pictures + "/a.png"}}] * 3
    cases = [
        ("data:image/png;base64,AAAA", "not a decodable image"),
        ("data:image/png;base64,@@@", "not valid base64"),
        (pictures + "/slow", "timeout 1 s"),
        (pictures + "/big", "larger than 1048576 bytes"),
        ("file:///etc/hostname", "allowed-local-media-path"),
        ("ftp://x/y.png", "unsupported image URL scheme"),
    ]
    for url, needle in cases:
        with pytest.raises(openai.BadRequestError) as err:
            _ask(client, url)
        assert needle in err.value.message and err.value.body["param"] == "messages", (url, err.value.message)
    with pytest.raises(openai.BadRequestError, match="more than the limit of 2"):
        client.chat.completions.create(model="vlm", max_tokens=4, messages=[{"role": "user", "content": three}])
    with pytest.raises(openai.BadRequestError, match="text-only model"):
        _ask(client, pictures + "/a.png", model="text")
    # the server still serves
    assert _ask(client, pictures + "/a.png").choices[0].finish_reason in ("stop", "length")
