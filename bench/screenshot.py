"""The page under load, as a picture (docs/page.png, shown in docs/page.md and the README): SmolLM2 on 2 stages, three
clients streaming, one chat turn typed into the page in headless Chromium, then a screenshot.

  python bench/screenshot.py [--out docs/page.png]      # needs chromium and chromium-driver (apt) and selenium
"""
from __future__ import annotations

import argparse
import shutil
import threading
import time


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--out", default="docs/page.png")
  a = ap.parse_args()
  import httpx
  from selenium import webdriver
  from selenium.webdriver.chrome.service import Service
  from selenium.webdriver.common.by import By

  from pyruntime.engine.launcher import Launcher
  from pyruntime.serving.httpd import BackgroundServer
  from pyruntime.serving.server import create_app
  with Launcher(None, stages=2, max_context=1024, warmup=True) as lm, BackgroundServer(create_app(lm)) as srv:
    stop = threading.Event()

    def client(i: int) -> None:
      with httpx.Client(base_url=srv.url, timeout=120) as c:
        while not stop.is_set():
          c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": f"Tell me fact number {i} about the sea."}],
                                               "max_tokens": 64})
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(3)]
    for t in threads: t.start()
    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium") or shutil.which("chromium-browser")
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,900"): opts.add_argument(arg)
    drv = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=opts)
    try:
      drv.get(srv.url + "/")
      time.sleep(8)  # the plots fill
      drv.find_element(By.ID, "input").send_keys("Write a short poem about pipelines, then a Python one-liner in a code block.")
      drv.find_element(By.ID, "send").click()
      time.sleep(12)
      drv.save_screenshot(a.out)
    finally:
      drv.quit()
      stop.set()
  print(a.out)


if __name__ == "__main__":
  main()
