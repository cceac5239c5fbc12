"""The page at `/` (pyruntime/web, docs/page.md) in a real headless Chromium, over the unit tests' test double of a
launcher (FakeLauncherForUnitTests, whose answer repeats the prompt's words): model output shows as text, never as
markup; the stage boxes appear with their figures; a pipeline that goes down shows as such. The chat against the real
model (streaming, stop, live stage figures) is in tests/integration/test_server.py."""
from __future__ import annotations

import pytest
from conftest import wait_for
from test_server_unit import FakeLauncherForUnitTests

from pyruntime.serving.httpd import BackgroundServer
from pyruntime.serving.server import create_app

pytestmark = pytest.mark.integration


@pytest.fixture
def page(browser):
  fake = FakeLauncherForUnitTests()
  srv = BackgroundServer(create_app(fake)).start()
  browser.get(srv.url + "/")
  yield browser, fake, srv
  srv.stop()


def send(drv, text: str) -> None:
  from selenium.webdriver.common.by import By
  box = drv.find_element(By.ID, "input")
  box.clear(); box.send_keys(text)
  drv.find_element(By.ID, "send").click()


def test_model_output_is_shown_as_text_not_markup(page):
  from selenium.webdriver.common.by import By
  drv, fake, _ = page
  send(drv, "<script>window.pwned=1</script> <b>bold</b> <img src=x onerror=window.pwned=2>")
  answer = wait_for(lambda: [m for m in drv.find_elements(By.CSS_SELECTOR, ".msg.assistant .meta") if "stop" in m.text or "length" in m.text],
                    what="the answer's end")
  texts = [m.text for m in drv.find_elements(By.CSS_SELECTOR, ".msg.assistant .body")]
  assert answer and "<script>window.pwned=1</script>" in texts[-1] and "<b>bold</b>" in texts[-1]
  assert drv.execute_script("return document.querySelectorAll('#messages script, #messages b, #messages img').length") == 0
  assert drv.execute_script("return window.pwned === undefined")


def test_the_stage_boxes_show_and_a_pipeline_that_goes_down_shows(page):
  from selenium.webdriver.common.by import By
  drv, fake, _ = page
  boxes = wait_for(lambda: drv.find_elements(By.CSS_SELECTOR, "#stages .stage"), what="the stage boxes")
  assert len(boxes) == 2 and "blocks 0–15" in boxes[0].text and "busy" in boxes[0].text
  assert wait_for(lambda: drv.find_element(By.ID, "phase").text == "ok", what="phase ok")
  fake.close()  # every stage dead: the server cannot serve (no restart factory here)
  assert wait_for(lambda: drv.find_element(By.ID, "phase").text.startswith("unavailable"), what="the phase to say unavailable")
  assert wait_for(lambda: "DOWN" in drv.find_elements(By.CSS_SELECTOR, "#stages .stage")[0].text, what="a stage box marked down")
