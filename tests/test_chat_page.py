"""The chat page at / in a real browser (headless Chromium from Debian's
`chromium` package, driven by Playwright): a typed message streams a reply
into the page, a second turn keeps the conversation, and Stop cancels the
request on the server (its blocks go back to the pool). A screenshot goes to
$CISM_TEST_ARTIFACTS (default: the test's temporary directory)."""
import os
import shutil
import time
from pathlib import Path

import pytest

sync_api = pytest.importorskip("playwright.sync_api")

import cism
from cism.server import create_app

from serving import LiveServer, idle

CHROMIUM = os.environ.get("CISM_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def live(smollm2_gguf):
    if CHROMIUM is None:
        pytest.skip("no chromium executable (apt-get install chromium, or set CISM_CHROMIUM)")
    engine = cism.Engine(cism.load(str(smollm2_gguf), precision="int8", act_precision="int8"), kv_blocks=400)
    server = LiveServer(create_app(engine, model_name="smollm2"))
    server.engine = engine
    yield server
    server.stop()
    engine.shutdown(drain=False)


def test_chat_page_streams_keeps_the_conversation_and_stops(live, tmp_path):
    artifacts = Path(os.environ.get("CISM_TEST_ARTIFACTS") or tmp_path)
    artifacts.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1100, "height": 800})
            page.goto(live.url + "/")
            assert page.inner_text("#model") == "smollm2"
            # a typed message streams a reply: the text grows while the request runs
            page.fill("#temperature", "0")
            page.fill("#max_tokens", "60")
            page.check("#ignore_eos")
            page.fill("#input", "Name three rivers in Europe.")
            page.press("#input", "Enter")
            reply = page.locator(".msg.assistant").nth(0)
            page.wait_for_function("document.querySelector('.msg.assistant').textContent.length > 0")
            lengths = [len(reply.text_content())]
            while reply.get_attribute("data-state") == "streaming":
                lengths.append(len(reply.text_content()))
                time.sleep(0.02)
            assert reply.get_attribute("data-state") == "done"
            assert len(set(lengths)) > 2, lengths      # it arrived piece by piece
            first = reply.text_content()
            assert first.strip()
            page.wait_for_selector(".stats")
            assert "60 tokens" in page.locator(".stats").nth(0).text_content()
            # the second turn carries the first (the model sees the conversation)
            page.fill("#input", "And one in Africa?")
            page.press("#input", "Enter")
            page.wait_for_function("document.querySelectorAll('.msg.assistant').length == 2 && "
                                   "document.querySelectorAll('.msg.assistant')[1].dataset.state == 'done'")
            assert live.engine.stats()["prefix_hit_tokens"] > 0     # the first turn's prompt was reused
            page.screenshot(path=str(artifacts / "chat_page.png"), full_page=True)
            # Stop cancels: the request ends on the server, its blocks are freed
            before = live.engine.stats()["finished_cancelled"]
            page.fill("#max_tokens", "3000")
            page.fill("#temperature", "1")
            page.fill("#input", "Tell me a very long story.")
            page.press("#input", "Enter")
            page.wait_for_function("document.querySelectorAll('.msg.assistant').length == 3 && "
                                   "document.querySelectorAll('.msg.assistant')[2].textContent.length > 10")
            page.click("#stop")
            page.wait_for_function("document.querySelectorAll('.msg.assistant')[2].dataset.state == 'stopped'")
            st = idle(live.engine)
            assert st["finished_cancelled"] == before + 1
            assert not page.is_disabled("#send")
            page.screenshot(path=str(artifacts / "chat_page_stopped.png"), full_page=True)
        finally:
            browser.close()
    print(f"screenshots: {artifacts}")
