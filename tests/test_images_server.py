"""Images over HTTP (issue 39): `jaxinfer serve`'s app on a real socket, driven by the `openai`
client, with a tiny random Gemma 3: a chat with an image_url part (a data: URI) answers what
`LLM.chat` answers; a corrupt image, a file path and a remote URL each get a 400 naming the
part or the image, while a request beside them completes."""

from __future__ import annotations

import asyncio
import base64
import io

import openai
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.server.app import build_app
from http_server import running
from test_images_gemma3 import gemma3, picture  # noqa: F401 - the saved model fixture


@pytest.fixture(scope="module")
def served(gemma3):  # noqa: F811
    """(LLM.chat's answer to the picture-11 chat, the server's URL). The answer is computed before the
    server starts: once it serves, its engine thread steps the engine whenever work is pending, and
    would take the outputs of an LLM.chat running beside it."""
    llm = LLM(str(gemma3[0]), max_model_len=128, max_num_batched_tokens=32, max_num_seqs=4, num_pages=48, page_size=4,
              progress=False)
    want = llm.chat(messages(data_uri(picture(11))), SamplingParams(max_tokens=5, temperature=0), use_tqdm=False)[0]
    with running(build_app(llm, served_model_name="tiny-gemma3")) as url:
        yield want, url


def data_uri(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def messages(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "Look: "},
                                         {"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": " what is it?"}]}]


def test_an_image_chat_over_http_equals_llm_chat(served):
    want, url = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    reply = client.chat.completions.create(model="tiny-gemma3", messages=messages(data_uri(picture(11))), max_tokens=5,
                                           temperature=0)
    assert reply.choices[0].message.content == want.outputs[0].text
    assert reply.usage.prompt_tokens == len(want.prompt_token_ids)


def test_bad_images_get_400_and_the_request_beside_them_completes(served):
    _, url = served
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    corrupt = "data:image/png;base64," + base64.b64encode(b"not a png").decode()

    async def run():
        good = client.chat.completions.create(model="tiny-gemma3", messages=messages(data_uri(picture(12))),
                                              max_tokens=8, temperature=0)
        bad = [client.chat.completions.create(model="tiny-gemma3", messages=messages(u), max_tokens=4)
               for u in (corrupt, "/etc/passwd", "https://example.com/cat.png")]
        return await asyncio.gather(good, *bad, return_exceptions=True)

    good, *bad = asyncio.run(run())
    assert good.choices[0].finish_reason in ("length", "stop")
    for error, names in zip(bad, ("image 0", "messages[0].content[1]", "example.com")):
        assert isinstance(error, openai.BadRequestError), error
        assert names in error.message, error.message
