"""The playground page in a real browser: Debian's headless chromium, driven through its chromedriver by Selenium,
against two replicas of the real service (one worker each, tiny checkpoint, CPU) that share one voice store and
need an API key. The page is typed into and clicked like a user would; what it heard comes back from the state it
keeps in `window.playground`. Each test saves a screenshot and prints its path."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import httpx
import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait
from starlette.testclient import TestClient

from service.app import create_app
from service.settings import Settings
from tests.redis_server import RedisServer, require_server_binary
from tests.service_harness import TLS, LiveServer, service_settings, wav_bytes

KEY = "playground-key"
MISSING = ("the playground's browser test needs Debian's chromium and chromium-driver (apt-get install chromium "
           "chromium-driver; .ci/run installs them)")


def system_browser() -> tuple[str, str]:
    """The system's chromium and its chromedriver; a missing one fails under CI (which installs both), else skips."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if browser and driver:
        return browser, driver
    if os.environ.get("CI") == "true":
        pytest.fail(MISSING)
    pytest.skip(MISSING)


@pytest.fixture(scope="module")
def browser():
    binary, driver_path = system_browser()
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1100,1300",
                "--autoplay-policy=no-user-gesture-required"):
        options.add_argument(arg)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SE_OFFLINE", "true")  # Selenium Manager must never fetch a driver or a browser
        driver = webdriver.Chrome(options=options, service=Service(executable_path=driver_path))
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def replicas(checkpoint_factory, tmp_path_factory):
    """Two replicas, each with its own cache dir, sharing their voices through one real Redis (NANOVLLM_REDIS_URL).
    Started together, so their workers load at once."""
    redis = RedisServer(require_server_binary(), tmp_path_factory.mktemp("playground-redis")).start()
    ckpt = checkpoint_factory("tiny-voxcpm2", stop="never")
    servers = [LiveServer(service_settings(ckpt, tmp_path_factory.mktemp(f"svc-playground-{n}"), api_keys=KEY,
                                           redis_url=redis.url)).start(ready=False) for n in "ab"]
    try:
        for s in servers:
            s.wait_ready()
        yield servers
    finally:
        for s in servers:
            s.stop()
        redis.stop()


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("playground-screenshots")


def page_state(driver) -> dict:
    return driver.execute_script("return window.playground")


def wait_for(driver, predicate, message: str, limit_s: float = 120):
    """A generous hang guard, not a timing assertion."""
    return WebDriverWait(driver, limit_s, poll_frequency=0.1).until(lambda d: predicate(d), message)


def open_page(driver, server: LiveServer) -> None:
    """Load the page, see it refused without a key, then type the key (kept per origin in localStorage)."""
    driver.get(server.url)
    driver.execute_script("localStorage.clear()")  # a key typed on an earlier visit
    driver.get(server.url)
    model = driver.find_element(By.ID, "model")
    wait_for(driver, lambda d: model.text == "API key needed", "the page did not report the missing key")
    driver.find_element(By.ID, "api-key").send_keys(KEY + "\t")  # the change event stores it and reloads
    wait_for(driver, lambda d: "48000 Hz" in model.text, f"/info never answered the keyed page: {model.text!r}")
    for summary in driver.find_elements(By.TAG_NAME, "summary"):
        summary.click()  # open the upload and sampling sections


def generate(driver, text: str, fmt: str, patches: int) -> dict:
    """Type, choose, click Generate and wait until the audio has arrived and finished playing."""
    box = driver.find_element(By.ID, "text")
    box.clear()
    box.send_keys(text)
    Select(driver.find_element(By.ID, "format")).select_by_value(fmt)
    length = driver.find_element(By.ID, "max-length")
    length.clear()
    length.send_keys(str(patches))
    driver.find_element(By.ID, "generate").click()
    wait_for(driver, lambda d: page_state(d)["phase"] in ("done", "error") and
             (page_state(d)["playbackEnded"] or page_state(d)["phase"] == "error"), "the audio never finished playing")
    state = page_state(driver)
    assert state["phase"] == "done", state["error"]
    assert not state["playerError"], state["playerError"]
    return state


def shoot(driver, shots: Path, name: str, capsys: pytest.CaptureFixture) -> None:
    """Save a screenshot and print its path past the output capture, so a passing run shows it too."""
    path = shots / f"{name}.png"
    assert driver.save_screenshot(str(path)) and path.stat().st_size > 0
    with capsys.disabled():
        print(f"\nplayground screenshot: {path}")


def test_the_page_and_its_files_are_open_and_everything_else_keyed(replicas):
    server = replicas[0]
    page = httpx.get(server.url + "/", verify=TLS)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'src="playground/app.js"' in page.text and "://" not in page.text  # nothing fetched from elsewhere
    for name, kind in (("app.js", "text/javascript"), ("style.css", "text/css")):
        r = httpx.get(f"{server.url}/playground/{name}", verify=TLS)
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind) and "://" not in r.text
    missing = httpx.get(server.url + "/playground/secrets.txt", verify=TLS)
    assert missing.status_code == 404 and "secrets.txt" in missing.json()["detail"]
    assert httpx.get(server.url + "/hifi", verify=TLS).status_code == 401


@pytest.mark.parametrize("fmt, patches", [("mp3", 40), ("pcm", 12)])
def test_generate_streams_plays_and_reports(browser, replicas, shots, capsys, fmt, patches):
    open_page(browser, replicas[0])
    state = generate(browser, f"Streaming {fmt} from the playground.", fmt, patches)
    seconds = patches * 7680 / 48000  # the never-stopping checkpoint makes every patch asked for
    assert state["bytes"] > 0 and state["chunks"] >= 1
    assert state["audioSeconds"] == pytest.approx(seconds, abs=0.1), state  # MP3 adds an encoder frame or so
    assert state["playbackStarted"] and state["playbackEnded"]
    if fmt == "mp3":
        # playback begins on the first frames, not on the whole file: with 6.4 s of audio made at the tiny model's
        # CPU pace the stream takes seconds, and the player starts in a fraction of one
        assert state["playbackStartedMs"] < state["streamEndedMs"], state
        player = browser.execute_script("const p = document.getElementById('player'); return [p.currentTime, "
                                        "p.duration]")
        assert player[0] == pytest.approx(player[1]) and player[1] == pytest.approx(seconds, abs=0.1)
    assert state["ttfbMs"] > 0 and state["rtf"] > 0
    assert browser.find_element(By.ID, "ttfb").text.endswith(" ms")
    assert float(browser.find_element(By.ID, "rtf").text) == pytest.approx(state["rtf"], abs=1e-3)
    link = browser.find_element(By.ID, "download")
    assert link.is_displayed() and link.get_attribute("download") == f"speech.{'mp3' if fmt == 'mp3' else 'wav'}"
    size = browser.execute_async_script("fetch(arguments[0]).then(r => r.blob()).then(b => arguments[1](b.size))",
                                        link.get_attribute("href"))
    assert size == state["bytes"] + (44 if fmt == "pcm" else 0)  # PCM is saved as WAV
    shoot(browser, shots, f"generate-{fmt}", capsys)


def test_a_voice_uploaded_on_one_replica_speaks_on_the_other(browser, replicas, shots, capsys, tmp_path):
    a, b = replicas
    clip = tmp_path / "my-voice.wav"
    clip.write_bytes(wav_bytes(1.5, seed=3))
    open_page(browser, a)
    browser.find_element(By.ID, "clip").send_keys(str(clip))
    browser.find_element(By.ID, "transcript").send_keys("This is my voice.")
    browser.find_element(By.ID, "upload").click()
    wait_for(browser, lambda d: page_state(d).get("uploaded"), "the upload never finished")
    voice = page_state(browser)["uploaded"]
    assert voice.startswith("hifi:"), browser.find_element(By.ID, "status").text

    open_page(browser, b)
    wait_for(browser, lambda d: voice in (page_state(d).get("voices") or []), f"replica B never listed {voice}")
    Select(browser.find_element(By.ID, "voice")).select_by_value(voice)
    browser.find_element(By.ID, "design").send_keys("a calm voice")
    state = generate(browser, "Spoken on the other replica.", "pcm", 6)
    assert state["request"]["hifi_id"] == voice.split(":")[1]
    assert state["request"]["target_text"] == "(a calm voice)Spoken on the other replica."
    assert state["audioSeconds"] == pytest.approx(6 * 7680 / 48000) and state["playbackEnded"]
    shoot(browser, shots, "voice-from-the-other-replica", capsys)


def test_the_page_can_be_turned_off(tmp_path):
    """NANOVLLM_PLAYGROUND=false: / is not served (the routes alone; no model needed, so the lifespan is not run)."""
    for enabled, status in ((False, 404), (True, 200)):
        client = TestClient(create_app(Settings(cache_dir=tmp_path, playground=enabled)))
        assert client.get("/").status_code == status
        assert client.get("/playground/app.js").status_code == status
