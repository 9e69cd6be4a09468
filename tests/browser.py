"""Debian's headless chromium, driven over the DevTools protocol on a pipe (no extra library).

``--remote-debugging-pipe`` makes chromium read NUL-terminated JSON commands on fd 3 and write
replies and events on fd 4. :class:`Browser` opens one page, evaluates JavaScript in it and takes
screenshots, with every wait bounded.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import tempfile
import time
from typing import Any

FLAGS = [
    "--headless",
    "--no-sandbox",  # CI runs as root
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--remote-debugging-pipe",
    "--window-size=1200,900",
]


def chromium() -> str | None:
    """The chromium binary, if installed."""
    return shutil.which("chromium")


class Browser:
    """One headless chromium with a fresh profile; close() kills it and removes the profile."""

    def __init__(self, binary: str) -> None:
        self.profile = tempfile.TemporaryDirectory(prefix="arendez-chromium-")
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()

        def fds() -> None:  # in the child: the protocol's fds 3 and 4
            os.dup2(to_browser_r, 3)
            os.dup2(from_browser_w, 4)

        self.proc = subprocess.Popen(
            [binary, *FLAGS, f"--user-data-dir={self.profile.name}", "about:blank"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=fds,  # runs before the child closes other fds: pass_fds keeps 3 and 4
            pass_fds=(3, 4),
            start_new_session=True,
        )
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buffer = b""
        self._next_id = 0
        self.session = ""

    def call(self, method: str, params: dict[str, Any] | None = None, timeout: float = 15.0) -> Any:
        """Send one command (to the page once :meth:`open` ran) and return its result."""
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if self.session and not method.startswith("Target."):
            message["sessionId"] = self.session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self._read(deadline, method)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise AssertionError(f"chromium: {method} failed: {reply['error']}")
                return reply.get("result", {})

    def _read(self, deadline: float, what: str) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._from_browser], [], [], left)[0]:
                raise AssertionError(f"chromium did not answer {what} in time")
            chunk = os.read(self._from_browser, 1 << 20)
            if not chunk:
                raise AssertionError(f"chromium closed its pipe (exit code {self.proc.poll()})")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        parsed: dict[str, Any] = json.loads(message)
        return parsed

    def open(self, url: str) -> None:
        """Open ``url`` in a new page and attach to it."""
        target = self.call("Target.createTarget", {"url": url})["targetId"]
        self.session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page."""
        result = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float, what: str) -> Any:
        """Poll ``expression`` until truthy (bounded); return its value."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                text = self.evaluate("document.body.innerText")
                raise AssertionError(f"the page never showed {what} in {timeout}s; it shows:\n{text}")
            time.sleep(0.2)

    def screenshot(self) -> bytes:
        """The page as PNG bytes."""
        return base64.b64decode(self.call("Page.captureScreenshot", {"format": "png"})["data"])

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):  # chromium and its helpers: one process group
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        os.close(self._to_browser)
        os.close(self._from_browser)
        self.profile.cleanup()
