"""Headless Chromium (Debian's package; `bash setup.sh` installs it) driven with `--dump-dom`: open a page from
disk with the network blocked, let its script run, and read back the DOM it left and what it wrote to the console.
No DevTools client and no new dependency: the page's script records its own errors into the DOM (#errors,
`data-status`) and Chromium's `--enable-logging=stderr` prints every console message as a `:CONSOLE` line."""

from __future__ import annotations

import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="no headless Chromium on this machine: `bash setup.sh` "
                                    "installs Debian's package (apt-get install chromium)")
BLOCK_NETWORK = ["--proxy-server=127.0.0.1:9", "--host-resolver-rules=MAP * ~NOTFOUND"]


class Dom(HTMLParser):
    """The elements of a page: tag and attributes of each, and the text inside each one that has an id."""

    VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}

    def __init__(self, text: str) -> None:
        super().__init__()
        self.elements: list[tuple[str, dict[str, str]]] = []
        self.text: dict[str, str] = {}
        self._stack: list[tuple[str, str | None]] = []  # (tag, id) of the open elements
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list) -> None:
        a = {k: v or "" for k, v in attrs}
        a["_in"] = " ".join(id_ for _, id_ in self._stack if id_)  # the ids of its ancestors
        self.elements.append((tag, a))
        if tag not in self.VOID:
            self._stack.append((tag, a.get("id")))
            if a.get("id"):
                self.text.setdefault(a["id"], "")

    def handle_endtag(self, tag: str) -> None:
        while self._stack:
            if self._stack.pop()[0] == tag:
                break

    def handle_data(self, data: str) -> None:
        for _, id_ in self._stack:
            if id_:
                self.text[id_] += data

    def by_id(self, id_: str) -> dict[str, str]:
        """The attributes of the element with this id."""
        return next(a for _, a in self.elements if a.get("id") == id_)

    def with_class(self, cls: str) -> list[dict[str, str]]:
        """The attributes of every element having this class."""
        return [a for _, a in self.elements if cls in a.get("class", "").split()]

    def inside(self, tag: str, id_: str) -> list[dict[str, str]]:
        """The attributes of every `tag` element inside the element with this id."""
        return [a for t, a in self.elements if t == tag and id_ in a["_in"].split()]

    def status(self) -> str:
        """What the page's script says of itself: body[data-status] (loading | ready | error)."""
        return next(a for t, a in self.elements if t == "body").get("data-status", "")


def load(page: Path, profile: Path) -> tuple[Dom, str, list[str]]:
    """(the DOM after the page's script ran, its raw text, the console lines) of `page` in headless Chromium."""
    args = [CHROMIUM, "--headless", "--disable-gpu", "--no-sandbox", "--no-first-run", "--disable-extensions",
            f"--user-data-dir={profile}", *BLOCK_NETWORK, "--enable-logging=stderr", "--v=0",
            "--window-size=1400,2000", "--virtual-time-budget=10000", "--dump-dom", page.resolve().as_uri()]
    done = subprocess.run(args, capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr[-2000:]
    console = [line for line in done.stderr.splitlines() if ":CONSOLE" in line]
    return Dom(done.stdout), done.stdout, console
