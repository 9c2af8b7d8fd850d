"""Headless Chromium driven over the DevTools protocol, with the standard library only.

Opens a page from disk and reports what a person would see and what a test must check: console
messages and uncaught errors, every network request the page makes, the values of expressions
evaluated in it, real mouse events (`Input.dispatchMouseEvent`), and screenshots. The profile
page's tests, its load-time benchmark and `python -m ipusim.report DIR --html --screenshot
VIEW=PNG` use it.

Chromium is looked for as `$IPUSIM_CHROMIUM`, then `chromium`, `chromium-browser`,
`google-chrome` on the PATH (Debian: `apt-get install chromium`). It runs with its own
temporary profile, no sandbox (it often runs as root in containers), no GPU and no background
networking, and is stopped with the `Browser` (a context manager).
"""
from __future__ import annotations

import base64
import json
import os
import shutil
import socket
import struct
import subprocess
import tempfile
import time
import urllib.parse

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--no-default-browser-check",
         "--disable-extensions", "--disable-dev-shm-usage", "--hide-scrollbars", "--mute-audio",
         "--disable-features=Translate,MediaRouter,OptimizationHints", "--remote-debugging-port=0")


class BrowserUnavailable(RuntimeError):
    """No Chromium to run, or it did not start."""


def find_chromium() -> str | None:
    """The Chromium executable to use, or None."""
    given = os.environ.get("IPUSIM_CHROMIUM")
    if given:
        return given if os.path.isfile(given) or shutil.which(given) else None
    for name in CANDIDATES:
        path = shutil.which(name)
        if path:
            return path
    return None


# =========================================================================================
# A WebSocket client (RFC 6455), enough for the DevTools protocol
# =========================================================================================
class WebSocket:
    def __init__(self, url: str, timeout: float):
        u = urllib.parse.urlparse(url)
        self.sock = socket.create_connection((u.hostname, u.port), timeout=timeout)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall((f"GET {u.path} HTTP/1.1\r\nHost: {u.hostname}:{u.port}\r\nUpgrade: websocket\r\n"
                           f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
                           ).encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = self.sock.recv(4096)
            if not chunk:
                raise BrowserUnavailable("the browser closed the DevTools connection during the handshake")
            head += chunk
        status, _, rest = head.partition(b"\r\n\r\n")
        if b" 101 " not in status.split(b"\r\n")[0]:
            raise BrowserUnavailable(f"the browser refused the DevTools connection: {status[:200]!r}")
        self.buffer = rest

    def _exact(self, n: int) -> bytes:
        while len(self.buffer) < n:
            chunk = self.sock.recv(max(65536, n - len(self.buffer)))
            if not chunk:
                raise BrowserUnavailable("the browser closed the DevTools connection")
            self.buffer += chunk
        out, self.buffer = self.buffer[:n], self.buffer[n:]
        return out

    def _frame(self, opcode: int, data: bytes) -> None:
        n = len(data)
        head = bytes([0x80 | opcode])
        if n < 126:
            head += bytes([0x80 | n])
        elif n < 65536:
            head += bytes([0x80 | 126]) + struct.pack(">H", n)
        else:
            head += bytes([0x80 | 127]) + struct.pack(">Q", n)
        mask = os.urandom(4)
        masked = (int.from_bytes(data, "little") ^ int.from_bytes(mask * (n // 4 + 1), "little")
                  & ((1 << (8 * n)) - 1)).to_bytes(n, "little") if n else b""
        self.sock.sendall(head + mask + masked)

    def send(self, text: str) -> None:
        self._frame(0x1, text.encode())

    def recv(self) -> str:
        """The next text message (pings answered, fragments joined)."""
        parts = []
        while True:
            b0, b1 = self._exact(2)
            opcode, n = b0 & 0x0F, b1 & 0x7F
            if n == 126:
                n = struct.unpack(">H", self._exact(2))[0]
            elif n == 127:
                n = struct.unpack(">Q", self._exact(8))[0]
            mask = self._exact(4) if b1 & 0x80 else None
            data = self._exact(n)
            if mask:
                data = bytes(b ^ mask[i % 4] for i, b in enumerate(data))
            if opcode == 0x8:
                raise BrowserUnavailable("the browser closed the DevTools connection")
            if opcode == 0x9:
                self._frame(0xA, data)
                continue
            if opcode == 0xA:
                continue
            parts.append(data)
            if b0 & 0x80:
                return b"".join(parts).decode()

    def close(self) -> None:
        try:
            self._frame(0x8, b"")
        except OSError:
            pass
        self.sock.close()


# =========================================================================================
# The browser and its pages
# =========================================================================================
class Browser:
    """A headless Chromium of our own (its process and temporary profile are ours to remove)."""

    def __init__(self, executable: str | None = None, timeout: float = 30.0):
        self.executable = executable or find_chromium()
        if self.executable is None:
            raise BrowserUnavailable("no Chromium found: install it (Debian: apt-get install chromium) or set "
                                     "IPUSIM_CHROMIUM to its path")
        self.timeout = timeout
        self.profile = tempfile.mkdtemp(prefix="ipusim-chromium-")
        self.log = open(os.path.join(self.profile, "stderr.log"), "wb")
        self.process = subprocess.Popen([self.executable, *FLAGS, f"--user-data-dir={self.profile}", "about:blank"],
                                        stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log)
        self.ws = None
        self._ids = 0
        self.events: dict[str | None, list[dict]] = {}
        try:
            self.ws = WebSocket(self._endpoint(), timeout)
        except BaseException:
            self.close()
            raise

    def _endpoint(self) -> str:
        path = os.path.join(self.profile, "DevToolsActivePort")
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise BrowserUnavailable(f"{self.executable} exited with status {self.process.returncode}: "
                                         f"{self._stderr_tail()}")
            if os.path.exists(path):
                lines = open(path).read().split()
                if len(lines) >= 2:
                    return f"ws://127.0.0.1:{lines[0]}{lines[1]}"
            time.sleep(0.05)
        raise BrowserUnavailable(f"{self.executable} did not open its DevTools port within {self.timeout:.0f} s: "
                                 f"{self._stderr_tail()}")

    def _stderr_tail(self) -> str:
        try:
            with open(os.path.join(self.profile, "stderr.log"), "rb") as f:
                lines = [ln for ln in f.read().decode(errors="replace").splitlines() if "dbus" not in ln]
            return " | ".join(lines[-5:])
        except OSError:
            return ""

    def call(self, method: str, params: dict | None = None, session: str | None = None,
             timeout: float | None = None) -> dict:
        """Send one command and wait for its result; events that arrive meanwhile are kept."""
        self._ids += 1
        msg = {"id": self._ids, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        self.ws.send(json.dumps(msg))
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            reply = self._next(deadline, method)
            if reply.get("id") == self._ids:
                if "error" in reply:
                    raise RuntimeError(f"DevTools {method}: {reply['error'].get('message')}")
                return reply.get("result", {})

    def _next(self, deadline: float, waiting_for: str) -> dict:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no answer from the browser to {waiting_for}")
        self.ws.sock.settimeout(left)
        try:
            msg = json.loads(self.ws.recv())
        except socket.timeout:
            raise TimeoutError(f"no answer from the browser to {waiting_for}") from None
        if "method" in msg:
            self.events.setdefault(msg.get("sessionId"), []).append(msg)
        return msg

    def wait_event(self, session: str, method: str, timeout: float | None = None) -> dict:
        """Wait for (and consume) the next event `method` of a session."""
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            for e in self.events.get(session, []):
                if e["method"] == method and not e.get("_seen"):
                    e["_seen"] = True
                    return e["params"]
            self._next(deadline, method)

    def new_page(self, width: int = 1400, height: int = 900) -> "Page":
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        return Page(self, target, session, width, height)

    def close(self) -> None:
        if self.ws is not None:
            try:
                self.call("Browser.close", timeout=5)
            except (OSError, RuntimeError, TimeoutError, BrowserUnavailable):
                pass
            self.ws.close()
            self.ws = None
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Page:
    """One tab: open a file, evaluate, move the mouse, take screenshots; keeps its console
    messages, uncaught errors and network requests."""

    def __init__(self, browser: Browser, target: str, session: str, width: int, height: int):
        self.browser, self.target, self.session = browser, target, session
        for domain in ("Page", "Runtime", "Network", "Log"):
            self.call(f"{domain}.enable")
        self.resize(width, height)

    def call(self, method: str, params: dict | None = None, timeout: float | None = None) -> dict:
        return self.browser.call(method, params, self.session, timeout)

    def resize(self, width: int, height: int) -> None:
        self.width, self.height = width, height
        self.call("Emulation.setDeviceMetricsOverride", {"width": width, "height": height, "deviceScaleFactor": 1,
                                                         "mobile": False})

    def _events(self, *methods: str) -> list[dict]:
        return [e for e in self.browser.events.get(self.session, []) if e["method"] in methods]

    def open(self, path_or_url: str, timeout: float | None = None) -> None:
        """Navigate and wait for the load event (a file path becomes a file:// URL; a URL that
        differs from the current one only by its fragment changes the fragment, without a load)."""
        url = path_or_url
        if not url.startswith(("about:", "file:", "http:", "https:", "data:")):
            path, _, fragment = url.partition("#")
            url = "file://" + urllib.parse.quote(os.path.abspath(path)) + (f"#{fragment}" if fragment else "")
        for e in self._events("Page.loadEventFired"):
            e["_seen"] = True
        result = self.call("Page.navigate", {"url": url})
        if "errorText" in result:
            raise RuntimeError(f"could not open {url}: {result['errorText']}")
        if "loaderId" in result:
            self.browser.wait_event(self.session, "Page.loadEventFired", timeout)

    def evaluate(self, expression: str, timeout: float | None = None):
        """The value of a JavaScript expression (a promise is awaited)."""
        out = self.call("Runtime.evaluate", {"expression": expression, "awaitPromise": True, "returnByValue": True},
                        timeout)
        if "exceptionDetails" in out:
            d = out["exceptionDetails"]
            raise RuntimeError(f"JavaScript error: {d.get('exception', {}).get('description') or d.get('text')}")
        return out.get("result", {}).get("value")

    def hover(self, x: float, y: float) -> None:
        """A real mouse move to (x, y) in CSS pixels of the viewport."""
        self.call("Input.dispatchMouseEvent", {"type": "mouseMoved", "x": x, "y": y, "button": "none"})

    def wheel(self, x: float, y: float, delta_y: float) -> None:
        self.call("Input.dispatchMouseEvent", {"type": "mouseWheel", "x": x, "y": y, "deltaX": 0, "deltaY": delta_y})

    def screenshot(self, path: str | None = None, selector: str | None = None, fast: bool = False) -> bytes:
        """A PNG of the viewport, or of the element `selector` (scrolled to, whole); `fast`
        encodes it for speed (larger, every row with the same simple filter)."""
        params: dict = {"format": "png", "optimizeForSpeed": fast}
        if selector is not None:
            box = self.evaluate(f"(() => {{ const e = document.querySelector({json.dumps(selector)});"
                                " if (!e) return null; const r = e.getBoundingClientRect();"
                                " return [r.left + scrollX, r.top + scrollY, r.width, r.height]; })()")
            if box is None:
                raise ValueError(f"no element {selector!r} on the page")
            x, y, w, h = box
            params.update(clip={"x": x, "y": y, "width": max(1, w), "height": max(1, h), "scale": 1},
                          captureBeyondViewport=True)
        data = base64.b64decode(self.call("Page.captureScreenshot", params)["data"])
        if path is not None:
            with open(path, "wb") as f:
                f.write(data)
        return data

    def console(self) -> list[tuple[str, str]]:
        """(level, text) of every console message, log entry and uncaught exception so far."""
        out = []
        for e in self._events("Runtime.consoleAPICalled", "Runtime.exceptionThrown", "Log.entryAdded"):
            p = e["params"]
            if e["method"] == "Runtime.consoleAPICalled":
                out.append((p["type"], " ".join(str(a.get("value", a.get("description", ""))) for a in p["args"])))
            elif e["method"] == "Runtime.exceptionThrown":
                d = p["exceptionDetails"]
                out.append(("error", d.get("exception", {}).get("description") or d.get("text", "")))
            else:
                out.append((p["entry"]["level"], p["entry"]["text"]))
        return out

    def errors(self) -> list[str]:
        """Console errors and warnings, log errors and uncaught exceptions."""
        return [text for level, text in self.console() if level in ("error", "warning", "assert")]

    def requests(self) -> list[str]:
        """The URL of every request the page made (its own document included)."""
        return [e["params"]["request"]["url"] for e in self._events("Network.requestWillBeSent")]

    def close(self) -> None:
        self.browser.call("Target.closeTarget", {"targetId": self.target})


__all__ = ["Browser", "BrowserUnavailable", "Page", "find_chromium"]
