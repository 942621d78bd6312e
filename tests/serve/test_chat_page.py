"""GET / — the chat page, driven in a real headless Chromium (Debian's package) by Playwright:
text streams in over several steps, Stop cancels the generation server-side, a 400 is shown,
an API-key server asks for the key. The screenshot goes to the test's tmp dir."""
from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.system_tools import find_or_skip

CHROMIUM = find_or_skip("chromium", "chromium", "the chat page's browser tests")

from playwright.sync_api import Page, sync_playwright  # noqa: E402

ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        print(f"chromium {b.version}")
        yield b
        b.close()


@pytest.fixture(scope="module")
def page_server(server_factory: Any) -> Any:
    return server_factory()


def open_page(browser: Any, base_url: str) -> Page:
    page = browser.new_page(viewport={"width": 1100, "height": 720})
    page.goto(base_url + "/")
    # Record every length the answer's text takes on screen, as it changes.
    page.evaluate("""() => {
        window.__lengths = [];
        new MutationObserver(() => {
            const c = document.querySelector('.msg.assistant:last-of-type .content');
            if (c) window.__lengths.push(c.textContent.length);
        }).observe(document.getElementById('conversation'),
                   {subtree: true, childList: true, characterData: true});
    }""")
    return page


def cancelled(base_url: str) -> float:
    text = httpx.get(base_url + "/metrics").text
    m = re.search(r'pipeserve_requests_total\{endpoint="chat",outcome="cancelled"\} ([0-9.e+]+)',
                  text)
    return float(m.group(1)) if m else 0.0


def send(page: Page, text: str) -> None:
    page.fill("#prompt", text)
    page.click("#send")


def test_page_streams_text_in_several_steps(browser: Any, page_server: Any, tmp_path: Path) -> None:
    page = open_page(browser, page_server.base_url)
    page.fill("#max-tokens", "200")
    page.fill("#temperature", "0")
    send(page, "Tell me a story about a train.")
    page.wait_for_selector(".msg.assistant[data-done]", timeout=60_000)
    lengths = page.evaluate("window.__lengths")
    grew = sorted({n for n in lengths if n > 0})
    # more than one visible step: text was on screen before the answer was complete
    assert len(grew) >= 2, f"the answer arrived in {len(grew)} visible step(s): {lengths}"
    assert int(page.get_attribute(".msg.assistant", "data-chunks")) >= 2
    usage = page.inner_text(".msg.assistant .usage")
    assert re.search(r"prompt \d+ · cached \d+ · completion \d+ · TTFT \d+ ms", usage), usage
    assert page.get_attribute(".msg.assistant", "data-done") in ("length", "stop")
    shot = tmp_path / "chat-page.png"
    page.screenshot(path=str(shot), full_page=True)
    print(f"screenshot: {shot}")
    assert shot.stat().st_size > 10_000
    page.close()


@pytest.fixture(scope="module")
def slow_server(server_factory: Any) -> Any:
    """The 32M generated model (about ten times slower than the tiny one): its 3000 tokens outlast
    any lag of a page busy rendering a fast stream, so Stop always lands mid-generation."""
    return server_factory("model.size=small")


def test_stop_cancels_the_generation_on_the_server(browser: Any, slow_server: Any) -> None:
    page_server = slow_server
    before = cancelled(page_server.base_url)
    page = open_page(browser, page_server.base_url)
    page.fill("#max-tokens", "3000")
    page.fill("#temperature", "0")   # greedy: the page's default 0.7 could sample an early EOS
    send(page, "Count to a thousand.")
    page.wait_for_function("() => window.__lengths.some(n => n > 0)", timeout=60_000)
    page.click("#stop")
    page.wait_for_selector('.msg.assistant[data-done="stopped"]', timeout=10_000)
    deadline = time.monotonic() + 15
    while cancelled(page_server.base_url) <= before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert cancelled(page_server.base_url) == before + 1, "the server did not abort the row"
    assert page.is_enabled("#send") and not page.is_enabled("#stop")
    page.close()


def test_a_400_is_shown_as_an_error(browser: Any, page_server: Any) -> None:
    page = open_page(browser, page_server.base_url)
    page.fill("#temperature", "7")
    send(page, "hello")
    err = page.wait_for_selector(".msg.error", timeout=30_000)
    text = err.inner_text()
    assert "temperature" in text and "400" in text, text
    assert page.query_selector(".msg.assistant") is None
    page.close()


def test_the_page_asks_for_the_api_key(browser: Any, server_factory: Any) -> None:
    locked = server_factory("server.api_key=page-secret")
    page = browser.new_page()
    page.goto(locked.base_url + "/")
    page.wait_for_selector("#keybar.shown", timeout=10_000)
    page.fill("#key", "page-secret")
    page.click("#key-save")
    page.fill("#max-tokens", "8")
    send(page, "hi")
    page.wait_for_selector(".msg.assistant[data-done]", timeout=60_000)
    assert page.query_selector(".msg.error") is None
    # The key lives in this tab only: a fresh context (a new tab) has to ask again.
    other = browser.new_context().new_page()
    other.goto(locked.base_url + "/")
    other.wait_for_selector("#keybar.shown", timeout=10_000)
    page.close()
    other.close()


def test_chat_page_can_be_turned_off(server_factory: Any) -> None:
    off = server_factory("server.chat_page=false")
    assert httpx.get(off.base_url + "/").status_code == 404


def test_the_page_attaches_an_image_and_shows_it(browser: Any, server_factory: Any,
                                                 page_server: Any, tmp_path: Path) -> None:
    """A model that takes images (model=tiny_vlm): the page offers Attach, sends the image as a
    data: URL part, shows it in the transcript, and the answer is the API's for that message."""
    import base64

    import numpy as np
    from PIL import Image

    pytest.importorskip("mlx_vlm", reason="the vision extra: pip install -e '.[vision]'")
    text_only = browser.new_page()
    text_only.goto(page_server.base_url + "/")
    text_only.wait_for_selector("#model-name:not(:empty)", timeout=10_000)
    assert text_only.is_hidden("#attach-label")   # model=tiny takes text only
    text_only.close()

    vlm = server_factory("model=tiny_vlm")
    pixels = (np.random.default_rng(5).random((40, 56, 3)) * 255).astype("uint8")
    path = tmp_path / "picture.png"
    Image.fromarray(pixels).save(path)
    page = open_page(browser, vlm.base_url)
    page.wait_for_selector("#attach-label:not([hidden])", timeout=10_000)
    page.fill("#max-tokens", "12")
    page.fill("#temperature", "0")
    page.set_input_files("#attach", str(path))
    page.wait_for_selector("#attached img", timeout=10_000)
    send(page, "What is in the picture?")
    page.wait_for_selector(".msg.assistant[data-done]", timeout=60_000)
    assert page.query_selector(".msg.error") is None
    assert page.query_selector(".msg.user img") is not None
    assert page.query_selector("#attached img") is None   # attachments go with one message
    shown = page.inner_text(".msg.assistant .content")
    url = "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()
    api = httpx.post(vlm.base_url + "/v1/chat/completions", timeout=60, json={
        "max_tokens": 12, "temperature": 0, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is in the picture?"},
            {"type": "image_url", "image_url": {"url": url}}]}]}).json()
    assert shown == api["choices"][0]["message"]["content"]
    assert api["usage"]["pipeserve"]["images"].startswith("sha256:")
    page.close()


def test_the_page_attaches_an_audio_clip_for_a_model_with_an_audio_tower(
        browser: Any, server_factory: Any, tmp_path: Path) -> None:
    """A model with an audio tower (model=tiny_vlm model.arch=gemma4: text, images and audio):
    the attach button offers images and audio, sends the WAV as an input_audio part, shows a player for it in
    the transcript, and the answer is the API's for that message."""
    import base64
    import wave

    import numpy as np

    pytest.importorskip("mlx_vlm", reason="the vision extra: pip install -e '.[vision]'")
    server = server_factory("model=tiny_vlm", "model.arch=gemma4")
    t = np.arange(8000) / 16000
    path = tmp_path / "clip.wav"
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(16000)
        w.writeframes((np.sin(2 * np.pi * 440 * t) * 12000).astype("<i2").tobytes())
    page = open_page(browser, server.base_url)
    page.wait_for_selector("#attach-label:not([hidden])", timeout=10_000)
    assert page.inner_text("#attach-text") == "Attach"
    assert page.get_attribute("#attach", "accept") == "image/*,audio/*"
    page.fill("#max-tokens", "12")
    page.fill("#temperature", "0")
    page.set_input_files("#attach", str(path))
    page.wait_for_selector("#attached audio", timeout=10_000)
    send(page, "What do you hear?")
    page.wait_for_selector(".msg.assistant[data-done]", timeout=60_000)
    assert page.query_selector(".msg.error") is None
    assert page.query_selector(".msg.user audio") is not None
    assert page.query_selector("#attached audio") is None
    shown = page.inner_text(".msg.assistant .content")
    api = httpx.post(server.base_url + "/v1/chat/completions", timeout=60, json={
        "max_tokens": 12, "temperature": 0, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "What do you hear?"},
            {"type": "input_audio", "input_audio": {
                "data": base64.b64encode(path.read_bytes()).decode(), "format": "wav"}}]}]}).json()
    assert shown == api["choices"][0]["message"]["content"]
    assert api["usage"]["pipeserve"]["audios"].startswith("sha256:")
    page.close()
