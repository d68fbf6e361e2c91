"""The serving app on a tiny vision-language model (Qwen2.5-VL, the transformers engine): chat
requests with OpenAI's ``image_url`` content parts, and the refusals of malformed images, each
one line with HTTP 400 naming the part."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch

fastapi = pytest.importorskip("fastapi", reason="fastapi is the serve extra")
from fastapi.testclient import TestClient  # noqa: E402
from PIL import Image  # noqa: E402

from verl.serving import ServeLimits, create_app  # noqa: E402
from verl.testing.tiny_vlm import cached_tiny_vlm  # noqa: E402

NAME = "tiny-vlm"
MAX_TOKENS = 8
LIMITS = ServeLimits(max_tokens=MAX_TOKENS, default_completion_tokens=4, max_prompts=2, max_n=2, batch_wait_ms=0,
                     max_image_pixels=64 * 64, max_images=2)


def _png(image: Image.Image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def _noise(seed: int, size=(40, 30)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))


IMAGES = [_noise(1), _noise(2, size=(28, 56))]


@pytest.fixture(scope="module")
def vlm_dir() -> str:
    return cached_tiny_vlm()


@pytest.fixture(scope="module")
def client(vlm_dir):
    app = create_app(vlm_dir, engine="auto", limits=LIMITS, name=NAME, device="cpu")
    with TestClient(app) as c:
        yield c
    app.state.model.close()


def _chat(client, parts, **extra):
    body = {"model": NAME, "messages": [{"role": "user", "content": parts}], "max_tokens": MAX_TOKENS,
            "temperature": 0, **extra}
    return client.post("/v1/chat/completions", json=body)


def _reference(vlm_dir: str, image: Image.Image, question: str) -> tuple[str, int]:
    """transformers' own greedy decoding of the checkpoint with the processor's inputs: (text, prompt tokens)."""
    from transformers import AutoModelForImageTextToText

    from verl.data.processor import load_processor

    processor = load_processor(vlm_dir)
    model = AutoModelForImageTextToText.from_pretrained(vlm_dir).eval()
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    enc = processor(text=[text], images=[image], add_special_tokens=False, return_tensors="pt")
    with torch.no_grad():
        tok = processor.tokenizer
        out = model.generate(**enc, do_sample=False, max_new_tokens=MAX_TOKENS, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id)
    new = out[0, enc["input_ids"].shape[1]:]
    return processor.tokenizer.decode(new, skip_special_tokens=True), int(enc["input_ids"].shape[1])


def test_chat_with_an_image_part_answers_as_transformers(client, vlm_dir):
    """The response to [image, text] is transformers' greedy decode with that image's pixel_values;
    another image gives another answer (the image reaches the model)."""
    question = "What is in the picture?"
    answers = []
    for image in IMAGES:
        r = _chat(client, [{"type": "image_url", "image_url": {"url": _png(image)}}, {"type": "text", "text": question}])
        assert r.status_code == 200, r.text
        body = r.json()
        expected_text, expected_prompt = _reference(vlm_dir, image, question)
        assert body["choices"][0]["message"]["content"] == expected_text
        assert body["usage"]["prompt_tokens"] == expected_prompt  # the image's placeholders counted
        answers.append(expected_text)
    assert answers[0] != answers[1]


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("data:image/png;base64,@@not-base64@@", "not valid base64"),
        ("data:image/png;base64," + base64.b64encode(b"plain text, no image").decode(), "not an image file"),
        (_png(_noise(3, size=(65, 64))), "64x65 = 4160 pixels, above this server's budget of 4096"),
        ("https://example.com/cat.png", "only data URLs are accepted"),
        ("data:text/plain;base64,aGk=", "data:image/<format>;base64"),
    ],
    ids=["bad-base64", "not-an-image", "too-many-pixels", "network-url", "not-an-image-url"],
)
def test_a_malformed_image_is_a_400_naming_the_part(client, url, message):
    r = _chat(client, [{"type": "text", "text": "look:"}, {"type": "image_url", "image_url": {"url": url}}])
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages.0.content.1.image_url"
    assert message in err["message"] and "\n" not in err["message"]


def test_a_missing_url_and_too_many_images_are_400s(client):
    r = _chat(client, [{"type": "image_url", "image_url": {}}])
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "messages.0.content.0.image_url.url"
    three = [{"type": "image_url", "image_url": {"url": _png(IMAGES[0])}}] * 3
    r = _chat(client, three)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content.2.image_url"
    assert "more than 2 images" in r.json()["error"]["message"]


def test_text_only_chat_still_works(client):
    r = _chat(client, "hello", n=2, temperature=1.0, seed=3)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2


def test_generate_takes_two_conversations_with_their_own_images(client):
    """/generate's conversations with image parts: one engine call, each prompt with its own image, each
    answer the chat route's greedy answer for that image."""
    convs = [[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _png(im)}},
                                           {"type": "text", "text": "Describe it."}]}] for im in IMAGES]
    r = client.post("/generate", json={"messages": convs, "sampling": {"temperature": 0, "max_tokens": MAX_TOKENS}})
    assert r.status_code == 200, r.text
    outputs = r.json()["outputs"]
    for conv, out in zip(convs, outputs):
        chat = _chat(client, conv[0]["content"]).json()
        assert out["responses"][0]["text"] == chat["choices"][0]["message"]["content"]
        assert out["prompt_tokens"] == chat["usage"]["prompt_tokens"]


def test_command_line_sets_the_image_limits(vlm_dir, capsys):
    """--max-image-pixels / --max-images reach ServeLimits (a bad value is the limits' one line, exit 2)."""
    from verl.serving.__main__ import main, parser

    args = parser().parse_args(["--model", vlm_dir, "--max-image-pixels", "1000", "--max-images", "3"])
    assert (args.max_image_pixels, args.max_images) == (1000, 3)
    assert main(["--model", vlm_dir, "--max-image-pixels", "0"]) == 2
    assert "ServeLimits.max_image_pixels=0; it must be >= 1" in capsys.readouterr().err
